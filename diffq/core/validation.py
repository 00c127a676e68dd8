"""What a pydantic error says to a user: its first error, by field."""
from __future__ import annotations

from pydantic import ValidationError


def first_error(exc: ValidationError) -> tuple[str | None, str]:
    """(the dotted field, the message) of a validation error's first error; the field
    is None where the error is the whole object's (a model validator's)."""
    error = exc.errors()[0]
    field = ".".join(str(part) for part in error["loc"]) or None
    return field, error["msg"].removeprefix("Value error, ")
