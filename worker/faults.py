"""Fault injection for chaos tests and drills; inert unless its variable is set.

DIFFQ_FAULT_POISON=<text>: any batch holding a prompt that contains <text> raises in
generation, as a prompt that crashes a real pipeline would.
"""

from __future__ import annotations

import os

from diffq.contract import BatchItem


class PoisonedPrompt(RuntimeError):
    pass


def check(items: list[BatchItem]) -> None:
    poison = os.environ.get("DIFFQ_FAULT_POISON")
    if poison and any(poison in item.prompt for item in items):
        raise PoisonedPrompt(f"prompt containing {poison!r} makes generation fail")
