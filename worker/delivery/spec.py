"""A worker process's spec and plan: what it serves, how it is pinned, its environment.

Torch-free and Celery-free: the supervisor, the CLI's `--plan` and the fleet import
it without loading a device runtime. The child that runs a spec is child.py.
"""

from __future__ import annotations

import re
import socket
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diffq.core.adapters import AdapterLayout
from diffq.core.contract import AUTO_DTYPE, ShapeKey, queue_dtype, shape_from_queue
from diffq.worker.delivery.admission import RunScope
from diffq.worker.device.backends import COMPILING_MODES, Backend, Placement, get_backend
from diffq.worker.device.compile_cache import CachePlan, plan_cache
from diffq.worker.device import lora_modes
from diffq.worker.device.lora_modes import DEFAULT_LORA_MODE, LORA_MODE_CHOICES

# Exit code for a child that can never succeed (bad model, bad option): the
# supervisor must not restart it in a loop.
EXIT_FATAL = 3
# After SIGTERM, how long the batch in hand may take before it is handed back:
# below the smallest Kubernetes grace period the fleet manifests set (diffq/app/fleet.py
# passes each profile's own, grace - DRAIN_MARGIN_S).
DRAIN_MARGIN_S = 60
DRAIN_TIMEOUT_S = 240.0
# --on-degenerate: per policy, what becomes of an image each check finds (records.py
# DEGENERATE_CHECKS): "fail" fails the item (not stored; its failure record names the
# check; no retry, the same seed would make the same image), "flag" stores it with
# the check in its record. Only the checks a policy names run: `ignore` runs none.
DEGENERATE_POLICIES: dict[str, dict[str, str]] = {
    "fail": {"nonfinite": "fail", "flat": "fail"},
    "flag": {"nonfinite": "fail", "flat": "flag"},
    "ignore": {},
}
DEFAULT_DEGENERATE_POLICY = "flag"


class ChildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    device: str = "cpu"
    slot: int = 0  # the device index this process is pinned to
    # The process's place among its pod's processes (0..n-1, whatever devices the plugin
    # allocated): its metrics port is DIFFQ_METRICS_PORT + this, the pod's named ports.
    position: int = 0
    restarts: int = 0  # times the supervisor restarted it (its metrics say so)
    threads: int = 1
    broker_url: str
    transport_options: dict = Field(default_factory=dict)
    queues: list[str]
    compile: str = "none"
    offload: str | None = None
    compile_cache: str | None = None
    # Where a remote (URL) compile cache is mirrored on this host; default under /tmp.
    compile_cache_local: str | None = None
    # 'auto' (every served shape) or HxW sizes: compiled before consuming.
    warmup: list[str] = Field(default_factory=list)
    # No --queues: list the broker's shape queues every few seconds and serve those
    # of `serve_models` (empty: every model's). `rabbitmq_api`: AMQP's listing.
    discover: bool = False
    serve_models: list[str] = Field(default_factory=list)
    # With --queues: discover only these queues' LoRA runs (routing.py `Discovery`).
    variants_of: list[str] = Field(default_factory=list)
    rabbitmq_api: str | None = None
    # compile-aware: drain already-compiled shapes before taking a new one.
    routing: Literal["compile-aware", "round-robin"] = "compile-aware"
    # Compile, push the cache, print a JSON report and exit 0 (bake a cache in CI).
    warmup_only: bool = False
    # Debug hook: write the environment as seen before `import torch` to this file.
    env_report: str | None = None
    # Loaded before consuming, so a missing model fails the process at once.
    models: list[str] = Field(default_factory=list)
    dtype: str = AUTO_DTYPE
    # Per model, the LoRA layout of the runs it serves (their manifests'): its scaffold goes
    # in before the model is preloaded and compiled (`diffq run`; else on the first batch).
    adapter_layouts: dict[str, AdapterLayout] = Field(default_factory=dict)
    # How a batch's adapter set goes into the pipeline (worker/device/lora_modes.py LORA_MODES);
    # `auto` resolves from the backend table here (plan_children resolves it with a profile
    # first), so a spec always names the mode its records will.
    lora_mode: str = DEFAULT_LORA_MODE
    # The quantization schemes (core/speedups.py SCHEMES; None: full precision) the runs'
    # batches name: each model is preloaded with each (`diffq run`), so a quantized run
    # never holds a full-precision copy it does not use. None: full precision only.
    schemes: list[str | None] | None = None
    # None: DIFFQ_ALLOWED_OUT_PREFIXES; [] with `--any-out` (named, it wins over the setting)
    allowed_out_prefixes: list[str] | None = None
    # `--run OUT` / `diffq run`: the runs whose batches this worker takes (admission.py);
    # empty: any run under DIFFQ_ALLOWED_OUT_PREFIXES.
    runs: list[RunScope] = Field(default_factory=list)
    loglevel: str = "WARNING"
    drain_timeout_s: float = Field(default=DRAIN_TIMEOUT_S, ge=0)
    # Tensor-parallel group membership (worker/device/tensor_parallel.py). world_size 1 is
    # an independent worker; otherwise rank 0 consumes and the others follow it.
    rank: int = 0
    world_size: int = 1
    group: int = 0  # index of the group on this host
    group_slots: list[int] = Field(default_factory=list)  # the group's devices, in rank order
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Device generation where launch facts differ by it (TPU: v5e, v5p, v6e, v7).
    generation: str | None = None
    # --allow-fallback: a compiled graph failing at run time may re-run uncompiled
    # (counted); by default the batch fails instead (backends.py, GraphFallback).
    allow_fallback: bool = False
    # What becomes of a degenerate image (DEGENERATE_POLICIES).
    on_degenerate: str = DEFAULT_DEGENERATE_POLICY
    # Where `--<option> auto` read the devices: the variable and its value (for --plan).
    allocation: dict | None = None

    @field_validator("on_degenerate", "lora_mode")
    @classmethod
    def _in_its_table(cls, value: str, info) -> str:
        table = {"on_degenerate": DEGENERATE_POLICIES, "lora_mode": LORA_MODE_CHOICES}[info.field_name]
        if value not in table:
            raise ValueError(f"--{info.field_name.replace('_', '-')} {value}: choose {', '.join(table)}")
        return value

    @property
    def degenerate_policy(self) -> dict[str, str]:
        """check -> "fail" or "flag", for the checks this worker runs."""
        return DEGENERATE_POLICIES[self.on_degenerate]

    @field_validator("warmup")
    @classmethod
    def _warmup_entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            if entry != "auto" and not re.fullmatch(r"\d+x\d+", entry):
                raise ValueError(f"warmup entry '{entry}' is neither 'auto' nor HxW (e.g. 1024x1024)")
        return entries

    @model_validator(mode="after")
    def _lora_mode_resolved(self) -> ChildSpec:
        self.lora_mode = lora_modes.resolve(self.backend, self.compile, self.lora_mode)[0]
        return self

    @model_validator(mode="after")
    def _dtypes_served(self) -> ChildSpec:
        # A queue pinned to a dtype this device does not run would fail every batch.
        backend = self.backend
        for name, dtype in [("--dtype", self.dtype)] + [(q, queue_dtype(q)) for q in self.queues]:
            if dtype is not None and dtype not in backend.served_dtypes:
                raise ValueError(f"{name} is {dtype}, which --device {backend.name} does not run "
                                 f"(it runs {', '.join(backend.dtypes)}; auto is {backend.default_dtype})")
        return self

    @property
    def backend(self) -> Backend:
        return get_backend(self.device)

    @property
    def cache(self) -> CachePlan:
        return plan_cache(self.compile_cache, self.backend, self.compile_cache_local)

    def placement(self) -> Placement:
        return Placement(slot=self.slot, threads=self.threads, rank=self.rank,
                         group_slots=tuple(self.group_slots) if self.world_size > 1 else (),
                         master_addr=self.master_addr, master_port=self.master_port,
                         generation=self.generation)

    def env(self) -> dict[str, str]:
        """What this child adds to its environment before `import torch` (the backend table's)."""
        backend = self.backend
        env = backend.env(self.placement())
        env.update(backend.compile_env(self.compile, self.allow_fallback))
        env.update(self.cache.env)
        env["DIFFQ_WORKER_NAME"] = self.name
        return env

    def unset_env(self) -> tuple[str, ...]:
        """What this child removes from the environment it inherited (e.g. torchrun's, when single)."""
        return self.backend.unset(self.placement())

    def warmup_shapes(self) -> list[ShapeKey]:
        """The served shapes to compile before consuming; an HxW no queue serves is an error."""
        if not self.warmup:
            return []
        served = [s for s in (shape_from_queue(q, self.models) for q in self.queues) if s is not None
                  and self._layout_known(s)]
        if "auto" in self.warmup:
            return served
        shapes = []
        for entry in self.warmup:
            height, width = (int(x) for x in entry.split("x"))
            matching = [s for s in served if (s.height, s.width) == (height, width)]
            if not matching:
                raise ValueError(f"--warmup {entry}: no served queue of the loaded model has that size")
            shapes += [s for s in matching if s not in shapes]
        return shapes

    def _layout_known(self, shape: ShapeKey) -> bool:
        """Whether `shape` can be compiled before a batch: a LoRA queue's layout is known
        only from its run's manifest (`diffq run` passes it here; a fleet worker reads it
        with the first batch, and compiles then)."""
        layout = self.adapter_layouts.get(shape.model)
        return shape.lora is None or layout is not None and layout.label == shape.lora

    def plan(self) -> dict:
        backend = self.backend
        cache = self.cache
        return {
            "name": self.name,
            "device": backend.torch_device,
            "slot": self.slot,
            "env": self.env(),
            "unset": list(self.unset_env()),
            "queues": self.queues,
            # What each dtype the worker meets runs at here: auto is the device's default.
            "dtype": self.dtype,
            "runs_dtype": backend.dtype_for(self.dtype),
            "auto_dtype": backend.default_dtype,
            "serves_dtypes": list(backend.served_dtypes),
            **({"discover": True, "serve_models": self.serve_models} if self.discover else {}),
            **({"variants_of": self.variants_of} if self.variants_of else {}),
            "compile": self.compile,
            "compile_backend": backend.compile_backend,
            "compile_options": backend.compile_options if self.compile in COMPILING_MODES else None,
            "lora_mode": self.lora_mode,  # resolved (`auto` never reaches a spec)
            "cache_env": backend.cache_env,
            "cache_dir": cache.local_dir,
            "cache_remote": cache.remote,
            "warmup": [shape.queue for shape in self.warmup_shapes()],
            "dist_backend": backend.dist_backend,
            **({"allow_fallback": True} if self.allow_fallback else {}),
            "on_degenerate": self.on_degenerate,
            **({"allocation": self.allocation} if self.allocation else {}),
            **({"group": self.group, "rank": self.rank, "world_size": self.world_size,
                "consumes": self.rank == 0} if self.world_size > 1 else {}),
        }


def hostname() -> str:
    return socket.gethostname()


# Library chatter (per-process load bars, torchvision fallbacks) would drown the
# run's own output when N workers start at once.
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Loggers held at ERROR from before `import torch`: torchao (a core dependency, `quant:`
# schemes), imported by diffusers and transformers in every worker, warns at import that
# its CUDA-only kernels (_C_mxfp8, _C_cutlass_90a) do not load on a CPU build
# (torchao/__init__.py), and torch warns that the enums it registers as pytree
# constants need not be (torch/utils/_pytree.py): four lines per worker before any batch.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
