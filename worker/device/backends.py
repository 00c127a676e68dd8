"""The backend table: every device-specific fact, once, as data.

No other module branches on the device kind: they read a `Backend` record (the CLI's
--device, --compile and --dtype choices, the fleet's Kubernetes facts, a process's
environment, which option combinations are refused). Facts and their sources are in
../shared/BACKENDS.md; tests/test_backends.py pins each one. This module must not
import torch: the supervisor uses it to pin child processes before they import torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from diffq.core.contract import AUTO_DTYPE, DTYPE_TAGS, effective_dtype

# torch_tpu reads its port at backend init; each one-chip process needs its own.
TPU_BASE_PORT = 8476

# torchrun's variables. A process that is not a rank of a --tp group must not carry
# them (inherited from a torchrun or a pod spec): torch_tpu goes distributed whenever
# WORLD_SIZE is set (torch_tpu csrc/distributed/slicebuilder/discovery.cc).
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Compile modes that call torch.compile; the others are call-time modes (env only).
COMPILING_MODES = ("full", "regional")
# What speed-ups each compile mode runs (docs/speedups.md, measured on diffusers 0.42.1):
# every cache decides on the host, so one inside a compiled graph breaks it (TaylorSeer,
# FirstBlock, Mag in a torch.compiler.disable'd function; PAB and FasterCache in their
# hook's plain new_forward, a Python branch on the timestep tensor: diffusers
# hooks/pyramid_attention_broadcast.py, hooks/faster_cache.py); regional compiles each
# repeated block's own forward (PipelineHost), which leaves hooks around whole blocks
# outside every graph; switching the attention backend recompiles every block.
SPEEDUPS_BY_MODE = {"none": "all", "defer-fuse": "all", "regional": "whole-blocks", "full": "none"}
# --offload values: "model" is diffusers' enable_model_cpu_offload().
OFFLOAD_MODES = ("model",)


@dataclass(frozen=True)
class Fallback:
    """A backend's switch for re-running what fails on the device some slower way."""

    env: str  # the switch; "1" makes the failing call raise

    def env_for(self, allowed: bool) -> dict[str, str]:
        # Set either way, so neither the build's default nor a value inherited from the pod decides.
        return {self.env: "0" if allowed else "1"}


@dataclass(frozen=True)
class GraphFallback(Fallback):
    """A backend that re-runs a compiled graph failing at run time as the original graph,
    op by op, unless told not to: the batch then runs many times slower and only a log
    line says so.

    torch-neuronx neuron_dynamo_backend/backend.py (execution_wrapper): on an executor
    exception it logs "Execution failed: ..." and "Falling back to original GraphModule
    execution" and returns gm.forward(*inputs), unless TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION
    is true (default False, docs/environment_variables.md)."""

    logger: str = ""  # the logger that announces each fallback...
    message: str = ""  # ...with a message starting with this


@dataclass(frozen=True)
class EagerFallback(Fallback):
    """A backend that re-runs an eager op failing on the device on the CPU unless told not
    to: the batch runs slower and, in a release build, nothing but a debug line says so.

    torch-neuronx (read at parmoham-aws/test-repo-parmoham, a torch-neuronx source mirror):
    torch_neuronx/_build_config.py @ de1a39ee has DEFAULT_FALLBACK_ONLY_FOR_UNIMPLEMENTED = "0"
    for BUILD_TYPE == "RELEASE" ("1" only in dev builds); torch_neuronx/__init__.py @ 67d8dc4a
    does os.environ.setdefault(env, that default), so a value set before `import torch` wins.
    With "0", python_ops/base.py @ 5577a2d8 (Operation.__call__) tries each Neuron
    implementation, then runs the op on the CPU (_unhandled_cpu_fallback), announcing it only
    with logging.debug("No implementation could handle operation ... Falling back on CPU")
    on the root logger, once per distinct message; csrc/core/utils/CPUFallbackExecutor.cpp
    @ 5577a2d8 (LoadConfiguration) disables the async pipeline's CPU re-run only for "1".
    With "1" both raise ("CPU fallback disabled because
    TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS=1", "CPU fallback is disabled for operation=").
    docs/environment_variables.md @ 98154b86: "When `1`, only falls back to CPU for
    unimplemented ops, not execution errors" (default False there: the release default).
    Note "1" also raises for a registered op none of whose implementations takes the given
    inputs (base.py's second raise), not only for a device failure. Ops with no Neuron
    implementation are not routed through Operation.__call__ at all (python_ops/
    auto_registration.py registers only ops with implementations); their path was not read.

    Counting: the only trace a release build keeps is the set of op names that fell back
    (csrc/core/NeuronOpTracking.cpp @ 98154b86: an unordered_set, read by
    `torch_neuronx.get_fallback_ops()`, the backend's `fallback_report`):
    csrc/core/NeuronLogging.h @ 98154b86 returns before printing any OPERATOR_FALLBACK
    record ("Operator '...' fell back to CPU"), and the root-logger debug line is
    deduplicated per message. So eager fallbacks are counted per op, not per call."""


@dataclass(frozen=True)
class LoraFacts:
    """How LoRA adapter sets reach a compile mode's graphs on a device (the `lora`
    column; worker/device/lora_modes.py has the modes), and the evidence.

    `mode`: what `--lora-mode auto` resolves to without a profile measured on the device
    (a `qualify --lora` profile may prove a cheaper one: diffq/core/profile.py).
    `graph_inputs`: the compiled graphs are known (tested) to read the weights as inputs,
    so a swap or fuse is seen and `compile` reuses a graph across sets; where False it is
    not proven, `compile` recompiles per set (right whatever the backend does) and a swap or
    fuse asked for explicitly is left to the change check at the first set change."""

    mode: str
    graph_inputs: bool
    why: str


# CPU and CUDA: Inductor. Dynamo lifts module parameters and tensor attributes as graph
# inputs (torch._dynamo.config.inline_inbuilt_nn_modules, on by default), and Inductor
# folds them into its code only with freezing (off by default; under no_grad only), so a
# swap that writes new values into the same tensors (peft's hotswap copy_ / fill_) reuses
# every graph; tests/test_lora.py counts 0 graphs compiled across swaps on CPU.
_INDUCTOR_LORA = {
    "none": LoraFacts("swap", True, "eager: nothing compiled"),
    "regional": LoraFacts("swap", True, "Inductor without freezing: parameters and peft's scaling tensors are graph "
                                        "inputs; tested on CPU (tests/test_lora.py: 0 graphs compiled across swaps)"),
    "full": LoraFacts("swap", True, "Inductor without freezing, the transformer one graph: graph inputs as in "
                                    "regional (not tested separately)"),
}
# CUDA: the same dynamo front and Inductor; not yet run on a GPU by diffq's tests. diffusers'
# own suite hot-swaps compiled models under error_on_recompile on its CI device
# (tests/models/testing_utils, LoraHotSwappingForModelTesterMixin).
_CUDA_LORA = {mode: LoraFacts(known.mode, known.graph_inputs,
                              f"{known.why}; on CUDA not yet run by diffq (diffusers' hotswap tests are)")
              for mode, known in _INDUCTOR_LORA.items()}
# Neuron and TPU: the vendor sources read make weights graph inputs likely (both hand
# dynamo's graph, parameters lifted as placeholders, to stock aot_autograd with no
# freezing pass), but no chip has shown it: `compile` (one graph per set, right whatever
# the backend bakes) until a `qualify --lora` profile measured on the device proves swap
# or fuse. Eager on either device compiles op by op on first use (eager_compiles).
NEURON_LORA_SOURCE = ("parmoham-aws/test-repo-parmoham (a torch-neuronx source mirror): "
                      "torch_neuronx/neuron_dynamo_backend/backend.py @ 98154b86 (create_neuron_backend: "
                      "aot_autograd(fw_compiler=..., keep_inference_input_mutations=True, decompositions=...), no "
                      "freezing), fx/fx_transform.py @ 67d8dc4a (convert_fx_to_stablehlo: "
                      "fx.stateless_fx_import(gm, ...); torch-mlir's importer itself not read)")
TPU_LORA_SOURCE = ("jonathan1920/torch_tpu (a torch_tpu source mirror): torch_tpu/_internal/compile/_backend.py "
                   "@ 03c2f67a (TpuBackend.__call__: aot_autograd(fw_compiler=..., bw_compiler=..., "
                   "keep_inference_input_mutations=False), no freezing: parameters reach the compiler as "
                   "placeholders); fx_passes/mark_embedded_constants.py @ 15e74f41 (apply) embeds only the "
                   "tensors of get_attr nodes as MLIR constants")
_NEURON_LORA = LoraFacts("compile", False, (
    f"weights as graph inputs likely on Neuron ({NEURON_LORA_SOURCE}) but not run on a chip: compile per set until "
    "a qualify --lora profile measured on Neuron proves swap or fuse"))
_TPU_LORA = LoraFacts("compile", False, (
    f"weights as graph inputs likely on TPU ({TPU_LORA_SOURCE}) but not run on a chip: compile per set until a "
    "qualify --lora profile measured on TPU proves swap or fuse"))


@dataclass(frozen=True)
class AllocationSource:
    """A variable in which a device plugin names the devices it gave a container (`--<option> auto`)."""

    env: str
    # Listed ids -> the option's own units (a Neuron device holds several cores), with a
    # note for `--plan`; None: the ids are the units.
    per_id: Callable[[Mapping[str, str]], tuple[int, str]] | None = None
    # A value meaning "every device" (compared case-insensitively), and how to list the
    # devices the container then sees, with a note for `--plan`.
    everything: str | None = None
    seen: Callable[[], tuple[list[int], str]] | None = None


class Allocation(list):
    """`--<option> auto`'s devices, remembering which variable said so (`worker --plan` shows it)."""

    def __init__(self, devices: list[int], source: dict):
        super().__init__(devices)
        self.source = source


# Trn2: 8 physical NeuronCores per Neuron device (../shared/BACKENDS.md "logical cores on
# Trn2"), LNC of them per logical core, the unit NEURON_RT_VISIBLE_CORES numbers, device d
# holding cores d*n..d*n+n-1 (aws-neuron-sdk containers/tutorials/ks8-neuron-scheduler-flow.rst:
# /dev/neuron1 is NEURON_RT_VISIBLE_CORES=2,3 at 2 per device). LNC is NEURON_LOGICAL_NC_CONFIG,
# else 2 on trn2/trn3 (torch-neuronx csrc/core/utils/PlatformUtils.cpp, GetLogicalNeuronCores).
NEURON_PHYSICAL_CORES_PER_DEVICE = 8
NEURON_LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
NEURON_DEFAULT_LNC = "2"


# AWS_NEURON_VISIBLE_DEVICES=ALL (aws-neuron-sdk containers/tutorials/tutorial-oci-hook.rst,
# containers/faq.rst: "docker run -e AWS_NEURON_VISIBLE_DEVICES=ALL", the OCI neuron hook
# then exposes every Neuron device) names no device: the container's /dev/neuron<N> files
# are the devices it sees (containers/faq.rst, "Container Devices": --device /dev/neuron#
# per device).
NEURON_DEV = Path("/dev")


def _neuron_devices_seen(dev: Path | None = None) -> tuple[list[int], str]:
    root = dev or NEURON_DEV
    found = sorted(int(m.group(1)) for f in root.glob("neuron*") if (m := re.fullmatch(r"neuron(\d+)", f.name)))
    if not found:
        raise ValueError(f"no {root}/neuron<N> device files: the container sees no Neuron device")
    return found, f"{len(found)} Neuron device(s) seen in {root}: {','.join(map(str, found))}"


def _neuron_cores_per_device(environ: Mapping[str, str]) -> tuple[int, str]:
    lnc = environ.get(NEURON_LNC_ENV, "").strip() or NEURON_DEFAULT_LNC
    if lnc not in ("1", "2"):
        raise ValueError(f"{NEURON_LNC_ENV}={lnc}: a logical NeuronCore is 1 or 2 physical cores")
    per_device = NEURON_PHYSICAL_CORES_PER_DEVICE // int(lnc)
    said = f"{NEURON_LNC_ENV}={lnc}" if NEURON_LNC_ENV in environ else f"LNC {lnc}, the Trn2 default"
    return per_device, f"{per_device} logical cores per Neuron device ({said})"


@dataclass(frozen=True)
class Placement:
    """Where one process runs: its device and, for a rank of a --tp group, the group."""

    slot: int
    threads: int = 1
    rank: int = 0
    group_slots: tuple[int, ...] = ()  # the group's devices in rank order; () = single device
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    generation: str | None = None  # e.g. the TPU generation (v5e, v5p, v6e, v7)

    @property
    def world_size(self) -> int:
        return len(self.group_slots) or 1


@dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation as torch_tpu knows it (torch_tpu/_internal/distributed/tpu_topology.py)."""

    pci_device: str
    # TORCH_TPU_TOPOLOGY per group size; any other size raises in torch_tpu.
    topologies: dict[int, str]
    # Chip bounds of a one-chip process: 4-D on v7 (torch_tpu environment.cc).
    chip_bounds: str = "1,1,1"


TPU_PCI_VENDOR = "0x1ae0"
TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v5p": TpuGeneration(pci_device="0x0062", topologies={4: "2,2,1", 8: "2,2,2"}),
    "v5e": TpuGeneration(pci_device="0x0063", topologies={4: "2,2,1", 8: "2,2,2"}),
    "v6e": TpuGeneration(pci_device="0x006f", topologies={4: "2,2,1", 8: "2,2,2"}),
    "v7": TpuGeneration(pci_device="0x0076", topologies={2: "1,1,1,2", 4: "1,2,1,2", 8: "2,2,1,2"},
                        chip_bounds="1,1,1,1"),
}


def detect_tpu_generation(root: str | Path = "/sys/bus/pci/devices") -> str | None:
    """The TPU generation on this host, read from PCI ids as torch_tpu reads them; None if no TPU."""
    by_device = {gen.pci_device: name for name, gen in TPU_GENERATIONS.items()}
    for vendor in sorted(Path(root).glob("*/vendor")):
        try:
            if vendor.read_text().strip() != TPU_PCI_VENDOR:
                continue
            found = by_device.get((vendor.parent / "device").read_text().strip())
        except OSError:
            continue
        if found:
            return found
    return None


@dataclass(frozen=True)
class K8sPod:
    """What one worker pod of a device kind asks a Kubernetes cluster for."""

    resource: str | None  # extended resource requested once per device
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    devices_per_pod: int = 1
    # Longer than a batch including a first compile: SIGTERM is a warm shutdown
    # that finishes the batch in hand, and the kubelet SIGKILLs after this.
    grace_seconds: int = 600
    cpu: str = "2"
    memory: str = "8Gi"
    compile: str = "none"
    # A memory-backed /dev/shm of this size (counts against the memory limit).
    shm_size: str | None = None
    # What --<device option> says in the manifest: "auto" where the device plugin
    # tells the container which devices it got; otherwise the pod's 0..n-1.
    devices_arg: str | None = None
    # The device generation the node selector picks (layouts are checked against it).
    generation: str | None = None
    # "model": one pool per model whose workers serve every shape (found on the
    # broker); "shape": one pool per shape queue, each pod compiling only its shape.
    pool: str = "shape"


# --- pinning: one process, one device ------------------------------------------------


def _threads(p: Placement) -> dict[str, str]:
    # One worker per slot; threads split so 2 processes on 2 cores do not fight.
    n = str(p.threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def _cuda_pin(p: Placement) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": str(p.slot), **_threads(p)}


def _neuron_pin(p: Placement) -> dict[str, str]:
    # Must be set before the Neuron runtime starts (i.e. before `import torch`,
    # which autoloads torch_neuronx); takes precedence over NEURON_RT_NUM_CORES.
    return {"NEURON_RT_VISIBLE_CORES": str(p.slot), **_threads(p)}


def _tpu_visible(chip: int) -> dict[str, str]:
    # TPU_VISIBLE_DEVICES is torch_tpu's source of truth; TPU_VISIBLE_CHIPS is set to
    # match, since libtpu prefers a non-empty TPU_VISIBLE_CHIPS (csrc/common/environment.cc).
    return {"TPU_VISIBLE_DEVICES": str(chip), "TPU_VISIBLE_CHIPS": str(chip)}


def _tpu_pin(p: Placement) -> dict[str, str]:
    # Independent one-chip processes also need one-chip bounds (4-D on v7) and a
    # distinct port. Read once during `import torch`.
    bounds = TPU_GENERATIONS[p.generation].chip_bounds if p.generation else "1,1,1"
    return {
        **_tpu_visible(p.slot),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
        "TPU_PROCESS_BOUNDS": bounds,
        "TPU_PROCESS_PORT": str(TPU_BASE_PORT + p.slot),
        # What libtpu's locks need, said once. openxla's lock (xla/stream_executor/tpu/
        # tpu_initialize_util.cc @ 98d015bb, TryAcquireTpuLock: one lockf'd
        # /tmp/libtpu_lockfile per host) is skipped by the chip bounds above alone: any
        # TPU_CHIPS_PER_PROCESS_BOUNDS other than "" or "2,2,1" is "a subset of host's TPU
        # devices". A second lock, in libtpu's GCP init (closed source), is not: torch_tpu
        # sets ALLOW_MULTIPLE_LIBTPU_LOAD=1 *beside* the same one-chip bounds for each of its
        # ranks, "Avoid multi-process libtpu lock in GCP init, see b/487769788"
        # (jonathan1920/torch_tpu csrc/common/environment.cc @ df046ee0,
        # InitializeDistributedEnvironment). That is the one source that needs it; kept.
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        **_threads(p),
    }


# --- one rank of a --tp group ----------------------------------------------------------


def _cuda_rank(p: Placement) -> dict[str, str]:
    # Every rank sees the group's GPUs and binds LOCAL_RANK (torchrun's layout).
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, p.group_slots)), **_threads(p)}


def _neuron_rank(p: Placement) -> dict[str, str]:
    # init_process_group(backend="neuron") asserts each process sees exactly one core;
    # set explicitly, so a group on cores 4-7 does not fall back to LOCAL_RANK 0-3
    # (torch_neuronx/distributed/backend.py, _set_rt_visible_cores).
    return {"NEURON_RT_VISIBLE_CORES": str(p.slot), **_threads(p)}


def _tpu_rank(p: Placement) -> dict[str, str]:
    # What torch_tpu requires once WORLD_SIZE is set (discovery.cc) and its own
    # launcher sets (singlehost_wrapper.py, prepare_tpu_environment): the same
    # slice-builder address list on every rank and the topology. It writes
    # TPU_PROCESS_BOUNDS/ADDRESSES/PORT and CLOUD_TPU_TASK_ID itself.
    return {
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"localhost:{TPU_BASE_PORT + chip}" for chip in p.group_slots),
        "TORCH_TPU_TOPOLOGY": _tpu_topology(len(p.group_slots), p.generation),
        # The rank's chip, named: newer torch_tpu binds a single TPU_VISIBLE_DEVICES
        # (csrc/common/environment.cc), so one inherited from the pod would put every
        # rank on that chip; older releases bind chip LOCAL_RANK (torch_tpu/common/
        # environment.cc), the same chip since groups use chips 0..tp-1 (_tpu_groups).
        **_tpu_visible(p.slot),
        **_threads(p),
    }


def _tpu_topology(size: int, generation: str | None) -> str:
    if os.environ.get("TORCH_TPU_TOPOLOGY"):
        return os.environ["TORCH_TPU_TOPOLOGY"]  # the user's word wins, as in torch_tpu's launcher
    if generation is None:
        raise ValueError(f"a TPU group of {size} chips needs the TPU generation, and no TPU was found "
                         f"here: pass --generation {'|'.join(TPU_GENERATIONS)} (or set TORCH_TPU_TOPOLOGY)")
    topologies = TPU_GENERATIONS[generation].topologies
    if size not in topologies:
        sizes = ", ".join(map(str, topologies))
        raise ValueError(f"--tp {size} on TPU {generation}: torch_tpu's topology table (tpu_topology.py) has "
                         f"groups of {sizes} chips only")
    return topologies[size]


def _tpu_groups(devices: list[int], tp: int, generation: str | None) -> None:
    if tp == 1:
        return
    if len(devices) > tp:
        # Newer torch_tpu binds each rank to a single TPU_VISIBLE_DEVICES, which _tpu_rank
        # sets (csrc/common/environment.cc), but older releases bind chip LOCAL_RANK
        # (torch_tpu/common/environment.cc): a second group would land on the first one's
        # chips. Either way each group sets TPU_HOST_BOUNDS to its own topology, and no run
        # has shown two slices sharing one host: refused until one does.
        raise ValueError(f"{len(devices) // tp} TPU groups of {tp} chips on one host are unverified and refused: "
                         f"older torch_tpu releases bind chip LOCAL_RANK, so a second group would share the "
                         f"first one's chips; run one --tp group per host")
    if devices != list(range(tp)):
        # Older torch_tpu releases bind chip LOCAL_RANK whatever the rank's pin says.
        raise ValueError(f"a TPU --tp group uses chips 0-{tp - 1} (older torch_tpu releases bind chip LOCAL_RANK), "
                         f"got --chips {','.join(map(str, devices))}")
    _tpu_topology(tp, generation)


@dataclass(frozen=True)
class Backend:
    name: str
    torch_device: str
    compile_backend: str
    cache_env: str
    dist_backend: str
    # The dtype every seed example uses on this device: what an `auto` shape runs at.
    default_dtype: str
    pin: Callable[[Placement], dict[str, str]]
    # The CLI option that lists this kind's devices (--cores 0-7, --chips 0-3 ...), and
    # what it lists, in its help.
    device_option: str
    # Kubernetes facts of a worker pod, or None: explicitly not deployable.
    k8s: K8sPod | None
    # Module to import after torch (None: nothing to import). torch autoloads it
    # unless TORCH_DEVICE_BACKEND_AUTOLOAD=0; importing it again costs nothing.
    extension: str | None = None
    # Env every process of this kind gets (after pinning, before import torch).
    base_env: dict[str, str] = field(default_factory=dict)
    # Dotted function returning ops that fell back to CPU, reported after warmup.
    fallback_report: str | None = None
    # Compiled graphs failing at run time re-run uncompiled unless disabled: disabled
    # under --compile full|regional unless --allow-fallback, and counted either way.
    graph_fallback: GraphFallback | None = None
    # Eager ops failing on the device re-run on the CPU unless disabled: disabled in every
    # compile mode (regional compiles leave the rest eager) unless --allow-fallback.
    eager_fallback: EagerFallback | None = None
    # Dotted function: peak device memory in bytes since start (None: none to report).
    # torch.accelerator's is device-generic (torch/accelerator/memory.py).
    peak_memory: str | None = "torch.accelerator.max_memory_allocated"
    # Dotted function: the backend's own compile-cache statistics, where it has them.
    cache_stats: str | None = None
    # --compile values this backend offers; the CLI offers their union.
    compile_modes: tuple[str, ...] = ("none", "full", "regional")
    mode_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # Eager mode compiles each op on first use (Neuron, TPU): a shape's first batch
    # is its compile time even with --compile none.
    eager_compiles: bool = False
    # Where the cache lives when none is configured (wiped on reboot for Neuron).
    default_cache: str | None = None
    # Older names of the cache variable, set too so either backend release finds it.
    cache_env_aliases: tuple[str, ...] = ()
    # Set beside a configured cache (TPU: tier 3 needs tier 2, which older releases
    # do not switch on by themselves).
    cache_companion_env: dict[str, str] = field(default_factory=dict)
    # Packages whose versions invalidate compiled artefacts (besides torch, diffusers).
    cache_packages: tuple[str, ...] = ()
    # URL schemes the backend's own cache reads and writes directly (no diffq sync).
    native_cache_schemes: tuple[str, ...] = ()
    # Dotted callable counting this kind's devices. Accelerators go through
    # torch.accelerator: torch.tpu.device_count() raises for user code.
    count_devices: str = "torch.accelerator.device_count"
    # The variables naming the devices a container was given (--<option> auto), the
    # first one set wins.
    allocation: tuple[AllocationSource, ...] = ()
    # Generations with different launch facts, detected on the host (TPU), and how.
    generations: tuple[str, ...] = ()
    detect_generation: Callable[[], str | None] | None = None
    # diffusers' TensorParallelConfig shards on this device (cuda, neuron, tpu, xpu);
    # elsewhere a group's ranks hold replicated weights.
    tensor_parallel: bool = True
    # Env of one rank of a --tp group (besides torchrun's variables); None: no groups.
    rank_pin: Callable[[Placement], dict[str, str]] | None = None
    # Variables a rank must not inherit (the backend sets them itself).
    rank_unset: tuple[str, ...] = ()
    # Refuses group layouts the backend cannot launch: (devices, tp, generation).
    check_groups: Callable[[list[int], int, str | None], None] | None = None
    # A rank binds device LOCAL_RANK before init_process_group (it sees the whole group).
    bind_local_rank: bool = False
    # Dotted callable giving a rank's device index after init_process_group.
    rank_device: str | None = None
    # The current device is per thread: a batch's task thread (Celery's threads pool)
    # starts on index 0, not on the one the loading thread chose, so the pipeline host
    # binds each thread to the loading thread's index (torch.accelerator) first.
    thread_device: bool = False
    # Static shapes: every backend compiles one whole graph per shape; Neuron
    # rejects dynamic=True outright.
    fullgraph: bool = True
    dynamic: bool = False
    device_noun: str = "devices"
    # The dtypes a worker of this kind runs when a queue pins one (auto queues run at
    # default_dtype): discovery serves only these, and --queues naming another is refused.
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    # Vendor set-up a compiling process may run in a thread while it loads the model
    # (after the compile cache's pull: the set-up may find its builds there), each
    # ("module", "function"): the module and `warm_imports` (everything the call would
    # import) first, on the main thread, so the two threads never import at once.
    warm_in_background: tuple[tuple[str, str], ...] = ()
    warm_imports: tuple[str, ...] = ()
    # What step caches and attention backends (core/speedups.py) each compile mode
    # runs: SPEEDUPS_BY_MODE unless a device differs.
    speedups: dict[str, str] = field(default_factory=lambda: dict(SPEEDUPS_BY_MODE))
    # A cache whose skip is decided from the batch's data each step (`.item()`) runs:
    # a host sync the eager CPU and CUDA paths absorb; on Neuron and XLA, a graph
    # break every step.
    host_decisions: bool = True
    # Attention backends `qualify --speedups` measures besides diffusers' default
    # `native` (what full compute runs): kernels this device has. One that fails on the
    # device is shown failed, never hidden; compiling modes refuse a switch.
    attention_candidates: tuple[str, ...] = ()
    # Per compile mode: how LoRA sets reach its graphs (LoraFacts); a mode not listed
    # refuses adapters.
    lora: dict[str, LoraFacts] = field(default_factory=lambda: dict(_INDUCTOR_LORA))

    def lora_facts(self, compile_mode: str) -> LoraFacts | None:
        """The `lora` column's row for a compile mode, or None (adapters refused)."""
        return self.lora.get(compile_mode)

    def speedups_offered(self, compile_mode: str) -> str:
        return self.speedups.get(compile_mode, "none")

    @property
    def compile_options(self) -> dict:
        return {"backend": self.compile_backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}

    def dtype_for(self, dtype: str) -> str:
        """The dtype a shape pinned to `dtype` (or auto) runs at on this backend."""
        return effective_dtype(dtype, self.default_dtype)

    @property
    def served_dtypes(self) -> tuple[str, ...]:
        """The shape-key dtypes a worker of this kind serves: auto and its own."""
        return (AUTO_DTYPE, *self.dtypes)

    def cache_envs(self) -> tuple[str, ...]:
        return (self.cache_env, *self.cache_env_aliases)

    def compile_env(self, compile: str, allow_fallback: bool = False) -> dict[str, str]:
        """Env of a compile mode (before `import torch`): the mode's own, whether an eager
        op failing on the device may re-run on the CPU, and under torch.compile whether a
        graph failing at run time may re-run uncompiled."""
        env = dict(self.mode_env.get(compile, {}))
        if self.eager_fallback:
            env.update(self.eager_fallback.env_for(allow_fallback))
        if self.graph_fallback and compile in COMPILING_MODES:
            env.update(self.graph_fallback.env_for(allow_fallback))
        return env

    def env(self, p: Placement) -> dict[str, str]:
        """What a process at this placement sets before `import torch`."""
        env = dict(self.base_env)
        if p.world_size == 1:
            return {**env, **self.pin(p)}
        if self.rank_pin is None:
            raise ValueError(f"--device {self.name} has no --tp groups")
        return {**env, **self.rank_pin(p), "RANK": str(p.rank), "LOCAL_RANK": str(p.rank),
                "WORLD_SIZE": str(p.world_size), "LOCAL_WORLD_SIZE": str(p.world_size),
                "MASTER_ADDR": p.master_addr, "MASTER_PORT": str(p.master_port)}

    def unset(self, p: Placement) -> tuple[str, ...]:
        """What a process at this placement removes from the environment it inherited."""
        return self.rank_unset if p.world_size > 1 else DISTRIBUTED_ENV

    def check(self, *, compile: str = "none", offload: str | None = None, devices: list[int] | None = None,
              tp: int = 1, generation: str | None = None, allow_fallback: bool = False) -> None:
        """Refuse a combination this backend cannot run as asked, before anything starts."""
        if compile not in self.compile_modes:
            owners = [b.name for b in BACKENDS.values() if compile in b.compile_modes]
            where = f" (a {'/'.join(owners)} mode)" if owners else ""
            raise ValueError(f"--compile {compile}{where} is not offered on --device {self.name}; "
                             f"choose {', '.join(self.compile_modes)}")
        if offload is not None and offload not in OFFLOAD_MODES:
            raise ValueError(f"unknown --offload '{offload}'; choose {', '.join(OFFLOAD_MODES)}")
        if offload == "model" and compile == "full":
            raise ValueError("--offload model cannot be combined with --compile full: offload hooks cannot be "
                             "traced by torch.compile; use --compile regional (the repeated blocks only)")
        if generation is not None and generation not in self.generations:
            raise ValueError(f"generation '{generation}' is not one of --device {self.name}'s: "
                             f"{', '.join(self.generations) or 'none'}")
        if allow_fallback and not (self.eager_fallback or (self.graph_fallback and compile in COMPILING_MODES)):
            eager = [b.name for b in BACKENDS.values() if b.eager_fallback]
            graph = [b.name for b in BACKENDS.values() if b.graph_fallback]
            raise ValueError(f"--allow-fallback applies to --device {'|'.join(eager)} (eager ops re-run on the "
                             f"CPU) and to --compile {'|'.join(COMPILING_MODES)} on --device {'|'.join(graph)} "
                             f"(compiled graphs re-run uncompiled), not to --device {self.name} --compile {compile}")
        if tp > 1:
            if self.rank_pin is None:
                raise ValueError(f"--device {self.name} has no --tp groups")
            if self.check_groups and devices is not None:
                self.check_groups(devices, tp, generation)


BACKENDS: dict[str, Backend] = {
    "cpu": Backend(
        name="cpu",
        # `_native_flash` is the kernel `native` already picks on CPU, `flex` is slower
        # (docs/speedups.md), `_native_efficient` and `_native_cudnn` have no CPU kernel.
        attention_candidates=("_native_math",),
        torch_device="cpu",
        compile_backend="inductor",
        cache_env="TORCHINDUCTOR_CACHE_DIR",
        dist_backend="gloo",
        default_dtype="float32",
        pin=_threads,
        rank_pin=_threads,
        device_option="--workers",
        count_devices="os.cpu_count",
        tensor_parallel=False,
        # float16 on CPU: slow where torch has kernels at all; bfloat16 is the CPU half type.
        dtypes=("float32", "bfloat16"),
        k8s=K8sPod(resource=None, devices_per_pod=2, grace_seconds=300, cpu="2", memory="4Gi", pool="model"),
        peak_memory=None,
        # Inductor's first CPU kernel asks which vector ISAs build and load here: per ISA
        # a probe library, then a `python -c` subprocess that dlopens it, one after
        # another (torch/_inductor/cpu_vec_isa.py, VecISA.check_build / _probe_load),
        # a second and more of every compiling start, warm ones included. Its result is
        # cached per process (functools.cache on valid_vec_isa_list); the subprocesses
        # wait off the GIL. It imports these lazily (setuptools among them).
        warm_in_background=(("torch._inductor.cpu_vec_isa", "valid_vec_isa_list"),),
        warm_imports=("torch._inductor.codecache", "torch._inductor.cpp_builder", "torch.utils._filelock",
                      "torch.utils.cpp_extension"),
    ),
    "cuda": Backend(
        name="cuda",
        attention_candidates=("_native_flash", "_native_efficient", "_native_cudnn", "_native_math"),
        torch_device="cuda",
        compile_backend="inductor",
        cache_env="TORCHINDUCTOR_CACHE_DIR",
        dist_backend="nccl",
        default_dtype="bfloat16",
        pin=_cuda_pin,
        rank_pin=_cuda_rank,
        bind_local_rank=True,
        # c10/cuda/CUDAFunctions.cpp: `thread_local ... targetDeviceIndex`.
        thread_device=True,
        device_option="--gpus",
        device_noun="GPUs",
        cache_packages=("triton",),
        lora=_CUDA_LORA,
        k8s=K8sPod(resource="nvidia.com/gpu",
                   tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
                   devices_per_pod=1, grace_seconds=900, cpu="8", memory="32Gi", compile="full",
                   pool="model"),
    ),
    "neuron": Backend(
        name="neuron",
        host_decisions=False,
        torch_device="neuron",
        compile_backend="neuron",
        cache_env="TORCH_NEURONX_NEFF_CACHE_DIR",
        dist_backend="neuron",
        default_dtype="bfloat16",
        pin=_neuron_pin,
        rank_pin=_neuron_rank,
        # torch-neuronx sets it from the store itself (backend.py, _neuron_runtime_setup).
        rank_unset=("NEURON_RT_ROOT_COMM_ID",),
        rank_device="torch.neuron.current_device",
        # torch_neuronx/csrc/core/NeuronDevice.cpp: `thread_local int current_device_index`
        # (newer releases fall back to a process-wide default set once; older ones to 0).
        thread_device=True,
        device_option="--cores",
        device_noun="NeuronCores",
        extension="torch_neuronx",
        eager_compiles=True,
        fallback_report="torch_neuronx.get_fallback_ops",
        graph_fallback=GraphFallback(env="TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION",
                                     logger="torch_neuronx.neuron_dynamo_backend.backend",
                                     message="Falling back to original GraphModule execution"),
        # Release builds re-run a failing eager op on the CPU by default (EagerFallback).
        eager_fallback=EagerFallback(env="TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS"),
        default_cache="/tmp/neff_cache",
        cache_packages=("torch-neuronx", "neuronx-cc"),
        lora={mode: _NEURON_LORA for mode in ("none", "full", "regional")},
        allocation=(
            # An aws.amazon.com/neuroncore allocation: its cores (aws-neuron-sdk
            # containers/tutorials/ks8-neuron-scheduler-flow.rst, "--env NEURON_RT_VISIBLE_CORES=2,3").
            AllocationSource("NEURON_RT_VISIBLE_CORES"),
            # An aws.amazon.com/neuron allocation, older plugins: devices, every core of
            # each (neuron-deploy/tutorials/k8s-neuron-scheduler.rst, "AWS_NEURON_VISIBLE_DEVICES: 2,3";
            # containers/tutorials/k8s-neuron-device-plugin.rst); ALL in AWS's container
            # examples: the /dev/neuron<N> the container sees (_neuron_devices_seen).
            AllocationSource("AWS_NEURON_VISIBLE_DEVICES", per_id=_neuron_cores_per_device,
                             everything="ALL", seen=_neuron_devices_seen),
        ),
        k8s=K8sPod(
            # trn2.48xlarge: 16 chips, 4 logical NeuronCores each at the default LNC=2.
            resource="aws.amazon.com/neuroncore",
            node_selector={"node.kubernetes.io/instance-type": "trn2.48xlarge"},
            tolerations=({"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"},),
            devices_per_pod=8, grace_seconds=1800, cpu="16", memory="128Gi", compile="regional",
            devices_arg="auto",
        ),
    ),
    "tpu": Backend(
        name="tpu",
        host_decisions=False,
        torch_device="tpu",
        compile_backend="tpu",
        cache_env="TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT",
        dist_backend="tpu_dist",
        default_dtype="bfloat16",
        pin=_tpu_pin,
        rank_pin=_tpu_rank,
        check_groups=_tpu_groups,
        # A torch_tpu process is bound to one device, its only addressable one (set_device
        # refuses any other index: _internal/device/_device_module.py).
        rank_device="torch.accelerator.current_device_index",
        # torch_tpu/csrc/eager/current_stream.cc: `thread_local DeviceIndex current_device_index_ = 0`.
        thread_device=True,
        device_option="--chips",
        device_noun="TPU chips",
        extension="torch_tpu",
        eager_compiles=True,
        compile_modes=("none", "full", "regional", "defer-fuse"),
        # Newer releases read TORCH_TPU_DEFER_AND_FUSE, then TPU_DEFER_AND_FUSE
        # (csrc/eager/eager_mode.cc, env_vars.h); older ones only the latter
        # (torch_tpu/eager/eager_mode.cc): both, or an older one runs strict eager.
        mode_env={"defer-fuse": {"TORCH_TPU_DEFER_AND_FUSE": "1", "TPU_DEFER_AND_FUSE": "1"}},
        cache_env_aliases=("TORCH_TPU_INTERNAL_TIER3_COMPILATION_CACHE_ROOT",),
        # A name under /dev/shm/torch_tpu_cache (tier2_compilation_cache.cc); both names.
        cache_companion_env={"TORCH_TPU_TIER2_COMPILATION_CACHE": "diffq",
                             "TORCH_TPU_INTERNAL_TIER2_COMPILATION_CACHE": "diffq"},
        cache_packages=("torch-tpu", "libtpu"),
        lora={mode: _TPU_LORA for mode in ("none", "full", "regional", "defer-fuse")},
        native_cache_schemes=("gs",),
        generations=tuple(TPU_GENERATIONS),
        detect_generation=detect_tpu_generation,
        # The chips a google.com/tpu allocation gave the container: libtpu prefers a
        # non-empty TPU_VISIBLE_CHIPS (torch_tpu csrc/common/env_vars.h), which Ray reads
        # as a process's chips (ray python/ray/_private/accelerators/tpu.py); then
        # TPU_VISIBLE_DEVICES, torch_tpu's own.
        allocation=(AllocationSource("TPU_VISIBLE_CHIPS"), AllocationSource("TPU_VISIBLE_DEVICES")),
        k8s=K8sPod(
            # GKE single-host v6e slice: 4 chips in a 2x2 topology on one node.
            resource="google.com/tpu",
            node_selector={"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                           "cloud.google.com/gke-tpu-topology": "2x2"},
            tolerations=({"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},),
            # Grace outlasts a first TPU compile of a Flux-sized model (docs/devices.md, "Running on TPU").
            devices_per_pod=4, grace_seconds=3600, cpu="16", memory="128Gi", compile="regional",
            # torch_tpu's tier-2 compile cache lives in /dev/shm.
            shm_size="32Gi", generation="v6e",
        ),
        cache_stats="torch.tpu._get_cache_stats",
    ),
}


@dataclass(frozen=True)
class RunConfig:
    """What decides a run's numbers on a device: its kind, dtype, compile mode and offload."""

    device: str
    dtype: str
    compile: str = "none"
    offload: str | None = None

    def __str__(self) -> str:
        return (f"{self.device}, {self.dtype}, "
                f"{'eager' if self.compile == 'none' else 'compile ' + self.compile}"
                f"{', offload ' + self.offload if self.offload else ''}")


# The configuration others are judged against (`diffq qualify`'s default reference):
# no accelerator, full precision, eager, weights resident.
REFERENCE = RunConfig(device="cpu", dtype="float32", compile="none", offload=None)

# The CLI's choices, read from the table.
DEVICES: tuple[str, ...] = tuple(BACKENDS)
COMPILE_MODES: tuple[str, ...] = tuple(dict.fromkeys(m for b in BACKENDS.values() for m in b.compile_modes))
DTYPES: tuple[str, ...] = tuple(DTYPE_TAGS)
# What --dtype may say: auto (the serving device's default) or a pinned dtype.
DTYPE_CHOICES: tuple[str, ...] = (AUTO_DTYPE, *DTYPES)


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


def allocated_devices(backend: Backend, environ: Mapping[str, str] = os.environ) -> Allocation:
    """`--<option> auto`: the devices the container was given, from the first of the
    backend's allocation variables that is set."""
    if not backend.allocation:
        raise ValueError(f"{backend.device_option} auto is not available on --device {backend.name}: "
                         f"list the devices")
    for source in backend.allocation:
        value = environ.get(source.env, "").strip()
        if not value:
            continue
        try:
            if source.everything and value.upper() == source.everything.upper():
                ids, seen = source.seen()
            else:
                ids, seen = parse_devices(value), None
        except ValueError as exc:
            raise ValueError(f"{backend.device_option} auto: {source.env}={value}: {exc}") from None
        per_id, note = source.per_id(environ) if source.per_id else (1, None)
        devices = [i * per_id + unit for i in ids for unit in range(per_id)]
        return Allocation(devices, {"variable": source.env, "value": value, **({"seen": seen} if seen else {}),
                                    **({"per_id": note} if note else {})})
    names = ", ".join(source.env for source in backend.allocation)
    raise ValueError(f"{backend.device_option} auto: none of {names} is set (a device plugin sets one for the "
                     f"devices it gave the container); list the devices instead")


def parse_devices(spec: str) -> list[int]:
    """'0-3' → [0, 1, 2, 3]; '0,2,5' → [0, 2, 5]; ranges and lists combine."""
    devices: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            if "-" in part:
                start, end = (int(x) for x in part.split("-", 1))
                if end < start:
                    raise ValueError
                devices.extend(range(start, end + 1))
            else:
                devices.append(int(part))
        except ValueError:
            raise ValueError(f"bad device list '{spec}' at '{part}': use e.g. 0-3 or 0,2,5") from None
    if len(set(devices)) != len(devices):
        raise ValueError(f"device list '{spec}' names a device twice")
    return devices
