"""Compiling per shape, warmup, the recompile limit, and the shared compile cache.

Neuron and TPU cannot run here, so stand-in `torch.compile` backends are registered
under their real names ("neuron", "tpu") that record each graph and delegate to
"eager" (../shared/BACKENDS.md, Trainium "compile" and TPU "modes" rows: both are
`torch.compile(m, backend=<name>, fullgraph=True, dynamic=False)`). One Inductor
round trip checks the cache for real.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from diffq.core.contract import BatchItem, BatchParams, ShapeKey, queue_name
from diffq.worker.device.backends import get_backend
from diffq.worker.device import compile_cache
from diffq.worker.device.compile_cache import CacheSync, mirrored, plan_cache
from diffq.core.families import Family, StableDiffusion3
from diffq.worker.device.pipeline_host import CompileUnsupported, PipelineHost
from diffq.worker.delivery.spec import ChildSpec

GRAPHS: dict[str, list] = {"neuron": [], "tpu": []}


def _stand_in(name: str):
    def compiler(gm, example_inputs):
        GRAPHS[name].append(gm)
        return torch._dynamo.lookup_backend("eager")(gm, example_inputs)

    return compiler


for _name in GRAPHS:
    if _name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_stand_in(_name), name=_name)

STAND_INS = Path(__file__).parent / "stand_ins"


def _load_neuron_runtime():
    """The stand-in of torch-neuronx's execution_wrapper (tests/stand_ins/.../backend.py),
    loaded by path: importing the stand-in package would rewrite this process's table."""
    path = STAND_INS / "torch_neuronx" / "neuron_dynamo_backend" / "backend.py"
    spec = importlib.util.spec_from_file_location("standin_neuron_runtime", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NEURON_RUNTIME = _load_neuron_runtime()


def _neuron_failing_on_device(gm, example_inputs):
    # The compiled graph as torch-neuronx wraps it: run "on the device", else raise or fall back.
    return NEURON_RUNTIME.execution_wrapper(NEURON_RUNTIME.on_device(gm.forward), gm.forward)


if "neuron_failing_on_device" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(_neuron_failing_on_device, name="neuron_failing_on_device")


@pytest.fixture
def compiled(monkeypatch):
    """Fresh dynamo state; records the options every torch.compile call receives."""
    calls = []
    real_compile = torch.compile

    def recording_compile(*args, **kwargs):
        calls.append(kwargs)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    torch._dynamo.reset()
    counters.clear()
    for graphs in GRAPHS.values():
        graphs.clear()
    # set_shape_budget raises the limits process-wide; start from and restore the default.
    with torch._dynamo.config.patch(recompile_limit=8):
        yield calls
    torch._dynamo.reset()


def stand_in(kind: str):
    """The real table entry, but tensors stay on the CPU (no device index per thread)."""
    return dataclasses.replace(get_backend(kind), torch_device="cpu", thread_device=False)


def shape(model: str, height: int, width: int = 32, batch: int = 1) -> ShapeKey:
    return ShapeKey(model=model, height=height, width=width, batch_size=batch,
                    max_sequence_length=16, cfg=False)


def items(n: int) -> list[BatchItem]:
    return [BatchItem(id=f"i{i}", prompt=f"prompt {i}", seed=i) for i in range(n)]


def test_neuron_name_fullgraph_once_per_shape_zero_recompiles(compiled, tiny_model):
    host = PipelineHost(backend=stand_in("neuron"), compile_mode="full")
    small, tall = shape(tiny_model, 32), shape(tiny_model, 48)
    host.pipeline(tiny_model, "float32")
    assert compiled == [{"backend": "neuron", "fullgraph": True, "dynamic": False}]

    host.warmup([small, tall])  # before consuming
    assert len(GRAPHS["neuron"]) == 2
    assert host.compile_graphs == {small.queue: 1, tall.queue: 1}
    # Steady state: steps change (BACKENDS.md "recompiles": steps → none) and a
    # short batch is padded, yet nothing compiles again.
    for s, steps in ((small, 2), (tall, 3), (small, 1)):
        generated = host.generate(s, BatchParams(num_inference_steps=steps, guidance_scale=1.0), items(1))
        assert not generated.compiled and len(generated.images) == 1
    assert len(GRAPHS["neuron"]) == 2
    stats = host.compile_stats()
    assert stats["recompiles"] == 0 and stats["graphs"] == 2 and stats["shapes"] == 2
    assert stats["backend"] == "neuron" and stats["seconds"] > 0


def test_tpu_name_fullgraph_on_tiny_flux(compiled, tiny_pipelines):
    # Both tiny families trace as one graph with fullgraph=True (klein above).
    model = tiny_pipelines["flux"]
    host = PipelineHost(backend=stand_in("tpu"), compile_mode="full")
    s = shape(model, 32)
    first = host.generate(s, BatchParams(num_inference_steps=1, guidance_scale=3.5), items(1))
    again = host.generate(s, BatchParams(num_inference_steps=2, guidance_scale=5.0), items(1))
    assert compiled == [{"backend": "tpu", "fullgraph": True, "dynamic": False}]
    assert first.compiled and not again.compiled
    assert len(GRAPHS["tpu"]) == 1 and host.recompiles == 0


@pytest.mark.parametrize("kind, counted", [("neuron", True), ("tpu", True), ("cpu", False), ("cuda", False)])
def test_eager_first_batch_is_compile_time_on_neuron_and_tpu(compiled, tiny_model, kind, counted):
    """Neuron and TPU eager modes compile each op on first use (seed 000): a shape's first
    batch is its compile time in metrics, the warm-start report and compile_stats, even
    with --compile none; Inductor backends compile nothing then."""
    assert get_backend(kind).eager_compiles is counted
    host = PipelineHost(backend=stand_in(kind), compile_mode="none")
    s = shape(tiny_model, 32)
    host.warmup([s])
    again = host.generate(s, BatchParams(num_inference_steps=1, guidance_scale=1.0), items(1))
    assert compiled == [] and not again.compiled  # torch.compile never called
    stats = host.compile_stats()
    assert stats["backend"] is None and stats["eager_compiles"] is counted
    if counted:
        assert list(stats["per_shape"]) == [s.queue] and stats["seconds"] > 0 and stats["shapes"] == 1
    else:
        assert stats["per_shape"] == {} and stats["seconds"] == 0


def test_a_compiled_graph_failing_on_the_device_fails_the_batch_unless_allowed(compiled, tiny_model, monkeypatch):
    """torch-neuronx neuron_dynamo_backend/backend.py (execution_wrapper): a compiled graph
    failing at run time re-runs uncompiled with a log line only, unless
    TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION. A worker's environment disables it; with
    --allow-fallback the batch is produced and every such call counted."""
    from diffq.worker.observe import metrics

    switch = get_backend("neuron").graph_fallback.env
    backend = dataclasses.replace(stand_in("neuron"), compile_backend="neuron_failing_on_device")
    s = shape(tiny_model, 32)
    params = BatchParams(num_inference_steps=2, guidance_scale=1.0)

    def host_as_planned(**spec_fields) -> PipelineHost:
        env = ChildSpec(name="n", device="neuron", broker_url="memory://", queues=[], compile="full",
                        **spec_fields).env()
        monkeypatch.setenv(switch, env[switch])
        return PipelineHost(backend=backend, compile_mode="full")

    monkeypatch.delenv("STANDIN_NEURON_RUNTIME_FAIL", raising=False)
    healthy = host_as_planned().generate(s, params, items(1))
    assert healthy.graph_fallbacks == 0

    monkeypatch.setenv("STANDIN_NEURON_RUNTIME_FAIL", "1")
    failing = host_as_planned()
    with pytest.raises(RuntimeError, match="failed on the device"):
        failing.generate(s, params, items(1))  # the task retries it, then records the failure
    assert failing.graph_fallbacks == {}

    allowed = host_as_planned(allow_fallback=True)
    before = metrics.REGISTRY.get_sample_value("diffq_graph_fallbacks_total", {"shape": s.label}) or 0.0
    generated = allowed.generate(s, params, items(1))
    # One compiled transformer call per step, each re-run uncompiled: same pixels, counted.
    assert generated.graph_fallbacks == params.num_inference_steps
    assert [image.tolist() for image in generated.images] == [image.tolist() for image in healthy.images]
    assert allowed.compile_stats()["graph_fallbacks"] == {s.label: 2}  # the warm-up report's figure
    metrics.observe_graph_fallback(s.label, generated.graph_fallbacks)  # as the batch task does
    assert metrics.REGISTRY.get_sample_value("diffq_graph_fallbacks_total", {"shape": s.label}) == before + 2


def test_fallbacks_are_counted_from_the_backends_own_line_only():
    import logging

    from diffq.worker.device.pipeline_host import fallback_count

    row = get_backend("neuron").graph_fallback
    vendor = logging.getLogger(row.logger)
    start = fallback_count(row)
    vendor.error("Execution failed: boom")  # the line before it: not a second fallback
    vendor.warning("Falling back to original GraphModule execution")
    logging.getLogger("elsewhere").warning("Falling back to original GraphModule execution")
    assert fallback_count(row) == start + 1
    assert fallback_count(get_backend("cpu").graph_fallback) == 0


def test_regional_without_repeated_blocks_is_a_clear_error():
    # diffusers: SD3 declares no _repeated_blocks (BACKENDS.md diffusers section).
    host = PipelineHost(backend=stand_in("neuron"), compile_mode="regional")
    pipe = SimpleNamespace(transformer=torch.nn.Linear(2, 2))
    with pytest.raises(CompileUnsupported, match="no repeated blocks.*--compile full"):
        host._compile(pipe, StableDiffusion3)


class Scale(torch.nn.Module):
    # Defined here: torch's own modules sit in dynamo's skip list when compiled in place.
    def forward(self, x):
        return x * 2 + 1


class ScalePipe:
    """Just enough pipeline for the host: one compiled module whose input shape follows height."""

    def __init__(self):
        self.transformer = Scale()

    def __call__(self, prompt, height, width, generator):
        out = self.transformer(torch.zeros(len(prompt), height // 16, 4))
        return SimpleNamespace(images=list(out))


class ScaleFamily(Family):
    """Its family-table entry: the host passes only what the family declares."""

    name = pipeline_class = "ScalePipe"
    source = "tests/test_compile.py"
    call_arguments = frozenset({"prompt", "height", "width", "generator"})
    guidance = "embedded"
    repeated_blocks = False


def test_ninth_shape_within_raised_recompile_limit(compiled):
    # BACKENDS.md "recompile limit": 8 by default; the 9th shape with fullgraph=True
    # raises FailOnRecompileLimitHit. First show the limit is real here...
    bare = torch.compile(Scale(), backend="tpu", fullgraph=True, dynamic=False)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for rows in range(1, 10):
            bare(torch.zeros(rows, 4))
    torch._dynamo.reset()  # the failed code object is now marked skipped
    # ...then that a host serving 10 shapes raises it and never fails.
    host = PipelineHost(backend=stand_in("tpu"), compile_mode="full")
    pipe = ScalePipe()
    host._compile(pipe, ScaleFamily)
    shapes = [shape("m", 16 * rows) for rows in range(1, 11)]
    key = host.key("m", shapes[0].dtype)  # what the host loads an auto shape at
    host._pipelines[key] = pipe
    host._families[key] = ScaleFamily
    host.warmup(shapes)
    assert len(host.compile_graphs) == 10 and host.recompiles == 0


def test_warmup_selects_served_shapes():
    served = [shape("/m/a", 32), shape("/m/a", 48), shape("/m/a", 32, batch=4)]
    queues = [s.queue for s in served] + [queue_name(shape("/m/other", 32)), "not-a-shape"]
    spec = ChildSpec(name="w", broker_url="memory://", queues=queues, models=["/m/a"], warmup=["32x32"])
    assert spec.warmup_shapes() == [served[0], served[2]]
    assert spec.model_copy(update={"warmup": ["auto"]}).warmup_shapes() == served
    with pytest.raises(ValueError, match="neither 'auto' nor HxW"):
        ChildSpec(name="w", broker_url="memory://", queues=queues, warmup=["big"])


# --- compile cache sync -------------------------------------------------------------


def test_sync_push_is_atomic_and_first_writer_wins(s3_bucket, tmp_path):
    remote = f"{s3_bucket}/cache"
    a, b = CacheSync(remote, tmp_path / "a"), CacheSync(remote, tmp_path / "b")
    for sync, content in ((a, b"A" * 1000), (b, b"B" * 1000)):
        entry = sync.local / "fxgraph" / "ab" / "key1"
        entry.parent.mkdir(parents=True)
        entry.write_bytes(content)
        (entry.parent / ".123.456.tmp").write_bytes(b"half")  # Inductor in-flight write
        (sync.local / "locks").mkdir()
        (sync.local / "locks" / "x.lock").write_bytes(b"")
    threads = [threading.Thread(target=sync.push) for sync in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert a.pushed + b.pushed == 1  # same entry from two workers: one write
    fresh = CacheSync(remote, tmp_path / "c")
    assert fresh.pull() == 1
    assert sorted(key for key, _ in fresh.local_entries()) == ["fxgraph/ab/key1"]
    assert (fresh.local / "fxgraph/ab/key1").read_bytes() in (b"A" * 1000, b"B" * 1000)
    assert fresh.pull() == 0 and fresh.push() == 0


def _entry(directory: Path, key: str, content: bytes = b"x") -> None:
    (directory / key).parent.mkdir(parents=True, exist_ok=True)
    (directory / key).write_bytes(content)


def test_mirrored_pulls_before_and_pushes_after_into_the_namespace(tmp_path):
    cpu = get_backend("cpu")
    location = (tmp_path / "remote").as_uri()
    first = plan_cache(location, cpu, local_root=str(tmp_path / "host-a"))
    namespace = compile_cache.namespace(cpu)
    assert first.remote == f"{location}/{namespace}" and first.local_dir == f"{tmp_path}/host-a/{namespace}"
    with mirrored(first) as sync:
        _entry(Path(first.local_dir), "fxgraph/ab/key1")  # what a compile leaves
        _entry(Path(first.local_dir), "fxgraph/ab/.7.8.tmp")  # a write still in flight
    assert sync.pushed == 1
    assert (tmp_path / "remote" / namespace / "fxgraph/ab/key1").is_file()
    assert compile_cache.report(first, sync) == {"dir": first.local_dir, "remote": first.remote,
                                                 "pulled": 0, "pushed": 1}

    second = plan_cache(location, cpu, local_root=str(tmp_path / "host-b"))
    with mirrored(second) as sync:
        assert (Path(second.local_dir) / "fxgraph/ab/key1").is_file()  # pulled before the body
    assert (sync.pulled, sync.pushed) == (1, 0)
    # An upgrade (another namespace) starts empty instead of reading stale entries.
    other = dataclasses.replace(first, remote=f"{location}/inductor/torch-0.0", local_dir=str(tmp_path / "host-c"))
    with mirrored(other) as sync:
        pass
    assert (sync.pulled, sync.pushed) == (0, 0)


def test_mirrored_without_remote_and_when_sync_fails(tmp_path, caplog):
    cpu = get_backend("cpu")
    shared = plan_cache(str(tmp_path / "nfs"), cpu)  # a shared filesystem: nothing to sync
    with mirrored(shared) as sync:
        assert sync is None
    assert compile_cache.report(shared, None)["pulled"] == 0

    class Broken:
        def list_with_sizes(self):
            raise OSError("bucket unreachable")

        def upload_file(self, *_args, **_kwargs):
            raise OSError("bucket unreachable")

    plan = plan_cache((tmp_path / "remote").as_uri(), cpu, local_root=str(tmp_path / "host"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_cache, "open_storage", lambda _url: Broken())
        with mirrored(plan) as sync:
            _entry(Path(plan.local_dir), "fxgraph/ab/key1")
    # Neither failure reaches the caller: a missing cache costs compile time only.
    assert [r.getMessage().split(" from ")[0].split(" to ")[0] for r in caplog.records
            if r.name == compile_cache.__name__] == ["compile cache pull", "compile cache push"]

    with pytest.raises(RuntimeError), mirrored(plan) as sync:
        _entry(Path(plan.local_dir), "fxgraph/cd/key2")
        raise RuntimeError("compile failed")
    assert sync.pushed == 0  # a failed body pushes nothing
    assert not (tmp_path / "remote").exists()


def test_a_finished_child_exits_without_teardown_but_runs_its_exit_steps(tmp_path):
    # What a worker child's exit must still do when it skips the interpreter's teardown
    # (worker/process/child.py, every clean exit): an idle thread pool (non-daemon workers,
    # stopped by its own exit hook) does not hang it, exit handlers run, among them the
    # multiprocessing finalizers kombu restores a Redis channel's unacked messages with
    # (kombu/transport/virtual/base.py, QoS: `Finalize(self, self.restore_unacked_once,
    # exitpriority=1)`), buffered output is written, and the exit code is the one given.
    marker, restored = tmp_path / "atexit", tmp_path / "restored"
    code = f"""
import atexit, concurrent.futures, sys
from multiprocessing.util import Finalize
from diffq.worker.process.child import _exit_without_teardown
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(print, "pool ran").result()
atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
class QoS: pass
qos = QoS()
Finalize(qos, lambda: open({str(restored)!r}, "w").write("restored"), exitpriority=1)
sys.stdout.write("buffered, no newline")
_exit_without_teardown(4)
raise SystemExit(3)  # never reached
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4, proc.stderr
    assert proc.stdout.endswith("buffered, no newline") and "pool ran" in proc.stdout
    assert marker.read_text() == "ran" and restored.read_text() == "restored"


def test_cpu_vector_isa_probes_run_beside_the_load_and_import_nothing_there(tmp_path):
    # worker/device/backends.py, the cpu row's warm_in_background: Inductor's first CPU kernel
    # calls torch/_inductor/cpu_vec_isa.py `valid_vec_isa_list` (functools.cache), which
    # builds a probe per ISA and dlopens each in a `python -c` subprocess (VecISA.
    # check_build, _probe_load). A compiling child starts it in a thread after the cache
    # pull; everything it imports is imported first, on the main thread (warm_imports),
    # so the model's imports never race it. Nothing starts where nothing compiles.
    code = """
import importlib, sys
from diffq.worker.device.backends import BACKENDS
from diffq.worker.process.child import _warm_in_background
from diffq.worker.delivery.spec import ChildSpec
cpu = BACKENDS["cpu"]
assert _warm_in_background(ChildSpec(name="e", broker_url="memory://", queues=["q"])) is None
(module, name), = cpu.warm_in_background
for imported in cpu.warm_imports + (module,):
    importlib.import_module(imported)
probe = getattr(sys.modules[module], name)
before = set(sys.modules)
found = probe()
assert set(sys.modules) == before, sorted(set(sys.modules) - before)
probe.cache_clear()
thread = _warm_in_background(ChildSpec(name="c", broker_url="memory://", queues=["q"], compile="full"))
thread.join(120)
assert not thread.is_alive() and probe.cache_info().currsize == 1 and probe() == found
print("isas", len(found))
"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "isas" in proc.stdout


def test_dynamo_names_a_traced_function_only_where_a_log_prints_it(compiled, tiny_model):
    # worker/device/dynamo_quirks.py: torch/_dynamo/output_graph.py `SubgraphTracer.create_proxy`
    # builds a `trace_call` log header for every FX call it records, eagerly, and the
    # header's function name (torch/_dynamo/funcname_cache.py `get_funcname`) tokenizes
    # the traced file whole. With those logs off, a compile reads no source file for
    # it; with `trace_call` on, the header still names the function.
    import inspect

    import torch._logging
    from torch._dynamo import funcname_cache, symbolic_convert

    funcname_cache.clearcache()
    host = PipelineHost(backend=stand_in("neuron"), compile_mode="full")
    s = shape(tiny_model, 32)
    assert len(host.generate(s, BatchParams(num_inference_steps=1, guidance_scale=1.0), items(1)).images) == 1
    transformer = type(host.pipeline(tiny_model, "float32").transformer)
    source = inspect.getsourcefile(transformer)
    assert len(GRAPHS["neuron"]) == 1 and source not in funcname_cache.cache

    torch._dynamo.reset()
    torch._logging.set_logs(trace_call=True)
    try:
        again = PipelineHost(backend=stand_in("neuron"), compile_mode="full")
        assert len(again.generate(s, BatchParams(num_inference_steps=1, guidance_scale=1.0), items(1)).images) == 1
        forward_line = inspect.getsourcelines(transformer.forward)[1] + 1
        assert source in funcname_cache.cache
        assert symbolic_convert.get_funcname(source, forward_line) == f"{transformer.__name__}.forward"
    finally:
        torch._logging.set_logs()
    assert symbolic_convert.get_funcname(source, forward_line) is None


def warm_worker(model: str, remote: str, local: Path) -> dict:
    queue = queue_name(shape(model, 32))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "diffq", "worker", "--broker", "memory://", "--model", model,
         "--queues", queue, "--compile", "regional", "--compile-cache", remote,
         "--compile-cache-local", str(local), "--warmup-only"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"event": "warm"')]
    assert len(reports) == 1, proc.stdout
    return reports[0]


@pytest.mark.slow
def test_inductor_cache_second_worker_compiles_nothing_new(tiny_model, tmp_path):
    # BACKENDS.md CUDA/CPU "cache": persisting TORCHINDUCTOR_CACHE_DIR gives a fast
    # warm start. Two fresh processes, two separate local mirrors (two hosts), one
    # remote: the second pulls what the first pushed and misses nothing.
    remote = (tmp_path / "remote").as_uri()
    cold = warm_worker(tiny_model, remote, tmp_path / "host-a")
    warm = warm_worker(tiny_model, remote, tmp_path / "host-b")
    print(f"\ncold compile {cold['compile']['seconds']:.1f}s, warm {warm['compile']['seconds']:.1f}s, "
          f"{cold['cache']['pushed']} entries")
    assert cold["compile"]["cache"].get("fxgraph_cache_miss", 0) > 0
    assert cold["cache"]["pushed"] > 0 and cold["cache"]["pulled"] == 0
    assert warm["cache"]["pulled"] == cold["cache"]["pushed"]
    assert warm["compile"]["cache"].get("fxgraph_cache_miss", 0) == 0
    assert warm["compile"]["cache"]["fxgraph_cache_hit"] == cold["compile"]["cache"]["fxgraph_cache_miss"]
    assert warm["cache"]["pushed"] == 0  # nothing new compiled
    # AOTAutograd's cache too: the second process re-traces only with dynamo.
    assert warm["compile"]["cache"].get("autograd_cache_hit", 0) == cold["compile"]["cache"]["autograd_cache_saved"]
    assert warm["compile"]["graphs"] == cold["compile"]["graphs"] and warm["compile"]["recompiles"] == 0
    # Neither start walked the whole heap (worker/observe/heap.py); both serve with collection
    # on, their start's objects kept out of its walks.
    for start in (cold, warm):
        assert start["heap"]["full_collections"] == 0 and start["heap"]["collecting"]
        assert start["heap"]["kept"] > 100_000


@pytest.mark.slow
def test_a_worker_whose_graphs_fail_on_the_device_fails_fast_unless_allowed(tmp_path, redis_server, tiny_model):
    """`diffq worker` under the stand-in torch_neuronx (tests/stand_ins), whose compiled graph
    fails every call on the device: by default each item fails and is recorded as failed;
    with --allow-fallback each is produced, its record counting the calls that re-ran uncompiled."""
    import signal
    import time

    from diffq.core.storage import open_storage
    from diffq.producer.submit import submit
    from diffq.results.status import status

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STAND_INS), os.environ.get("PYTHONPATH", "")]),
           "STANDIN_NEURON_RUNTIME_FAIL": "1", "DIFFQ_TASK_MAX_RETRIES": "0"}  # fail, split, record: no backoff
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(2)))
    for allow in (False, True):
        out = str(tmp_path / f"run-{allow}")
        submit(prompts, out, model=tiny_model, broker_url=redis_server, batch_size=2, steps=2)
        worker = subprocess.Popen(
            [sys.executable, "-m", "diffq", "worker", "--broker", redis_server, "--run", out, "--device", "neuron",
             "--cores", "0", "--compile", "full", "--loglevel", "ERROR", *(["--allow-fallback"] if allow else [])],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 400
            while (st := status(out)).done + st.failed < 2 and worker.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
        finally:
            worker.send_signal(signal.SIGTERM)  # warm shutdown
            output, _ = worker.communicate(timeout=120)
        storage = open_storage(out)
        if not allow:
            assert (st.done, st.failed) == (0, 2), output[-3000:]
            errors = [json.loads(storage.get_bytes(key))["error"] for key in storage.list("failures/")]
            assert errors and all("failed on the device" in error for error in errors)
        else:
            assert (st.done, st.failed) == (2, 0), output[-3000:]
            lines = [json.loads(line) for key in storage.list("records/")
                     for line in storage.get_bytes(key).decode().splitlines() if line]
            assert [line["graph_fallbacks"] for line in lines] == [2, 2]  # one re-run call per step


def test_two_batch_tasks_take_turns_on_the_device(tiny_model):
    """A worker's two task threads (run-ahead) both call the host: each prepares its call
    outside the device lock, the calls themselves never overlap, and each image is the
    one a call on its own would make."""
    import threading

    import numpy as np

    host = PipelineHost(backend=get_backend("cpu"))
    small = shape(tiny_model, 32)
    params = BatchParams(num_inference_steps=2, guidance_scale=1.0)
    alone = [host.generate(small, params, [item]).images[0] for item in items(4)]
    results: dict[int, object] = {}

    def task(n: int) -> None:
        results[n] = host.generate(small, params, [items(4)[n]])

    threads = [threading.Thread(target=task, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    spans = sorted((r.started_at, r.ended_at) for r in results.values())
    assert len(spans) == 4 and all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(np.array_equal(results[n].images[0], alone[n]) for n in range(4))


def test_a_thread_leaving_the_device_lets_the_waiting_one_start_first():
    # worker/device/pipeline_host.py DeviceTurns: the thread leaving waits (GIL released) until
    # the waiting one holds the device, and only then goes on with its batch; with
    # nobody waiting it does not wait at all.
    import threading

    from diffq.worker.device.pipeline_host import DeviceTurns

    turns = DeviceTurns()
    turns.HANDOVER_S = 60.0  # a bound that only a broken hand-over reaches
    done = threading.Event()

    def next_call() -> None:
        with turns:
            done.wait(30)

    with turns:
        thread = threading.Thread(target=next_call)
        thread.start()
        while not turns._waiting:  # it has asked for the device
            done.wait(0.001)
    next_call_holds_the_device = turns._lock.locked()
    done.set()
    thread.join(30)
    assert next_call_holds_the_device and not turns._lock.locked()

    waits = []
    real_wait = turns._taken.wait
    turns._taken.wait = lambda timeout=None: waits.append(timeout) or real_wait(timeout)
    with turns:
        pass
    assert waits == []


def test_task_threads_run_on_the_loading_threads_device(tiny_model, monkeypatch):
    """Where the current device is per thread (CUDA's `thread_local targetDeviceIndex`,
    c10/cuda/CUDAFunctions.cpp; torch-neuronx's `thread_local int current_device_index`,
    torch_neuronx/csrc/core/NeuronDevice.cpp; torch_tpu's `thread_local DeviceIndex
    current_device_index_ = 0`, torch_tpu/csrc/eager/current_stream.cc), a task thread
    starts on index 0: each thread that calls the host is first bound to the index the
    loading thread had, once."""
    import dataclasses
    import threading

    import torch

    current = threading.local()
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: getattr(current, "index", 0))

    def set_index(index: int) -> None:
        calls.append((threading.current_thread().name, index))
        current.index = index

    monkeypatch.setattr(torch.accelerator, "set_device_index", set_index)
    host = PipelineHost(backend=dataclasses.replace(get_backend("cpu"), thread_device=True))
    current.index = 3  # the loading thread's device (a rank's LOCAL_RANK, say)
    small = shape(tiny_model, 32)
    params = BatchParams(num_inference_steps=1, guidance_scale=1.0)
    host.generate(small, params, items(1))
    seen: dict[str, int] = {}

    def task(name: str) -> None:
        for _ in range(2):
            host.generate(small, params, items(1))
        seen[name] = current.index

    threads = [threading.Thread(target=task, args=(f"task-{n}",), name=f"task-{n}") for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert seen == {"task-0": 3, "task-1": 3}
    assert sorted(calls) == [("task-0", 3), ("task-1", 3)]  # once per thread, none on the loading one
    assert not get_backend("cpu").thread_device


def test_warmup_compiles_a_lora_queue_only_around_its_known_layout():
    """A LoRA queue's scaffold comes from its run's manifest: `diffq run` passes the
    layout (warmed around it); a fleet worker without it leaves that shape to its first
    batch rather than compile it bare (and load it again then)."""
    from diffq.core.adapters import AdapterLayout

    layout = AdapterLayout(rank=8, targets=("to_q", "to_v"))
    bare = shape("/m/a", 32)
    lora = bare.model_copy(update={"lora": layout.label})
    other = bare.model_copy(update={"lora": "r4-0000abcd", "height": 48})
    spec = ChildSpec(name="w", broker_url="memory://", queues=[bare.queue, lora.queue, other.queue],
                     models=["/m/a"], warmup=["auto"])
    assert spec.warmup_shapes() == [bare]
    assert spec.model_copy(update={"adapter_layouts": {"/m/a": layout}}).warmup_shapes() == [bare, lora]
