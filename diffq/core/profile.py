"""A speed-up profile: per shape, the fastest speed-up and batch size that stayed within
a quality budget, as `diffq qualify --speedups --profile FILE` measured them on the
user's own prompts and seeds.

`run` / `submit --speedup FILE` apply each shape's chosen speed-up, `--batch-size auto`
takes each shape's batch size from it, and `plan --rates FILE` its measured rates. The
file is JSON, one schema (this module), written by qualify and read by the producer.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diffq.core.contract import BatchSize
from diffq.core.validation import first_error


class Candidate(BaseModel):
    """One measured configuration of a shape."""

    model_config = ConfigDict(extra="forbid")

    speedup: str | None  # canonical spec (core/speedups.py); None: full compute
    batch_size: BatchSize
    seconds_per_image: float = Field(ge=0)  # steady state
    psnr: float | None = None  # dB against full compute on the same prompts and seeds (None: it is full compute)
    ssim: float | None = None
    within_budget: bool = True
    refused: str | None = None  # why the device could not run it (then nothing was measured)
    # Why it was not measured although the device offers it (over --max-candidates).
    skipped: str | None = None


class ShapeChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    height: int
    width: int
    chosen: Candidate  # the fastest within the budget (full compute when nothing else is)
    candidates: list[Candidate] = Field(default_factory=list)


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_psnr: float
    min_ssim: float


class SpeedupProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    model: str
    device: str
    compile: str
    steps: int
    # What `plan --rates FILE` needs to use the tuned rates (older profiles: unknown).
    dtype: str | None = None
    guidance_scale: float | None = None
    load_s: float | None = None
    budget: Budget
    shapes: list[ShapeChoice]
    # The random-weight caveat travels with the figures.
    note: str = ("fidelity is measured against full compute on these prompts and seeds; on random weights it shows "
                 "the mechanism, not a model's real quality loss")

    def for_size(self, height: int, width: int) -> ShapeChoice | None:
        return next((s for s in self.shapes if (s.height, s.width) == (height, width)), None)

    @classmethod
    def load(cls, path: str | Path) -> SpeedupProfile:
        try:
            return cls.model_validate_json(Path(path).read_bytes())
        except ValidationError as exc:
            field, message = first_error(exc)
            raise ValueError(f"{path}: not a diffq speed-up profile ({field or 'profile'}: {message})") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a diffq speed-up profile ({str(exc).splitlines()[0]})") from None

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")


def is_profile(value: str | None) -> bool:
    """A --speedup value that names a profile file rather than a spec."""
    return bool(value) and value.endswith(".json") and Path(value).is_file()
