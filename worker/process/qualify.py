"""`diffq qualify`, the child side: measure one pinned process exactly as a worker runs.

`python -m diffq.worker.process.qualify SPEC.json` sets the worker's environment from the
backend table (pinning, compile mode, compile cache) before `import torch`, imports
the backend's extension, then drives the same `PipelineHost` a worker uses:

- per shape: the first call (compile, or the per-op compile of eager Neuron/TPU),
  then `repeats` timed calls, then one call with a different `num_inference_steps`;
  after every shape one more call on each shape (revisit). Graphs are counted
  with dynamo's own counter around each call (`pipeline_host.graphs_compiled`).
- the first call's images (same prompts and seeds as the reference) are written as
  PNG for the parent to compare; a reference run (`measure=False`) writes only those.
- degenerate images (records.py DEGENERATE_CHECKS, every check on): counted per
  shape over all its calls, as a worker would find them.
- fallback ops, warnings (each once), peak device memory and host peak RSS, package
  versions, the compile cache: from the backend table, never by device name.
- under torch.compile, compiled graphs that failed on the device and re-ran
  uncompiled: the child runs as a worker does by default, with that fallback
  disabled (the batch fails), and counts any that happen anyway.
- eager ops that failed on the device and re-ran on the CPU: disabled the same way in
  every mode; the switch's value beside the fallback ops (the only count there is).
- `--speedups`: after the above, per shape, each candidate the parent planned (a
  speed-up spec and a batch size, `speedups`) on the same host: a shape key with the
  candidate's batch size and `BatchParams.speedup`, exactly as a worker applies them.
  Per batch size, full compute first (the fidelity reference), then each speed-up:
  one call whose images are saved, then `speedup_repeats` rounds over all of them,
  interleaved so a drift of the machine's speed is shared. An out-of-memory error in
  full compute stops the shape's larger batch sizes; any other failure is that
  candidate's, reported, never the run's.
- `--lora A,B`: the adapters' scaffold goes in before the model loads (so every call
  above runs as a worker serving them would: the scaffold's zeros in its graphs); after
  the revisit, at the first shape, the hot-swap check (worker/device/hotswap_check.py):
  per adapter a batch with it and one with only its scale changed, then back to none,
  each batch's graphs compiled and swap seconds.

The result is one JSON file; a failure writes an `error` there instead of a traceback.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from diffq.core.adapters import AdapterLayout
from diffq.core.contract import AdapterRef
from diffq.core.options import DEFAULTS
from diffq.worker.sink.store import as_image
from diffq.worker.delivery.spec import QUIET_ENV, QUIET_LOGGERS, ChildSpec

# Versions reported besides the backend's own packages (backends.py cache_packages).
PACKAGES = ("torch", "diffusers", "transformers")
RESULT = "result.json"


class SpeedupCall(BaseModel):
    """One speed-up candidate: its images are saved under its index."""

    model_config = ConfigDict(extra="forbid")

    index: int
    speedup: str | None  # canonical spec; None: full compute
    batch_size: int


class QualifySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    child: ChildSpec  # the worker's pinning, compile mode and cache, as `diffq worker` plans it
    model: str
    dtype: str
    shapes: list[tuple[int, int]]
    # Parity shapes not among `shapes` (a reduced shape for a slow reference).
    extra_parity_shapes: list[tuple[int, int]] = Field(default_factory=list)
    batch_size: int = 1
    steps: int = DEFAULTS.steps
    guidance_scale: float = DEFAULTS.guidance_scale
    max_sequence_length: int = DEFAULTS.max_sequence_length
    prompts: list[str]
    seeds: list[int]
    repeats: int = 5
    # False: a reference run, one call per shape, images only.
    measure: bool = True
    out_dir: str
    # --speedups: the candidates measured on every timed shape, in order (full compute
    # first at each batch size), on these prompts and seeds (as many as the largest batch).
    speedups: list[SpeedupCall] = Field(default_factory=list)
    speedup_prompts: list[str] = Field(default_factory=list)
    speedup_seeds: list[int] = Field(default_factory=list)
    speedup_repeats: int = 0
    # --lora: the adapters, checked and pinned by the parent, and their layout (the scaffold).
    lora: list[AdapterRef] = Field(default_factory=list)
    lora_layout: AdapterLayout | None = None


def image_path(out_dir: str | Path, height: int, width: int, index: int) -> Path:
    return Path(out_dir, "images", f"{height}x{width}", f"{index}.png")


def speedup_image_path(out_dir: str | Path, height: int, width: int, candidate: int, index: int) -> Path:
    return Path(out_dir, "speedups", f"{height}x{width}", f"c{candidate}", f"{index}.png")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: with few calls, an observed value, never an interpolation."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def versions(backend) -> dict[str, str | None]:
    found = {}
    for package in (*PACKAGES, *backend.cache_packages):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


class _Collected(logging.Handler):
    """Warning log records, kept alongside Python warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def _once(messages: list[str]) -> list[dict]:
    counts: dict[str, int] = {}
    for message in messages:
        counts[message] = counts.get(message, 0) + 1
    return [{"message": message, "count": count} for message, count in counts.items()]


def _call_or_none(dotted: str | None):
    """A backend-reported figure, or None where the backend (or this release) has none."""
    if not dotted:
        return None
    from diffq.worker.device.backends import resolve

    try:
        return resolve(dotted)()
    except Exception:  # noqa: BLE001 - an optional statistic must not fail qualification
        return None


def _save(images, spec: QualifySpec, height: int, width: int, candidate: int | None = None) -> None:
    for index, image in enumerate(images):
        path = (image_path(spec.out_dir, height, width, index) if candidate is None
                else speedup_image_path(spec.out_dir, height, width, candidate, index))
        path.parent.mkdir(parents=True, exist_ok=True)
        as_image(image).save(path, format="PNG")


class _Session:
    """One qualify child's pipeline host and the calls it makes, each counted as a worker
    would count it: graphs compiled around the call, degenerate images per shape."""

    def __init__(self, spec: QualifySpec):
        from diffq.core.contract import BatchItem
        from diffq.core.records import DEGENERATE_CHECKS
        from diffq.worker.device.pipeline_host import PipelineHost

        self.spec = spec
        self.backend = spec.child.backend  # read after the extension import: it may register itself
        self.host = PipelineHost(backend=self.backend, compile_mode=spec.child.compile,
                                 offload=spec.child.offload, checks=frozenset(DEGENERATE_CHECKS),
                                 lora_mode=spec.child.lora_mode)
        self.items = [BatchItem(id=f"q{i}", prompt=prompt, seed=seed)
                      for i, (prompt, seed) in enumerate(zip(spec.prompts, spec.seeds))]
        self.degenerate: dict[str, dict[str, int]] = {}  # shape label -> check -> images it found

    def load(self) -> float:
        """Load the model (and wrap it for compiling); returns the seconds it took."""
        started = time.perf_counter()
        self.host.set_shape_budget(len(self.spec.shapes) + len(self.spec.extra_parity_shapes))
        if self.spec.lora_layout is not None:  # the scaffold before the compile
            self.host.use_adapters(self.spec.model, self.spec.lora_layout)
        self.host.pipeline(self.spec.model, self.spec.dtype)
        return time.perf_counter() - started

    def key(self, height: int, width: int, batch_size: int | None = None):
        from diffq.core.contract import ShapeKey

        spec = self.spec
        return ShapeKey(model=spec.model, height=height, width=width, batch_size=batch_size or spec.batch_size,
                        max_sequence_length=spec.max_sequence_length, cfg=spec.guidance_scale > 1,
                        dtype=spec.dtype, lora=spec.lora_layout.label if spec.lora_layout else None)

    def call(self, height: int, width: int, steps: int):
        """One batch at HxW; returns it and the graphs compiled during the call."""
        from diffq.core.records import DEGENERATE_CHECKS

        generated, graphs = self.speedup_call(height, width, steps, self.spec.batch_size, None, self.items)
        counts = self.degenerate.setdefault(f"{height}x{width}", dict.fromkeys(DEGENERATE_CHECKS, 0))
        for kind in filter(None, generated.degenerate):
            counts[kind] += 1
        return generated, graphs

    def speedup_call(self, height: int, width: int, steps: int, batch_size: int, speedup: str | None, items):
        """One batch of `items` at HxW and `batch_size` with `speedup` (BatchParams.speedup,
        as a worker applies it); returns it and the graphs compiled during the call."""
        from diffq.core.contract import BatchParams
        from diffq.worker.device.pipeline_host import graphs_compiled

        before = graphs_compiled()
        generated = self.host.generate(self.key(height, width, batch_size), BatchParams(
            num_inference_steps=steps, guidance_scale=self.spec.guidance_scale, speedup=speedup), items)
        return generated, graphs_compiled() - before

    def release(self, quant: str | None) -> None:
        """Drop the pipeline quantized by `quant` (None: full precision), its memory freed
        for the next probe (PipelineHost.release)."""
        self.host.release(self.spec.model, self.spec.dtype, quant)

    def speedup_items(self, batch_size: int):
        from diffq.core.contract import BatchItem

        spec = self.spec
        return [BatchItem(id=f"s{i}", prompt=prompt, seed=seed)
                for i, (prompt, seed) in enumerate(zip(spec.speedup_prompts[:batch_size],
                                                       spec.speedup_seeds[:batch_size]))]


def measure(spec: QualifySpec) -> dict:
    """Everything the parent reports except parity; runs after `import torch`."""
    from diffq.worker.device import compile_cache

    cache = spec.child.cache
    with compile_cache.mirrored(cache) as sync:
        session = _Session(spec)
        load_s = session.load()
        # A reference run only generates images: its shapes are all parity shapes.
        timed, images_only = (spec.shapes, spec.extra_parity_shapes) if spec.measure else ([], spec.shapes)
        shapes = [_timed_shape(session, height, width) for height, width in timed]
        revisit = _revisit(session, shapes) if spec.measure else None
        lora = _lora(session) if spec.lora else None
        for height, width in images_only:
            generated, _ = session.call(height, width, spec.steps)
            _save(generated.images, spec, height, width)
        # The main measurement's memory, before larger speed-up batches raise the peak.
        memory = _memory(session.backend)
        tuned = ([{"shape": f"{h}x{w}", "height": h, "width": w, "candidates": measure_speedups(session, h, w)}
                  for h, w in timed] if spec.speedups else None)
    result = _report(session, load_s, shapes, revisit, compile_cache.report(cache, sync), memory)
    if tuned is not None:
        result["speedups"] = tuned
    if lora is not None:
        result["lora"] = lora
    return result


def _lora(session: _Session) -> dict:
    """`--lora`: the hot-swap check at the first timed shape, on the host that measured it."""
    from diffq.worker.device.hotswap_check import check_hotswap

    spec = session.spec
    height, width = spec.shapes[0]
    checked = check_hotswap(session.host, session.key(height, width), spec.lora, spec.lora_layout, steps=spec.steps,
                            guidance_scale=spec.guidance_scale, items=session.items)
    return {"shape": f"{height}x{width}", "batch_size": spec.batch_size, **checked.to_json()}


def out_of_memory(exc: BaseException) -> bool:
    """An allocation the device could not serve: torch's own error, or a vendor runtime's
    message (XLA's RESOURCE_EXHAUSTED)."""
    import torch

    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "resource_exhausted" in text


def _scheme(spec: str | None) -> str | None:
    """The quantization scheme a candidate's spec names (its own pipeline), or None."""
    from diffq.core.speedups import SpeedupError, parse

    try:
        parsed = parse(spec)
    except SpeedupError:
        return None
    return parsed.quant if parsed is not None else None


def measure_speedups(session, height: int, width: int, *, oom=out_of_memory) -> list[dict]:
    """Every planned candidate at HxW, in the spec's order; one entry each (by index).

    Per batch size: full compute, then each speed-up, one call each (images saved), then
    `speedup_repeats` interleaved rounds of timed calls. Full compute out of memory at a
    batch size: the caches (full compute's weights) are not measured there nor at any
    larger batch size (`out_of_memory`), but a quantization scheme's smaller weights may
    fit: with full compute's pipeline released, each scheme is probed alone (`alone`:
    its first call, its timed calls, then its pipeline released for the next), until it
    runs out of memory itself; the parent compares it with full compute at the largest
    batch size that fitted."""
    spec = session.spec
    groups: dict[int, list] = {}
    for call in spec.speedups:
        groups.setdefault(call.batch_size, []).append(call)
    found: dict[int, dict] = {}
    oom_at = None
    scheme_oom: dict[str, int] = {}  # a scheme probed alone -> the batch size it ran out of memory at
    for batch_size, calls in groups.items():
        entries = [found.setdefault(call.index, {"index": call.index, "speedup": call.speedup,
                                                 "batch_size": batch_size, "steady": []}) for call in calls]
        if oom_at is not None:
            _alone(session, height, width, batch_size, calls, entries, oom_at, scheme_oom, oom)
            continue
        items = session.speedup_items(batch_size)
        active = []
        for call, entry in zip(calls, entries):
            _reset_peak(session.backend)
            try:
                generated, graphs = session.speedup_call(height, width, spec.steps, batch_size, call.speedup, items)
            except Exception as exc:  # noqa: BLE001 - the candidate's failure, not the run's
                _failed(entry, exc, batch_size, oom)
                if call.speedup is None:  # no reference at this batch size: nothing to compare against
                    if "out_of_memory" in entry:
                        oom_at = batch_size  # and every larger batch size
                        session.release(None)  # its memory to the schemes' probes
                        active = []
                        _alone(session, height, width, batch_size, calls[1:], entries[1:], oom_at, scheme_oom, oom)
                    else:
                        for other in entries[1:]:
                            other["error"] = f"full compute failed at batch size {batch_size}"
                    break
                continue
            _record_first(session, entry, generated, graphs, height, width, call.index)
            active.append((call, entry))
        for _ in range(spec.speedup_repeats):
            for call, entry in active:
                _timed(session, call, entry, height, width, batch_size, items, oom)
    results = []
    for call in spec.speedups:
        entry = found[call.index]
        steady = entry.pop("steady")
        if steady and "error" not in entry and "out_of_memory" not in entry:
            median = statistics.median(steady)
            entry["steady_s"] = {"median": round(median, 6), "p90": round(percentile(steady, 90), 6),
                                 "calls": len(steady)}
            entry["seconds_per_image"] = round(median / call.batch_size, 6)
        results.append(entry)
    return results


def _record_first(session, entry: dict, generated, graphs: int, height: int, width: int, index: int) -> None:
    _save(generated.images, session.spec, height, width, index)
    entry.update(first_call_s=round(generated.generate_s, 6), first_call_graphs=graphs,
                 degenerate=sum(1 for kind in generated.degenerate if kind),
                 # A quant: scheme's stored weights; the device's peak over this first call
                 # (every pipeline the child holds included: full compute's stays loaded,
                 # unless it ran out of memory and the scheme is probed alone).
                 transformer_weight_bytes=generated.record_extra.get("transformer_weight_bytes"),
                 device_peak_bytes=_memory(session.backend)["device_peak_bytes"])


def _timed(session, call, entry: dict, height: int, width: int, batch_size: int, items, oom) -> None:
    if "error" in entry or "out_of_memory" in entry:
        return
    try:
        generated, graphs = session.speedup_call(height, width, session.spec.steps, batch_size, call.speedup, items)
    except Exception as exc:  # noqa: BLE001
        _failed(entry, exc, batch_size, oom)
        return
    entry["steady"].append(generated.generate_s)
    entry["steady_graphs"] = entry.get("steady_graphs", 0) + graphs


def _alone(session, height: int, width: int, batch_size: int, calls, entries, oom_at: int,
           scheme_oom: dict[str, int], oom) -> None:
    """At a batch size past full compute's memory: each quantization scheme's candidate
    by itself, its pipeline released after; the rest marked as full compute's."""
    items = None
    for call, entry in zip(calls, entries):
        scheme = _scheme(call.speedup)
        if scheme is None:
            entry.update(out_of_memory=oom_at, untried=True)
            continue
        entry["alone"] = True
        if scheme in scheme_oom:
            entry["out_of_memory"] = scheme_oom[scheme]
            continue
        items = items or session.speedup_items(batch_size)
        _reset_peak(session.backend)
        try:
            generated, graphs = session.speedup_call(height, width, session.spec.steps, batch_size, call.speedup,
                                                     items)
        except Exception as exc:  # noqa: BLE001 - the candidate's failure, not the run's
            _failed(entry, exc, batch_size, oom)
        else:
            _record_first(session, entry, generated, graphs, height, width, call.index)
            for _ in range(session.spec.speedup_repeats):
                _timed(session, call, entry, height, width, batch_size, items, oom)
        if "out_of_memory" in entry:
            scheme_oom[scheme] = batch_size
        session.release(scheme)


def _reset_peak(backend) -> None:
    """Start a candidate's peak device memory afresh, where the backend reports one."""
    if backend.peak_memory is None:
        return
    import torch

    try:
        torch.accelerator.reset_peak_memory_stats()
    except Exception:  # noqa: BLE001 - a backend without the statistic: its peak is since start
        pass


def _failed(entry: dict, exc: BaseException, batch_size: int, oom) -> None:
    if oom(exc):
        from diffq.worker.device.pipeline_host import free_device_memory

        entry["out_of_memory"] = batch_size
        free_device_memory()
    else:
        entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]


def _timed_shape(session: _Session, height: int, width: int) -> dict:
    """A shape's first call (its compile; images saved for parity), `repeats` timed calls,
    then one call with other steps, which must not compile."""
    spec = session.spec
    first, first_graphs = session.call(height, width, spec.steps)
    _save(first.images, spec, height, width)
    steady, steady_graphs = [], 0
    for _ in range(spec.repeats):
        generated, graphs = session.call(height, width, spec.steps)
        steady.append(generated.generate_s)
        steady_graphs += graphs
    _, changed = session.call(height, width, spec.steps - 1 if spec.steps > 1 else spec.steps + 1)
    median = statistics.median(steady)
    return {
        "shape": f"{height}x{width}",
        "height": height, "width": width, "batch_size": spec.batch_size,
        "first_call_s": round(first.generate_s, 4),
        "first_call_graphs": first_graphs,
        "steady_s": {"median": round(median, 6), "p90": round(percentile(steady, 90), 6), "calls": len(steady)},
        "recompiles": {"steady": steady_graphs, "steps_change": changed, "revisit": None},
        "images_per_s": round(spec.batch_size / median, 4) if median > 0 else None,
    }


def _revisit(session: _Session, shapes: list[dict]) -> int:
    """Back to every shape, now that later shapes compiled in between: nothing new."""
    for entry in shapes:
        _, entry["recompiles"]["revisit"] = session.call(entry["height"], entry["width"], session.spec.steps)
    return sum(entry["recompiles"]["revisit"] for entry in shapes)


def _memory(backend) -> dict:
    peak = _call_or_none(backend.peak_memory)
    return {"device_peak_bytes": int(peak) if peak is not None else None,
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _report(session: _Session, load_s: float, shapes: list[dict], revisit: int | None, cache: dict,
            memory: dict) -> dict:
    from diffq.worker.device.backends import device_count

    spec, host, backend = session.spec, session.host, session.backend
    for entry in shapes:
        entry["degenerate"] = session.degenerate[entry["shape"]]
    stats = host.compile_stats()
    return {
        "device": {"kind": backend.name, "torch_device": backend.torch_device, "count": device_count(backend),
                   "slot": spec.child.slot},
        "compile": {"mode": stats["mode"], "backend": stats["backend"],
                    "options": backend.compile_options if stats["backend"] else None,
                    "cache_env": backend.cache_env,
                    "cache_dir": os.environ.get(backend.cache_env) or cache["dir"],
                    "cache_remote": cache["remote"],
                    "cache_sync": {"pulled": cache["pulled"], "pushed": cache["pushed"]},
                    "cache_stats": {"inductor": stats["cache"],
                                    "backend": _json_safe(_call_or_none(backend.cache_stats))}},
        "versions": versions(backend),
        "load_s": round(load_s, 4),
        # The start phases a worker life records (worker/observe/startup.py) that qualify sees: an
        # object-storage model's fetch (bytes, seconds, MB/s, cache hit) within the load.
        "start": {"weights_fetch_s": round(sum(f["seconds"] for f in host.fetches), 4),
                  "load_s": round(load_s - sum(f["seconds"] for f in host.fetches), 4),
                  "fetches": host.fetches},
        "shapes": shapes,
        "recompiles": {"steps_change": sum(s["recompiles"]["steps_change"] for s in shapes) if spec.measure else None,
                       "revisit": revisit,
                       "steady": sum(s["recompiles"]["steady"] for s in shapes),
                       "new_shapes": {s["shape"]: s["first_call_graphs"] for s in shapes}},
        "fallback_ops": list(dict.fromkeys(host.fallback_ops())),
        # Every call's images, parity-only shapes included: shape label -> check -> images.
        "degenerate": session.degenerate,
        # Compiled graphs that failed on the device and re-ran uncompiled: none may, and
        # the table's switch says they must not (it is the worker's default too).
        "graph_fallback": ({"env": row.env, "value": os.environ.get(row.env),
                            "calls": sum(host.graph_fallbacks.values()), "per_shape": dict(host.graph_fallbacks)}
                           if (row := backend.graph_fallback) and stats["backend"] else None),
        # Eager ops re-run on the CPU: disabled as a worker's default; any that fell back
        # anyway are in fallback_ops (counted per op: backends.py, EagerFallback).
        "eager_fallback": ({"env": row.env, "value": os.environ.get(row.env)}
                           if (row := backend.eager_fallback) else None),
        "memory": memory,
    }


def _json_safe(value):
    return json.loads(json.dumps(value, default=str)) if value is not None else None


def main(spec_path: str) -> int:
    spec = QualifySpec.model_validate_json(Path(spec_path).read_text())
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.update(spec.child.env())
    collected = _Collected()
    logging.getLogger().addHandler(collected)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*superuser privileges.*")  # as a worker does
        try:
            import torch  # noqa: E402 - deliberately after pinning, as in a worker

            torch.set_num_threads(spec.child.threads)
            if spec.child.backend.extension:
                importlib.import_module(spec.child.backend.extension)
            result = measure(spec)
            code = 0
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a failed check
            traceback.print_exc(file=sys.stderr)  # the child's log, kept by the parent
            result = {"error": f"{type(exc).__name__}: {exc}"}
            code = 1
    result["warnings"] = _once([f"{w.category.__name__}: {w.message}" for w in caught] + collected.records)
    (out / (RESULT + ".tmp")).write_text(json.dumps(result))
    os.replace(out / (RESULT + ".tmp"), out / RESULT)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
