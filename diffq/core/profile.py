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
from typing import ClassVar

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


class ProfileFile(BaseModel):
    """What both profiles share: read from a JSON file with the field at fault named, written back."""

    what: ClassVar[str] = "profile"

    @classmethod
    def load(cls, path: str | Path):
        try:
            return cls.model_validate_json(Path(path).read_bytes())
        except ValidationError as exc:
            field, message = first_error(exc)
            raise ValueError(f"{path}: not a diffq {cls.what} ({field or 'profile'}: {message})") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a diffq {cls.what} ({str(exc).splitlines()[0]})") from None

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")


class SpeedupProfile(ProfileFile):
    what: ClassVar[str] = "speed-up profile"

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



def is_profile(value: str | None) -> bool:
    """A --speedup value that names a profile file rather than a spec."""
    return bool(value) and value.endswith(".json") and Path(value).is_file()


# --- the LoRA mode a device proved (`qualify --lora A,B --lora-mode M --profile FILE.json`) ---


class LoraMeasure(BaseModel):
    """One LoRA mode as `qualify --lora` measured it on the profile's device."""

    model_config = ConfigDict(extra="forbid")

    mode: str  # swap, fuse, compile (worker/device/lora_modes.py)
    ok: bool  # its lora check passed: each change showed, no graph compiled where none may
    s_per_image_with: float | None = None  # steady state, batches with adapters
    s_per_image_without: float | None = None
    change_s: float | None = None  # median set-change time
    refused: str | None = None  # why the change check failed, if it did


class LoraProfile(ProfileFile):
    what: ClassVar[str] = "LoRA profile"

    """Per LoRA mode, what `qualify --lora` measured on one model, device (and generation,
    where the backend table detects it), compile mode and versions; each qualify run of a
    mode adds (or replaces) its row. `--lora-mode FILE.json` on run, worker and `fleet
    manifests` is `auto` through it: the cheapest mode that passed (by s/image with
    adapters), where the worker matches it (`mismatch`); elsewhere the backend table's mode
    (worker/device/lora_modes.py resolve)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "lora"
    version: int = 1
    model: str
    device: str
    generation: str | None = None
    compile: str
    versions: dict[str, str] = Field(default_factory=dict)  # torch and the device's packages, as measured
    measured: list[LoraMeasure] = Field(default_factory=list)

    @property
    def chosen(self) -> LoraMeasure | None:
        passed = [m for m in self.measured if m.ok and m.s_per_image_with is not None]
        return min(passed, key=lambda m: m.s_per_image_with) if passed else None

    def mismatch(self, device: str, compile_mode: str, *, generation: str | None,
                 models: list[str] | None = None, versions: dict[str, str] | None = None) -> str | None:
        """Why this profile does not speak for a worker on `device` (its `generation`),
        `compile_mode`, serving `models` with `versions` installed (torch and the device's
        packages), or None where it does. `models` None: not known here (a discovery worker
        serving every model); `versions` None: not this host's to check (a fleet render)."""
        said = [f"{what} {here or 'unknown'} here, {there or 'unknown'} in the profile"
                for what, here, there in (("--device", device, self.device),
                                          ("generation", generation, self.generation),
                                          ("--compile", compile_mode, self.compile)) if here != there]
        if models is not None and (others := sorted(set(models) - {self.model})):
            said.append(f"model {', '.join(others)} here, {self.model} in the profile")
        if versions is not None:
            said += [f"{package} {versions.get(package) or 'absent'} here, {self.versions.get(package) or 'absent'} "
                     f"in the profile" for package in sorted(set(versions) | set(self.versions))
                     if versions.get(package) != self.versions.get(package)]
        return "; ".join(said) or None

    def lora_mode_for(self, device: str, compile_mode: str, *, generation: str | None,
                      models: list[str] | None = None, versions: dict[str, str] | None = None
                      ) -> tuple[str, str] | None:
        """The proven mode and why, where this profile was measured on this device,
        generation, compile mode, model and versions (`mismatch`); None elsewhere (the
        backend table decides)."""
        if self.mismatch(device, compile_mode, generation=generation, models=models, versions=versions) \
                or (chosen := self.chosen) is None:
            return None
        recorded = ", ".join(f"{name} {version}" for name, version in sorted(self.versions.items()))
        unchecked = "" if versions is not None else "; versions recorded, not checked here"
        return chosen.mode, (f"the profile measured on --device {self.device}"
                             f"{f' {self.generation}' if self.generation else ''} --compile {self.compile} "
                             f"({recorded}{unchecked}): {chosen.mode} passed at {chosen.s_per_image_with:g} s/image "
                             f"with adapters")

    def with_measure(self, measure: LoraMeasure) -> LoraProfile:
        return self.model_copy(update={"measured": [m for m in self.measured if m.mode != measure.mode] + [measure]})



def lora_mode_and_profile(value: str) -> tuple[str, LoraProfile | None]:
    """`--lora-mode`'s value as (mode or auto, the profile it names or None)."""
    if value.endswith(".json"):
        return "auto", LoraProfile.load(value)
    return value, None
