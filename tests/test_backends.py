"""The backend table, pinned fact by fact against ../shared/BACKENDS.md.

Each assertion names the BACKENDS.md section and row it encodes: we have no
Trainium or TPU here, so these tests are what keeps the facts from drifting.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from diffq.core.contract import ShapeKey, queue_name
from diffq.worker.device import compile_cache
from diffq.worker.device.backends import (BACKENDS, COMPILING_MODES, DTYPES, REFERENCE, Placement, RunConfig, device_count,
                                   get_backend, parse_devices)
from diffq.worker.delivery.spec import ChildSpec
from diffq.worker.process.supervisor import Supervisor, plan_children

WORKER_DIR = Path(__file__).resolve().parents[1] / "worker"


def test_every_kind_is_in_the_table():
    assert set(BACKENDS) == {"cpu", "cuda", "neuron", "tpu"}


def test_device_strings():
    # BACKENDS.md Trainium "device": "neuron"; TPU "device": "tpu".
    assert {k: b.torch_device for k, b in BACKENDS.items()} == {
        "cpu": "cpu", "cuda": "cuda", "neuron": "neuron", "tpu": "tpu"}


def test_compile_backend_names_and_options():
    # BACKENDS.md Trainium "compile": backend="neuron", fullgraph=True, dynamic=False
    # (dynamic=True rejected); TPU "modes": backend="tpu", fullgraph=True,
    # dynamic=False; CUDA/CPU: Inductor.
    assert {k: b.compile_backend for k, b in BACKENDS.items()} == {
        "cpu": "inductor", "cuda": "inductor", "neuron": "neuron", "tpu": "tpu"}
    for backend in BACKENDS.values():
        assert backend.compile_options == {"backend": backend.compile_backend,
                                           "fullgraph": True, "dynamic": False}


def test_compile_cache_variables():
    # BACKENDS.md Trainium "NEFF cache": TORCH_NEURONX_NEFF_CACHE_DIR, default
    # /tmp/neff_cache (wiped on reboot). TPU "compile cache":
    # TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT, older name
    # TORCH_TPU_INTERNAL_TIER3_COMPILATION_CACHE_ROOT, local path or gs://.
    # CUDA/CPU "cache": TORCHINDUCTOR_CACHE_DIR.
    assert {k: b.cache_envs() for k, b in BACKENDS.items()} == {
        "cpu": ("TORCHINDUCTOR_CACHE_DIR",),
        "cuda": ("TORCHINDUCTOR_CACHE_DIR",),
        "neuron": ("TORCH_NEURONX_NEFF_CACHE_DIR",),
        "tpu": ("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "TORCH_TPU_INTERNAL_TIER3_COMPILATION_CACHE_ROOT"),
    }
    assert get_backend("neuron").default_cache == "/tmp/neff_cache"
    assert get_backend("tpu").native_cache_schemes == ("gs",)
    assert all(not b.native_cache_schemes for k, b in BACKENDS.items() if k != "tpu")


def test_distributed_backends_and_dtypes():
    # BACKENDS.md Trainium "distributed": backend="neuron"; TPU "distributed":
    # backend="tpu_dist"; nccl for CUDA, gloo for CPU.
    assert {k: b.dist_backend for k, b in BACKENDS.items()} == {
        "cpu": "gloo", "cuda": "nccl", "neuron": "neuron", "tpu": "tpu_dist"}
    assert {k: b.default_dtype for k, b in BACKENDS.items()} == {
        "cpu": "float32", "cuda": "bfloat16", "neuron": "bfloat16", "tpu": "bfloat16"}


def test_the_current_device_is_per_thread_on_every_accelerator():
    """Batches run on a Celery task thread, not the loading one. The current device is a
    thread-local on each accelerator, so a new thread starts on index 0:
    pytorch c10/cuda/CUDAFunctions.cpp (`thread_local static DeviceIndex targetDeviceIndex`),
    torch-neuronx torch_neuronx/csrc/core/NeuronDevice.cpp (`thread_local int
    current_device_index`; a process-wide fallback only in newer releases), torch_tpu
    torch_tpu/csrc/eager/current_stream.cc (`thread_local DeviceIndex current_device_index_ = 0`).
    The CPU has no device index."""
    assert {name: b.thread_device for name, b in BACKENDS.items()} == {
        "cpu": False, "cuda": True, "neuron": True, "tpu": True}


def test_extensions_and_modes():
    # BACKENDS.md Trainium "device": import torch_neuronx when autoload is off.
    # TPU "modes": defer-and-fuse eager is TORCH_TPU_DEFER_AND_FUSE=1.
    assert get_backend("neuron").extension == "torch_neuronx"
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0: torch_tpu is imported like torch_neuronx (torch_tpu _loader.py).
    assert get_backend("tpu").extension == "torch_tpu"
    assert {k for k, b in BACKENDS.items() if b.extension} == {"neuron", "tpu"}
    assert get_backend("tpu").compile_modes == ("none", "full", "regional", "defer-fuse")


def test_defer_fuse_sets_the_old_and_the_new_name():
    # torch_tpu csrc/eager/eager_mode.cc (GetDefaultEagerMode) reads TORCH_TPU_DEFER_AND_FUSE,
    # falling back to TPU_DEFER_AND_FUSE (csrc/common/env_vars.h: "If both ... are set,
    # TORCH_TPU_DEFER_AND_FUSE takes precedence"); the older torch_tpu/eager/eager_mode.cc
    # reads only TPU_DEFER_AND_FUSE. With one name alone some release runs strict eager.
    assert get_backend("tpu").mode_env == {"defer-fuse": {"TORCH_TPU_DEFER_AND_FUSE": "1", "TPU_DEFER_AND_FUSE": "1"}}
    spec = ChildSpec(name="t", device="tpu", broker_url="memory://", queues=["q"], compile="defer-fuse")
    assert spec.env()["TORCH_TPU_DEFER_AND_FUSE"] == spec.env()["TPU_DEFER_AND_FUSE"] == "1"
    (entry,) = worker_plan("--device", "tpu", "--chips", "0", "--compile", "defer-fuse")
    assert entry["env"]["TORCH_TPU_DEFER_AND_FUSE"] == entry["env"]["TPU_DEFER_AND_FUSE"] == "1"
    assert "TPU_DEFER_AND_FUSE" not in ChildSpec(name="t", device="tpu", broker_url="memory://", queues=["q"]).env()


def test_device_count_goes_through_torch_accelerator(monkeypatch):
    # BACKENDS.md TPU "device APIs": torch.tpu.device_count() raises for user code;
    # use torch.accelerator.*. diffusers detects devices the same way.
    import torch

    for backend in BACKENDS.values():
        assert "torch.tpu" not in backend.count_devices
    for kind in ("cuda", "neuron", "tpu"):
        assert get_backend(kind).count_devices == "torch.accelerator.device_count"
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    monkeypatch.setattr(torch, "tpu", SimpleNamespace(device_count=lambda: 1 / 0), raising=False)
    assert device_count(get_backend("tpu")) == 4
    assert device_count(get_backend("cpu")) >= 1


def test_neuron_fallback_report_hook(monkeypatch):
    # BACKENDS.md Trainium "CPU fallback": list ops with torch_neuronx.get_fallback_ops().
    from diffq.worker.device.pipeline_host import PipelineHost

    assert get_backend("neuron").fallback_report == "torch_neuronx.get_fallback_ops"
    monkeypatch.setitem(sys.modules, "torch_neuronx",
                        SimpleNamespace(get_fallback_ops=lambda: ["aten::_fft_r2c"]))
    assert PipelineHost(backend=get_backend("neuron")).fallback_ops() == ["aten::_fft_r2c"]
    assert PipelineHost(backend=get_backend("cpu")).fallback_ops() == []


def test_neuron_compiled_graphs_fail_fast_unless_fallback_is_allowed():
    # torch-neuronx neuron_dynamo_backend/backend.py (execution_wrapper): a compiled graph
    # that fails at run time is re-run as the original graph, with
    # logger.warning("Falling back to original GraphModule execution") on that module's
    # logger, unless TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION is true (docs/
    # environment_variables.md: default False, "Fails fast instead").
    from diffq.worker.device.backends import GraphFallback

    assert get_backend("neuron").graph_fallback == GraphFallback(
        env="TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", logger="torch_neuronx.neuron_dynamo_backend.backend",
        message="Falling back to original GraphModule execution")
    assert {k for k, b in BACKENDS.items() if b.graph_fallback} == {"neuron"}

    def env(compile: str, **fields) -> dict:
        return ChildSpec(name="n", device="neuron", broker_url="memory://", queues=["q"], compile=compile,
                         **fields).env()

    for mode in COMPILING_MODES:
        assert env(mode)["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"  # the batch fails, is retried, reported
        # Opted in: set to "0" (false to the backend), so an inherited "1" does not decide either.
        assert env(mode, allow_fallback=True)["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "0"
    assert "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION" not in env("none")  # no torch.compile, no such graph
    (entry,) = worker_plan("--device", "neuron", "--cores", "0", "--compile", "regional")
    assert entry["env"]["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1" and "allow_fallback" not in entry
    (entry,) = worker_plan("--device", "neuron", "--cores", "0", "--compile", "full", "--allow-fallback")
    assert entry["env"]["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "0" and entry["allow_fallback"] is True


def test_neuron_eager_ops_fail_fast_unless_fallback_is_allowed():
    # torch-neuronx (parmoham-aws/test-repo-parmoham, a torch-neuronx source mirror):
    # torch_neuronx/_build_config.py @ de1a39ee, release build DEFAULT_FALLBACK_ONLY_FOR_UNIMPLEMENTED
    # = "0", put in the env by torch_neuronx/__init__.py's os.environ.setdefault (ours, set
    # before `import torch`, wins); python_ops/base.py @ 5577a2d8 (Operation.__call__) then
    # re-runs an op whose Neuron implementation failed on the CPU with only a root-logger
    # logging.debug line, and raises "CPU fallback disabled because
    # TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS=1" under "1"; docs/environment_variables.md
    # @ 98154b86: "When `1`, only falls back to CPU for unimplemented ops, not execution errors".
    from diffq.worker.device.backends import EagerFallback

    switch = "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS"
    assert get_backend("neuron").eager_fallback == EagerFallback(env=switch)
    assert {k for k, b in BACKENDS.items() if b.eager_fallback} == {"neuron"}
    # Counted per op: NeuronOpTracking.cpp keeps a set of names, and NeuronLogging.h
    # prints no OPERATOR_FALLBACK record, so the set is all there is to count.
    assert get_backend("neuron").fallback_report == "torch_neuronx.get_fallback_ops"

    def env(compile: str, **fields) -> dict:
        return ChildSpec(name="n", device="neuron", broker_url="memory://", queues=["q"], compile=compile,
                         **fields).env()

    for mode in get_backend("neuron").compile_modes:  # eager ops run in every mode (regional: all but the blocks)
        assert env(mode)[switch] == "1"  # the op raises: the batch fails, is retried, reported
        assert env(mode, allow_fallback=True)[switch] == "0"  # set either way: the build's default never decides
    for device in ("cpu", "cuda", "tpu"):
        assert switch not in get_backend(device).compile_env("none")
    (entry,) = worker_plan("--device", "neuron", "--cores", "0")
    assert entry["env"][switch] == "1" and "allow_fallback" not in entry
    (entry,) = worker_plan("--device", "neuron", "--cores", "0", "--allow-fallback")  # eager: now accepted
    assert entry["env"][switch] == "0" and entry["allow_fallback"] is True
    assert "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION" not in entry["env"]  # no compiled graph to re-run


@pytest.mark.parametrize("args", [["--device", "cpu", "--compile", "full"], ["--device", "cuda", "--compile", "full"],
                                  ["--device", "tpu", "--chips", "0", "--compile", "none"]])
def test_allow_fallback_is_refused_where_nothing_falls_back(args):
    assert ("--allow-fallback applies to --device neuron (eager ops re-run on the CPU) and to --compile "
            "full|regional on --device neuron") in plan_fails(*args, "--allow-fallback")


def test_pin_neuron():
    # BACKENDS.md Trainium "pin a process to a core": NEURON_RT_VISIBLE_CORES=<i>.
    env = get_backend("neuron").pin(Placement(slot=5, threads=2))
    assert env["NEURON_RT_VISIBLE_CORES"] == "5"
    assert "NEURON_RT_NUM_CORES" not in env  # VISIBLE_CORES takes precedence anyway
    assert env["OMP_NUM_THREADS"] == "2"


def test_pin_tpu_bounds_and_distinct_ports():
    # BACKENDS.md TPU "pin a process to a chip": TPU_VISIBLE_DEVICES (source of truth,
    # rewrites TPU_VISIBLE_CHIPS), TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1,
    # TPU_PROCESS_BOUNDS=1,1,1 and a distinct TPU_PROCESS_PORT per process.
    envs = [get_backend("tpu").pin(Placement(slot=chip)) for chip in range(4)]
    for chip, env in enumerate(envs):
        assert env["TPU_VISIBLE_DEVICES"] == env["TPU_VISIBLE_CHIPS"] == str(chip)
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert env["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert len({env["TPU_PROCESS_PORT"] for env in envs}) == 4


def test_one_chip_tpu_processes_skip_libtpus_host_lock():
    # What libtpu's locks need. openxla xla/stream_executor/tpu/tpu_initialize_util.cc @ 98d015bb
    # (TryAcquireTpuLock): one lockf'd /tmp/libtpu_lockfile for the whole host, skipped when
    # ALLOW_MULTIPLE_LIBTPU_LOAD is true or TPU_CHIPS_PER_PROCESS_BOUNDS is set and not "2,2,1":
    # the one-chip bounds alone skip it. ALLOW_MULTIPLE_LIBTPU_LOAD is kept for the other lock,
    # in libtpu's GCP init: torch_tpu sets it *beside* the same one-chip bounds ("Avoid
    # multi-process libtpu lock in GCP init, see b/487769788", jonathan1920/torch_tpu
    # csrc/common/environment.cc @ df046ee0, InitializeDistributedEnvironment).
    import inspect

    from diffq.worker.device import backends

    assert "GCP init" in inspect.getsource(backends._tpu_pin)  # the comment says which source needs it
    for generation in (None, "v6e", "v7"):
        env = get_backend("tpu").pin(Placement(slot=2, generation=generation))
        assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] not in ("", "2,2,1")  # a subset: skipped even without it
    assert {p["env"]["ALLOW_MULTIPLE_LIBTPU_LOAD"] for p in worker_plan("--device", "tpu", "--chips", "0-3")} == {"1"}
    # A --tp rank gets it from torch_tpu itself (test_tensor_parallel.py).
    assert "ALLOW_MULTIPLE_LIBTPU_LOAD" not in get_backend("tpu").rank_pin(
        Placement(slot=0, group_slots=(0, 1, 2, 3), generation="v6e"))


def test_pin_tpu_v7_single_chip_bounds_are_4d():
    # BACKENDS.md TPU "v7 single chip": chip bounds are 4-D there (torch_tpu environment.cc).
    env = get_backend("tpu").pin(Placement(slot=1, generation="v7"))
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_PROCESS_BOUNDS"] == "1,1,1,1"
    for generation in ("v5e", "v5p", "v6e"):
        assert get_backend("tpu").pin(Placement(slot=1, generation=generation))["TPU_PROCESS_BOUNDS"] == "1,1,1"


def test_pin_cuda_and_cpu():
    assert get_backend("cuda").pin(Placement(slot=1))["CUDA_VISIBLE_DEVICES"] == "1"
    cpu = get_backend("cpu").pin(Placement(slot=0, threads=3))
    assert cpu == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}


def test_parse_devices():
    assert parse_devices("0-3") == [0, 1, 2, 3]
    assert parse_devices("0,2,5-6") == [0, 2, 5, 6]
    for bad in ("3-1", "0,0", "a-b", "auto"):
        with pytest.raises(ValueError):
            parse_devices(bad)


def test_no_device_branching_outside_the_table():
    # ARCHITECTURE.md: no device if/else outside backends.py.
    pattern = re.compile(r"""["'](neuron|tpu|cuda)["']""")
    for path in WORKER_DIR.rglob("*.py"):
        if path.name != "backends.py":
            assert not pattern.search(path.read_text()), f"{path.name} names a device kind"


# --- compile cache location ---------------------------------------------------------


def test_cache_namespace_holds_package_versions(monkeypatch):
    import diffusers
    import torch

    ns = compile_cache.namespace(get_backend("neuron"))
    assert ns.startswith("neuron/")
    assert re.sub(r"[^A-Za-z0-9._-]", "-", f"torch-{torch.__version__}") in ns
    assert f"diffusers-{diffusers.__version__}" in ns
    assert "torch-neuronx-" in ns and "neuronx-cc-" in ns
    assert "torch-tpu-" in compile_cache.namespace(get_backend("tpu"))
    monkeypatch.setattr(compile_cache, "_version", lambda package: "9.9")
    assert compile_cache.namespace(get_backend("neuron")) != ns  # an upgrade never reuses it


def test_cache_plan_dir_url_and_native_gs(tmp_path):
    cpu, tpu = get_backend("cpu"), get_backend("tpu")
    shared = compile_cache.plan_cache(str(tmp_path), cpu)
    assert shared.remote is None
    assert shared.env == {"TORCHINDUCTOR_CACHE_DIR": f"{tmp_path}/{compile_cache.namespace(cpu)}"}
    synced = compile_cache.plan_cache("s3://bucket/cache", cpu, local_root=str(tmp_path / "m"))
    assert synced.remote == f"s3://bucket/cache/{compile_cache.namespace(cpu)}"
    assert synced.env["TORCHINDUCTOR_CACHE_DIR"] == synced.local_dir == f"{tmp_path}/m/{compile_cache.namespace(cpu)}"
    # BACKENDS.md TPU "compile cache": tier 3 takes gs:// itself: no diffq sync.
    native = compile_cache.plan_cache("gs://bucket/cache", tpu)
    assert native.remote is None and native.local_dir is None
    assert {native.env[name] for name in tpu.cache_envs()} == {f"gs://bucket/cache/{compile_cache.namespace(tpu)}"}
    # BACKENDS.md TPU "tier-2 cache": tier 3 needs tier 2 (tier3_compilation_cache.cc); set
    # explicitly, both names (TORCH_TPU_INTERNAL_TIER2_COMPILATION_CACHE in
    # tier2_compilation_cache.cc, the shorter one in newer notebooks): a name under /dev/shm.
    assert native.env["TORCH_TPU_INTERNAL_TIER2_COMPILATION_CACHE"] == native.env[
        "TORCH_TPU_TIER2_COMPILATION_CACHE"] == "diffq"
    assert compile_cache.plan_cache(None, tpu).env == {}  # no tier 3, nothing forced
    assert not any("TIER2" in k for k in shared.env)
    # No cache configured: Neuron's documented default, nothing for the others.
    assert compile_cache.plan_cache(None, get_backend("neuron")).env == {
        "TORCH_NEURONX_NEFF_CACHE_DIR": "/tmp/neff_cache"}
    assert compile_cache.plan_cache(None, cpu).env == {}


# --- diffq worker --plan ------------------------------------------------------------

QUEUE = queue_name(ShapeKey(model="/models/klein", height=32, width=32, batch_size=1,
                            max_sequence_length=16, cfg=False))


def worker_plan(*args: str) -> list[dict]:
    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["worker", "--broker", "memory://", "--queues", QUEUE,
                                      "--model", "/models/klein", "--plan", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_neuron_cores():
    plan = worker_plan("--device", "neuron", "--cores", "0-7", "--compile", "full",
                       "--compile-cache", "/mnt/fsx/cache", "--warmup", "32x32")
    assert [p["env"]["NEURON_RT_VISIBLE_CORES"] for p in plan] == [str(i) for i in range(8)]
    ns = compile_cache.namespace(get_backend("neuron"))
    for entry in plan:
        assert entry["device"] == "neuron" and entry["compile_backend"] == "neuron"
        assert entry["compile_options"] == {"backend": "neuron", "fullgraph": True, "dynamic": False}
        assert entry["cache_env"] == "TORCH_NEURONX_NEFF_CACHE_DIR"
        assert entry["env"]["TORCH_NEURONX_NEFF_CACHE_DIR"] == f"/mnt/fsx/cache/{ns}"
        assert entry["dist_backend"] == "neuron"
        assert entry["queues"] == entry["warmup"] == [QUEUE]
    assert len({p["name"] for p in plan}) == 8


def test_plan_tpu_chips():
    plan = worker_plan("--device", "tpu", "--chips", "0-3", "--compile", "regional",
                       "--compile-cache", "s3://bucket/cache")
    assert [p["env"]["TPU_VISIBLE_DEVICES"] for p in plan] == ["0", "1", "2", "3"]
    assert len({p["env"]["TPU_PROCESS_PORT"] for p in plan}) == 4
    for entry in plan:
        assert entry["env"]["TPU_PROCESS_BOUNDS"] == entry["env"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert entry["compile_backend"] == "tpu" and entry["dist_backend"] == "tpu_dist"
        assert entry["cache_remote"].startswith("s3://bucket/cache/tpu/")
        assert entry["env"]["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] == entry["cache_dir"]


def test_plan_cuda_gpus():
    plan = worker_plan("--device", "cuda", "--gpus", "0,1")
    assert [p["env"]["CUDA_VISIBLE_DEVICES"] for p in plan] == ["0", "1"]
    assert {p["compile_backend"] for p in plan} == {"inductor"}
    assert {p["cache_env"] for p in plan} == {"TORCHINDUCTOR_CACHE_DIR"}
    assert all(p["compile_options"] is None for p in plan)  # --compile none


def test_plan_cpu_workers():
    plan = worker_plan("--device", "cpu", "--workers", "2", "--threads", "1")
    assert [p["slot"] for p in plan] == [0, 1]
    for entry in plan:
        assert entry["env"]["OMP_NUM_THREADS"] == "1"
        assert not any(k.startswith(("CUDA_", "NEURON_", "TPU_")) for k in entry["env"])
        assert entry["dist_backend"] == "gloo"


def test_plan_rejects_unserved_warmup_size():
    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["worker", "--broker", "memory://", "--queues", QUEUE,
                                      "--model", "/models/klein", "--warmup", "64x64", "--plan"])
    assert result.exit_code == 2 and "64x64" in result.output


# --- a spawned child sees its pinning before `import torch` ---------------------------


def test_spawned_children_see_pinning_before_torch(tmp_path, monkeypatch):
    # Inherited from a torchrun or a pod spec: a single-device worker must drop them
    # (BACKENDS.md TPU "distributed mode trigger", torch_tpu discovery.cc).
    for name, value in {"WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1",
                        "MASTER_PORT": "1234", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    specs = [
        spec.model_copy(update={"env_report": str(tmp_path / f"{spec.name}.json")})
        for device, slots in (("neuron", [3]), ("tpu", [0, 1]), ("cuda", [1]), ("cpu", [0]))
        for spec in plan_children(device=device, devices=slots, broker_url="memory://",
                                  queues=["q"], threads=2, compile_cache=str(tmp_path / "cache"))
    ]
    supervisor = Supervisor(specs, restart=False)
    supervisor.start()
    try:
        deadline = time.monotonic() + 60
        while not all(Path(s.env_report).exists() for s in specs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        supervisor.stop(timeout=0)
    seen = {s.name: json.loads(Path(s.env_report).read_text()) for s in specs}
    for spec in specs:
        report = seen[spec.name]
        assert report["torch_imported"] is False
        for name, value in spec.env().items():
            assert report["env"][name] == value, (spec.name, name)
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            assert name not in report["env"], (spec.name, name)
    assert seen["diffq-neuron3"]["env"]["NEURON_RT_VISIBLE_CORES"] == "3"
    assert seen["diffq-tpu1"]["env"]["TPU_VISIBLE_DEVICES"] == "1"
    assert seen["diffq-tpu0"]["env"]["TPU_PROCESS_PORT"] != seen["diffq-tpu1"]["env"]["TPU_PROCESS_PORT"]
    assert seen["diffq-cuda1"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert seen["diffq-cpu0"]["env"]["OMP_NUM_THREADS"] == "2"
    assert seen["diffq-cpu0"]["env"]["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "cache"))
    assert len({r["pid"] for r in seen.values()}) == len(specs)


# --- the table is the only source of CLI choices ---------------------------------------


def test_cli_choices_come_from_the_table():
    from diffq.app.choices import CompileMode, Device, Dtype, TpuGeneration
    from diffq.core.contract import DTYPE_TAGS
    from diffq.worker.device.backends import TPU_GENERATIONS

    assert [d.value for d in Device] == list(BACKENDS)
    assert [m.value for m in CompileMode] == ["none", "full", "regional", "defer-fuse"]
    assert {m.value for m in CompileMode} == {m for b in BACKENDS.values() for m in b.compile_modes}
    assert [d.value for d in Dtype] == ["auto", *DTYPE_TAGS] == ["auto", "float32", "bfloat16", "float16"]
    assert [g.value for g in TpuGeneration] == list(TPU_GENERATIONS)


def test_defer_fuse_only_on_tpu():
    # BACKENDS.md "Checked combinations": defer-fuse is a TorchTPU eager mode.
    assert [k for k, b in BACKENDS.items() if "defer-fuse" in b.compile_modes] == ["tpu"]


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cuda", "bfloat16"),
                                           ("neuron", "bfloat16"), ("tpu", "bfloat16")])
def test_dtype_defaults_to_the_backends(device, dtype):
    # BACKENDS.md: every seed example runs bfloat16 on neuron, tpu and cuda. The worker's
    # --dtype defaults to auto, and its plan says what auto runs at on this device.
    plan = worker_plan("--device", device)
    assert {(p["dtype"], p["runs_dtype"], p["auto_dtype"]) for p in plan} == {("auto", dtype, dtype)}
    assert {p["runs_dtype"] for p in worker_plan("--device", device, "--dtype", "bfloat16")} == {"bfloat16"}


@pytest.mark.parametrize("device", ["cpu", "cuda", "neuron", "tpu"])
def test_a_worker_refuses_queues_pinned_to_a_dtype_its_device_does_not_run(device):
    from diffq.core.contract import DTYPE_TAGS, ShapeKey

    backend = BACKENDS[device]
    for dtype in DTYPE_TAGS:
        queue = ShapeKey(model="m", height=64, width=64, batch_size=1, max_sequence_length=64, cfg=False,
                         dtype=dtype).queue
        if dtype in backend.dtypes:
            assert worker_plan("--device", device, "--queues", queue)
        else:
            assert f"{queue} is {dtype}, which --device {device} does not run" in plan_fails(
                "--device", device, "--queues", queue)


def plan_fails(*args: str) -> str:
    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["worker", "--broker", "memory://", "--plan", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    return result.output


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda", "--compile", "defer-fuse"], "--compile defer-fuse (a tpu mode) is not offered on --device cuda"),
    (["--device", "neuron", "--cores", "0", "--compile", "defer-fuse"], "choose none, full, regional"),
    (["--device", "cpu", "--offload", "model", "--compile", "full"], "use --compile regional"),
    (["--device", "cpu", "--offload", "disk"], "unknown --offload 'disk'; choose model"),
    (["--device", "cpu", "--tpu-generation", "v6e"], "not one of --device cpu's"),
])
def test_checked_combinations_are_refused_before_anything_starts(args, message):
    assert message in plan_fails(*args)


def test_offload_model_with_regional_is_accepted():
    (entry,) = worker_plan("--device", "cpu", "--offload", "model", "--compile", "regional")
    assert entry["compile"] == "regional"


def test_reference_configuration_is_a_plain_cpu_run():
    # What `diffq qualify` judges every device against: no accelerator, full precision,
    # eager, weights resident; a configuration the table itself accepts.
    assert REFERENCE == RunConfig(device="cpu", dtype="float32", compile="none", offload=None)
    get_backend(REFERENCE.device).check(compile=REFERENCE.compile, offload=REFERENCE.offload)
    assert REFERENCE.dtype in DTYPES and REFERENCE.compile not in COMPILING_MODES
    assert str(REFERENCE) == "cpu, float32, eager"
    assert str(RunConfig("cuda", "bfloat16", "regional", "model")) == "cuda, bfloat16, compile regional, offload model"


def test_plan_without_queues():
    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["worker", "--broker", "memory://", "--device", "neuron", "--cores", "0-1",
                                      "--plan"])
    assert result.exit_code == 0, result.output
    assert [p["queues"] for p in json.loads(result.stdout)] == ["discovered", "discovered"]
    # Without --plan, a worker still needs its queues.
    result = CliRunner().invoke(app, ["worker", "--broker", "memory://", "--device", "cpu"])
    assert result.exit_code == 2 and "no queues" in result.output


ALLOCATION_VARIABLES = ("NEURON_RT_VISIBLE_CORES", "AWS_NEURON_VISIBLE_DEVICES", "NEURON_LOGICAL_NC_CONFIG",
                        "TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES")


def auto_plan(*args: str, **env: str) -> list[dict]:
    """`worker --plan` with `--<option> auto` under exactly these allocation variables."""
    from diffq.app.cli import app

    environ = {name: None for name in ALLOCATION_VARIABLES} | env
    result = CliRunner().invoke(app, ["worker", "--broker", "memory://", "--queues", QUEUE, "--plan", *args],
                                env=environ)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cores_auto_reads_the_device_plugins_cores():
    # aws-neuron-sdk containers/tutorials/ks8-neuron-scheduler-flow.rst: an
    # aws.amazon.com/neuroncore allocation reaches the container as NEURON_RT_VISIBLE_CORES.
    assert [s.env for s in get_backend("neuron").allocation] == ["NEURON_RT_VISIBLE_CORES", "AWS_NEURON_VISIBLE_DEVICES"]
    plan = auto_plan("--device", "neuron", "--cores", "auto", NEURON_RT_VISIBLE_CORES="8-11",
                     AWS_NEURON_VISIBLE_DEVICES="5")  # cores are the finer word: they win
    assert [p["env"]["NEURON_RT_VISIBLE_CORES"] for p in plan] == ["8", "9", "10", "11"]
    assert {json.dumps(p["allocation"]) for p in plan} == {
        json.dumps({"variable": "NEURON_RT_VISIBLE_CORES", "value": "8-11"})}


@pytest.mark.parametrize("lnc, cores", [(None, [8, 9, 10, 11, 12, 13, 14, 15]), ("2", list(range(8, 16))),
                                        ("1", list(range(16, 32)))])
def test_cores_auto_reads_older_plugins_devices_at_the_nodes_lnc(lnc, cores):
    # aws-neuron-sdk neuron-deploy/tutorials/k8s-neuron-scheduler.rst: an aws.amazon.com/neuron
    # request reaches the container as "AWS_NEURON_VISIBLE_DEVICES: 2,3" (devices; "all the
    # cores belonging to the device", containers/tutorials/k8s-neuron-device-plugin.rst).
    # Trn2: 8 physical cores per device; LNC from NEURON_LOGICAL_NC_CONFIG, else 2 on trn2
    # (torch-neuronx csrc/core/utils/PlatformUtils.cpp, GetLogicalNeuronCores).
    plan = auto_plan("--device", "neuron", "--cores", "auto", AWS_NEURON_VISIBLE_DEVICES="2,3",
                     **({"NEURON_LOGICAL_NC_CONFIG": lnc} if lnc else {}))
    assert [int(p["env"]["NEURON_RT_VISIBLE_CORES"]) for p in plan] == cores
    allocation = plan[0]["allocation"]
    assert (allocation["variable"], allocation["value"]) == ("AWS_NEURON_VISIBLE_DEVICES", "2,3")
    assert allocation["per_id"] == (f"{len(cores) // 2} logical cores per Neuron device "
                                    + (f"(NEURON_LOGICAL_NC_CONFIG={lnc})" if lnc else "(LNC 2, the Trn2 default)"))


def test_chips_auto_reads_gkes_visible_chips():
    # libtpu prefers a non-empty TPU_VISIBLE_CHIPS over TPU_VISIBLE_DEVICES (torch_tpu
    # csrc/common/env_vars.h, environment.cc); Ray reads TPU_VISIBLE_CHIPS as a process's
    # chips (ray python/ray/_private/accelerators/tpu.py).
    assert [s.env for s in get_backend("tpu").allocation] == ["TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES"]
    for variable in ("TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES"):
        plan = auto_plan("--device", "tpu", "--chips", "auto", **{variable: "0,1,2,3"})
        assert [p["env"]["TPU_VISIBLE_DEVICES"] for p in plan] == ["0", "1", "2", "3"]
        assert plan[0]["allocation"] == {"variable": variable, "value": "0,1,2,3"}
    plan = auto_plan("--device", "tpu", "--chips", "auto", TPU_VISIBLE_CHIPS="2,3", TPU_VISIBLE_DEVICES="0,1,2,3")
    assert [p["slot"] for p in plan] == [2, 3] and plan[0]["allocation"]["variable"] == "TPU_VISIBLE_CHIPS"
    # Listed devices say where they came from by saying nothing.
    assert all("allocation" not in p for p in auto_plan("--device", "tpu", "--chips", "0-1"))


@pytest.mark.parametrize("args, message", [
    (["--device", "neuron", "--cores", "auto"],
     "--cores auto: none of NEURON_RT_VISIBLE_CORES, AWS_NEURON_VISIBLE_DEVICES is set"),
    (["--device", "tpu", "--chips", "auto"], "--chips auto: none of TPU_VISIBLE_CHIPS, TPU_VISIBLE_DEVICES is set"),
    (["--device", "cuda", "--gpus", "auto"], "--gpus auto is not available"),
])
def test_auto_without_an_allocation_names_every_variable(args, message):
    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["worker", "--broker", "memory://", "--plan", *args],
                                env={name: None for name in ALLOCATION_VARIABLES} | {"COLUMNS": "300"})
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("lnc, per_device", [(None, 4), ("1", 8)])
def test_cores_auto_counts_the_devices_the_container_sees_under_all(tmp_path, monkeypatch, lnc, per_device):
    # aws-neuron-sdk containers/tutorials/tutorial-oci-hook.rst and containers/faq.rst:
    # AWS_NEURON_VISIBLE_DEVICES=ALL (AWS's container examples) exposes every Neuron device,
    # each a /dev/neuron<N> in the container ("--device /dev/neuron#" per device); each
    # device is _neuron_cores_per_device's cores.
    from diffq.worker.device import backends

    for name in ("neuron0", "neuron1", "neuron_fake", "neuronx", "null"):
        (tmp_path / name).touch()
    monkeypatch.setattr(backends, "NEURON_DEV", tmp_path)
    assert [s.everything for s in get_backend("neuron").allocation] == [None, "ALL"]
    for value in ("ALL", "all"):
        plan = auto_plan("--device", "neuron", "--cores", "auto", AWS_NEURON_VISIBLE_DEVICES=value,
                         **({"NEURON_LOGICAL_NC_CONFIG": lnc} if lnc else {}))
        assert [int(p["env"]["NEURON_RT_VISIBLE_CORES"]) for p in plan] == list(range(2 * per_device))
        assert plan[0]["allocation"]["value"] == value
        assert plan[0]["allocation"]["seen"] == f"2 Neuron device(s) seen in {tmp_path}: 0,1"


def test_bad_allocation_values_name_the_variable(tmp_path, monkeypatch):
    from diffq.worker.device import backends
    from diffq.worker.device.backends import allocated_devices

    monkeypatch.setattr(backends, "NEURON_DEV", tmp_path)  # ALL, and the container sees no device
    with pytest.raises(ValueError, match=r"AWS_NEURON_VISIBLE_DEVICES=ALL: no .*/neuron<N> device files"):
        allocated_devices(get_backend("neuron"), {"AWS_NEURON_VISIBLE_DEVICES": "ALL"})
    with pytest.raises(ValueError, match="AWS_NEURON_VISIBLE_DEVICES=some"):
        allocated_devices(get_backend("neuron"), {"AWS_NEURON_VISIBLE_DEVICES": "some"})
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG=3"):
        allocated_devices(get_backend("neuron"), {"AWS_NEURON_VISIBLE_DEVICES": "0", "NEURON_LOGICAL_NC_CONFIG": "3"})


def test_single_device_workers_drop_distributed_env():
    for device in BACKENDS:
        for entry in worker_plan("--device", device):
            assert set(entry["unset"]) == {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                           "MASTER_ADDR", "MASTER_PORT"}
            assert not set(entry["unset"]) & set(entry["env"])


# --- TPU generations, as torch_tpu detects them ------------------------------------------


def test_tpu_topology_table():
    # torch_tpu torch_tpu/_internal/distributed/tpu_topology.py (_TPU_PCI_DEVICE_IDS_TO_TOPOLOGY).
    from diffq.worker.device.backends import TPU_GENERATIONS, TPU_PCI_VENDOR

    assert TPU_PCI_VENDOR == "0x1ae0"
    assert {name: (g.pci_device, g.topologies) for name, g in TPU_GENERATIONS.items()} == {
        "v5p": ("0x0062", {4: "2,2,1", 8: "2,2,2"}),
        "v5e": ("0x0063", {4: "2,2,1", 8: "2,2,2"}),
        "v6e": ("0x006f", {4: "2,2,1", 8: "2,2,2"}),
        "v7": ("0x0076", {2: "1,1,1,2", 4: "1,2,1,2", 8: "2,2,1,2"}),
    }


def fake_pci(root: Path, devices: list[tuple[str, str]]) -> Path:
    for i, (vendor, device) in enumerate(devices):
        folder = root / f"0000:00:{i:02x}.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(vendor + "\n")
        (folder / "device").write_text(device + "\n")
    return root


@pytest.mark.parametrize("device_id, generation", [("0x0062", "v5p"), ("0x0063", "v5e"), ("0x006f", "v6e"),
                                                   ("0x0076", "v7")])
def test_tpu_generation_from_pci_ids(tmp_path, device_id, generation):
    from diffq.worker.device.backends import detect_tpu_generation

    # An Intel NIC and an NVIDIA GPU first: only Google's vendor id counts.
    root = fake_pci(tmp_path / "pci", [("0x8086", "0x1521"), ("0x10de", "0x006f"), ("0x1ae0", device_id)])
    assert detect_tpu_generation(root) == generation


def test_no_tpu_no_generation(tmp_path):
    from diffq.worker.device.backends import detect_tpu_generation

    assert detect_tpu_generation(fake_pci(tmp_path / "pci", [("0x10de", "0x2330")])) is None
    assert detect_tpu_generation(tmp_path / "missing") is None
    assert detect_tpu_generation(fake_pci(tmp_path / "other", [("0x1ae0", "0x9999")])) is None
