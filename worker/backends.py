"""The backend table: every device-specific fact, once, as data.

No other module branches on the device kind: they read a `Backend` record.
Facts and their sources are in ../shared/BACKENDS.md; tests/test_backends.py pins
each one. This module must not import torch: the supervisor uses it to pin child
processes before they import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# torch_tpu reads its port at backend init; each one-chip process needs its own.
TPU_BASE_PORT = 8476


def _cpu_pin(slot: int, threads: int) -> dict[str, str]:
    # One worker per slot; threads split so 2 processes on 2 cores do not fight.
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def _cuda_pin(device: int, threads: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": str(device), **_cpu_pin(device, threads)}


def _neuron_pin(core: int, threads: int) -> dict[str, str]:
    # Must be set before the Neuron runtime starts (i.e. before `import torch`,
    # which autoloads torch_neuronx); takes precedence over NEURON_RT_NUM_CORES.
    return {"NEURON_RT_VISIBLE_CORES": str(core), **_cpu_pin(core, threads)}


def _cuda_pin_group(devices: list[int], threads: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)), **_cpu_pin(devices[0], threads)}


def _neuron_pin_group(cores: list[int], threads: int) -> dict[str, str]:
    # Every rank sees the group's cores (an inclusive range) and uses core LOCAL_RANK,
    # as under torchrun; the range form cannot say a gap.
    if cores != list(range(cores[0], cores[0] + len(cores))):
        raise ValueError(f"a Neuron tensor-parallel group needs consecutive cores, got {cores}")
    return {"NEURON_RT_VISIBLE_CORES": f"{cores[0]}-{cores[-1]}", **_cpu_pin(cores[0], threads)}


def _tpu_pin(chip: int, threads: int) -> dict[str, str]:
    # TPU_VISIBLE_DEVICES is torch_tpu's source of truth (it rewrites
    # TPU_VISIBLE_CHIPS to match); independent one-chip processes also need the
    # 1,1,1 bounds and a distinct port. Read once during `import torch`.
    return {
        "TPU_VISIBLE_DEVICES": str(chip),
        "TPU_VISIBLE_CHIPS": str(chip),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": str(TPU_BASE_PORT + chip),
        **_cpu_pin(chip, threads),
    }


def _tpu_group_env(rank: int, chips: list[int]) -> dict[str, str]:
    # libtpu's multi-process recipe on one host: each rank keeps its one chip (the
    # pin above) and its own port, and learns the others' addresses and its task id.
    # torch_tpu also ships a launcher (_internal...singlehost_wrapper) that is
    # internal and unstable, so the recipe is spelled out here instead.
    return {
        "TPU_PROCESS_BOUNDS": _tpu_process_bounds(len(chips)),
        "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{TPU_BASE_PORT + chip}" for chip in chips),
        "CLOUD_TPU_TASK_ID": str(rank),
    }


def _tpu_process_bounds(processes: int) -> str:
    # One process per chip laid out like the host's chips: 2 → 2x1, 4 → 2x2 (v5e/v6e-4), 8 → 2x4.
    if processes <= 2:
        return f"{processes},1,1"
    if processes % 2:
        raise ValueError(f"a TPU group of {processes} chips has no 2-D process layout; use 1, 2, 4 or 8")
    return f"2,{processes // 2},1"


@dataclass(frozen=True)
class Backend:
    name: str
    torch_device: str
    compile_backend: str
    cache_env: str
    dist_backend: str
    default_dtype: str
    pin: Callable[[int, int], dict[str, str]]
    # The CLI option that lists this kind's devices (--cores 0-7, --chips 0-3 ...).
    device_option: str
    # Module to import after torch (None: nothing to import).
    extension: str | None = None
    # Env every process of this kind gets (after pinning, before import torch).
    base_env: dict[str, str] = field(default_factory=dict)
    # Dotted function returning ops that fell back to CPU, reported after warmup.
    fallback_report: str | None = None
    # Extra call-time modes a backend offers beyond none/full/regional.
    compile_modes: tuple[str, ...] = ("none", "full", "regional")
    mode_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # Where the cache lives when none is configured (wiped on reboot for Neuron).
    default_cache: str | None = None
    # Older names of the cache variable, set too so either backend release finds it.
    cache_env_aliases: tuple[str, ...] = ()
    # Packages whose versions invalidate compiled artefacts (besides torch, diffusers).
    cache_packages: tuple[str, ...] = ()
    # URL schemes the backend's own cache reads and writes directly (no diffq sync).
    native_cache_schemes: tuple[str, ...] = ()
    # Dotted callable counting this kind's devices. Accelerators go through
    # torch.accelerator: torch.tpu.device_count() raises for user code.
    count_devices: str = "torch.accelerator.device_count"
    # diffusers' TensorParallelConfig shards on this device (cuda, neuron, tpu, xpu);
    # elsewhere a group's ranks hold replicated weights.
    tensor_parallel: bool = True
    # Extra env for rank `rank` of a group over these devices (multi-process launch).
    group_env: Callable[[int, list[int]], dict[str, str]] | None = None
    # Pinning for every rank of a group when each rank sees all of the group's devices
    # and binds device LOCAL_RANK (what transformers' and diffusers' TP loaders expect
    # on cuda and neuron). None: each rank is pinned to its own device, index 0 (TPU).
    pin_group: Callable[[list[int], int], dict[str, str]] | None = None
    # Static shapes: every backend compiles one whole graph per shape; Neuron
    # rejects dynamic=True outright.
    fullgraph: bool = True
    dynamic: bool = False

    @property
    def compile_options(self) -> dict:
        return {"backend": self.compile_backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}

    def cache_envs(self) -> tuple[str, ...]:
        return (self.cache_env, *self.cache_env_aliases)


BACKENDS: dict[str, Backend] = {
    "cpu": Backend(
        name="cpu",
        torch_device="cpu",
        compile_backend="inductor",
        cache_env="TORCHINDUCTOR_CACHE_DIR",
        dist_backend="gloo",
        default_dtype="float32",
        pin=_cpu_pin,
        device_option="--workers",
        count_devices="os.cpu_count",
        tensor_parallel=False,
    ),
    "cuda": Backend(
        name="cuda",
        torch_device="cuda",
        compile_backend="inductor",
        cache_env="TORCHINDUCTOR_CACHE_DIR",
        dist_backend="nccl",
        default_dtype="bfloat16",
        pin=_cuda_pin,
        pin_group=_cuda_pin_group,
        device_option="--gpus",
        cache_packages=("triton",),
    ),
    "neuron": Backend(
        name="neuron",
        torch_device="neuron",
        compile_backend="neuron",
        cache_env="TORCH_NEURONX_NEFF_CACHE_DIR",
        dist_backend="neuron",
        default_dtype="bfloat16",
        pin=_neuron_pin,
        pin_group=_neuron_pin_group,
        device_option="--cores",
        extension="torch_neuronx",
        fallback_report="torch_neuronx.get_fallback_ops",
        default_cache="/tmp/neff_cache",
        cache_packages=("torch-neuronx", "neuronx-cc"),
    ),
    "tpu": Backend(
        name="tpu",
        torch_device="tpu",
        compile_backend="tpu",
        cache_env="TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT",
        dist_backend="tpu_dist",
        default_dtype="bfloat16",
        pin=_tpu_pin,
        device_option="--chips",
        compile_modes=("none", "full", "regional", "defer-fuse"),
        mode_env={"defer-fuse": {"TORCH_TPU_DEFER_AND_FUSE": "1"}},
        cache_env_aliases=("TORCH_TPU_INTERNAL_TIER3_COMPILATION_CACHE_ROOT",),
        cache_packages=("torch-tpu", "libtpu"),
        native_cache_schemes=("gs",),
        group_env=_tpu_group_env,
    ),
}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown device '{name}'; choose one of {', '.join(BACKENDS)}") from None


def resolve(dotted: str):
    """'torch.accelerator.device_count' → that callable, importing its module lazily."""
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def device_count(backend: Backend) -> int:
    """How many devices of this kind the process sees (after pinning: usually 1)."""
    return int(resolve(backend.count_devices)() or 0)


def parse_devices(spec: str) -> list[int]:
    """'0-3' → [0, 1, 2, 3]; '0,2,5' → [0, 2, 5]; ranges and lists combine."""
    devices: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "-" in part:
            start, end = (int(x) for x in part.split("-", 1))
            if end < start:
                raise ValueError(f"bad device range '{part}'")
            devices.extend(range(start, end + 1))
        else:
            devices.append(int(part))
    if len(set(devices)) != len(devices):
        raise ValueError(f"device list '{spec}' names a device twice")
    return devices
