"""The generation options, each declared once: its type, default, bounds and help.

`run`, `submit`, `plan` and `qualify` take them on the command line (diffq/app/options.py
builds the options from this model), the producer turns them into shape keys and
batch parameters (producer/submit.py `make_options`), the manifest records them
(core/records.py `RunDefaults`), `fleet manifests` renders the queues a submit with
the same options fills, and qualify measures with them. The bounds are the queue
contract's own (core/contract.py): an option the contract would refuse is refused
where it is typed, naming the option.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from diffq.core.contract import (AUTO_DTYPE, FITS, SHAPE_DTYPE_TAGS, AdapterRef, BatchSize, GuidanceScale,
                                 ImageSide, InferenceSteps, SequenceLength)
from diffq.core.layout import IMAGE_FORMATS
from diffq.core.validation import first_error

# The smallest side a run may ask for: the families' size multiple.
MIN_SIDE = 16
# --batch-size auto: each shape's batch size from the --speedup profile.
AUTO = "auto"


class GenerationOptions(BaseModel):
    """A run's generation options (the per-row defaults among them: a row may name its
    own size, steps and guidance scale)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: BatchSize | Literal[AUTO] = Field(  # type: ignore[valid-type]
        4, description="Images per compiled batch, or auto: each shape's from the --speedup profile")
    steps: InferenceSteps = Field(4, description="Default num_inference_steps")
    guidance_scale: GuidanceScale = Field(1.0, description="Default guidance scale (> 1 turns CFG on)")
    max_sequence_length: SequenceLength = Field(64, description="Text tokens per prompt (padded)")
    height: ImageSide = Field(128, ge=MIN_SIDE,
                              description="Default image height (multiple of 16, any with --size-buckets)")
    width: ImageSide = Field(128, ge=MIN_SIDE,
                             description="Default image width (multiple of 16, any with --size-buckets)")
    format: Literal[tuple(IMAGE_FORMATS)] = Field("png", description="Image file format")  # type: ignore[valid-type]
    dtype: Literal[tuple(SHAPE_DTYPE_TAGS)] = Field(  # type: ignore[valid-type]
        AUTO_DTYPE, description="Pipeline dtype, part of the shape key: auto (each worker runs its device's default: "
                                "bfloat16 on neuron, tpu, cuda; float32 on cpu) or a pinned dtype")
    size_buckets: str | None = Field(
        None, description="HxW[,HxW…] and/or a preset (aspect-1024, aspect-512, aspect-256): each row is generated "
                          "at the bucket of nearest aspect ratio; requested sizes need not be multiples of 16")
    fit: Literal[FITS] = Field(  # type: ignore[valid-type]
        "none", description="With --size-buckets: store the bucket's image as is (none), resized to the requested "
                            "size (resize), or scaled and centre-cropped to it (crop)")
    keep_columns: tuple[str, ...] = Field(
        (), description="CSV/Parquet columns a,b moved into each row's metadata (other unknown columns stay errors)")
    embed_metadata: bool = Field(
        True, description="Write prompt, seed, steps, ... into each image file (PNG text, EXIF UserComment)")
    speedup: str | None = Field(
        None, description="Step cache, quantized weights and/or attention backend, e.g. taylorseer:cache_interval=3, "
                          "quant:int8wo or mag:mag_ratios=flux+attention:_native_math (docs/speedups.md): applied "
                          "by each worker through diffusers and torchao, recorded with every image; or a profile "
                          "FILE.json from "
                          "`diffq qualify --speedups --profile`: each shape's own choice")
    unreproducible_speedup: bool = Field(
        False, description="Let a speed-up that decides from the whole batch run (firstblock, quant:int8dq-tensor): "
                           "an image then depends on its batch neighbours, and its record says so")
    lora: tuple[AdapterRef, ...] = Field(
        (), description="LoRA adapter for rows without their own `lora` field: PATH (a .safetensors file, a folder, "
                        "s3://, gs:// or a Hub id) or PATH@SCALE (repeatable: the adapters stack, up to 4). "
                        "Checked from its header and pinned at submit; hot-swapped into the compiled graphs")
    lora_text_encoder: Literal["refuse", "drop"] = Field(
        "refuse", description="A LoRA file's text-encoder part, which cannot be hot-swapped: refuse the file, or "
                              "drop that part and run its transformer part (every record says so); a row's lora "
                              "object may say \"text_encoder\": \"drop\" for its own")

    # The --speedup profile FILE.json as loaded once by the validator (None for a spec).
    _profile = PrivateAttr(None)

    @model_validator(mode="after")
    def _speedup(self) -> GenerationOptions:
        """The spec in canonical form, refused here (before any row is read) where diffq
        does not offer it at all; a profile loaded and checked here, once."""
        from diffq.core.profile import SpeedupProfile, is_profile
        from diffq.core.speedups import SpeedupError, canonical

        if is_profile(self.speedup):
            self._profile = SpeedupProfile.load(self.speedup)
            for shape in self._profile.shapes:  # a bad file fails here, not per row
                canonical(shape.chosen.speedup, unreproducible=self.unreproducible_speedup)
        else:
            try:
                spec = canonical(self.speedup, unreproducible=self.unreproducible_speedup)
            except SpeedupError as exc:
                raise ValueError(f"--speedup: {exc}") from None
            object.__setattr__(self, "speedup", spec)
        if self.batch_size == AUTO and self.speedup_profile is None:
            raise ValueError("--batch-size auto takes each shape's batch size from a --speedup profile FILE.json "
                             "(`diffq qualify --speedups --profile FILE.json`)")
        if self.fit != "none" and not self.size_buckets:
            raise ValueError(f"--fit {self.fit} needs --size-buckets: without buckets every image is "
                             "generated at the size its row asks for")
        return self

    @property
    def profile(self):
        """The loaded speed-up profile (core/profile.py `SpeedupProfile`), or None for a spec."""
        return self._profile

    @property
    def speedup_profile(self) -> str | None:
        """The profile file --speedup names, or None for a spec."""
        from diffq.core.profile import is_profile

        return self.speedup if is_profile(self.speedup) else None

    @field_validator("lora", mode="before")
    @classmethod
    def _lora(cls, value):
        """A spec as typed (`PATH`, `PATH@0.8`), an object, or a list of them (core/adapters.py
        parse_spec); the files are checked against the model by the producer."""
        from diffq.core.adapters import AdapterError, check_set, parse_spec

        if value is None or isinstance(value, (list, tuple)) and all(isinstance(v, AdapterRef) for v in value):
            return tuple(value or ())
        try:
            refs = parse_spec(list(value) if isinstance(value, tuple) else value, "--lora")
            check_set(refs, "--lora")
        except AdapterError as exc:
            raise ValueError(f"--lora: {exc.message}" if exc.field == "--lora" else
                             f"--lora: {exc.field}: {exc.message}") from None
        return refs

    @field_validator("keep_columns", mode="before")
    @classmethod
    def _columns(cls, value):
        """'a, b' as typed on the command line, or a list."""
        if value is None:
            return ()
        if isinstance(value, str):
            return tuple(name.strip() for name in value.split(",") if name.strip())
        return tuple(value)

    @classmethod
    def given(cls, options: GenerationOptions | None, values: dict) -> GenerationOptions:
        """`options` as built where the user typed them, or (the Python API's keyword
        arguments) built from `values` here; never both."""
        if options is None:
            return cls.of(**values)
        if values:
            raise TypeError(f"options given twice: as an object and as {', '.join(sorted(values))}")
        return options

    @classmethod
    def of(cls, **values) -> GenerationOptions:
        """The options from keyword arguments; a bad one raises ValueError naming its option."""
        try:
            return cls(**values)
        except ValidationError as exc:
            field, message = first_error(exc)
            name = "--" + field.split(".")[0].replace("_", "-") if field else "options"
            raise ValueError(message if message.startswith("--") else f"{name}: {message}") from None


# The defaults, for whoever needs one value (a fleet rendered without options watches
# the queues a submit without options fills).
DEFAULTS = GenerationOptions()
