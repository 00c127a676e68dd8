"""`diffq qualify`: does this model run right, and how fast, on this device.

The parent never imports torch. It plans one pinned child exactly as `diffq worker`
would (supervisor.plan_children: backend table, env before `import torch`, compile
cache), runs worker/qualify.py in it, then the reference:

- `cpu` (default): the same pipeline, prompts and seeds in a child of the backend
  table's `REFERENCE` configuration (CPU, float32, eager, no offload). A
  shape over `reference_max_pixels` is compared at a reduced shape of the same
  aspect instead (the device generates that one too, after its measured shapes).
  When the device run already is that configuration, its own images are the
  reference and parity is skipped.
- a directory written by `--save-reference`: its prompts, seeds, shapes and
  generation settings are used, so today's environment can judge tomorrow's device.

Parity per image: PSNR (capped at 100 dB, which means identical) and the max
absolute pixel difference over RGB, against thresholds in `Thresholds`.

Every image the device makes goes through the worker's degenerate-image checks
(records.py DEGENERATE_CHECKS), counted per shape: one with non-finite values fails
the run check (a worker would fail that item under any policy but `ignore`), a
flat one warns.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from diffq.core.options import DEFAULTS
from diffq.core.records import DEGENERATE_CHECKS
from diffq.worker.backends import REFERENCE, RunConfig, get_backend

REFERENCE_FILE = "reference.json"
PSNR_CAP = 100.0
DEFAULT_SHAPE = (1024, 1024)
# What is generated when neither an option nor a saved reference says otherwise.
# The run's defaults (core/options.py), but one image per call: qualify measures a call.
GENERATION_DEFAULTS = {"batch_size": 1, "steps": DEFAULTS.steps, "guidance_scale": DEFAULTS.guidance_scale,
                       "max_sequence_length": DEFAULTS.max_sequence_length}
DEFAULT_REPEATS = 5
# Above this many pixels the CPU reference (and parity) runs at a reduced shape.
REFERENCE_MAX_PIXELS = 512 * 512
DEFAULT_PROMPTS = (
    "a red fox in fresh snow, morning light",
    "a lighthouse on a cliff at dusk, long exposure",
    "a bowl of ramen on a wooden table, top view",
    "an isometric city block at night, neon signs",
)


class QualifyError(ValueError):
    """Bad input, found before any child starts."""


@dataclass(frozen=True)
class Thresholds:
    # Below min_psnr or above max_abs_diff fails; within warn_margin_db of min_psnr warns.
    min_psnr: float = 25.0
    max_abs_diff: int = 200
    warn_margin_db: float = 10.0


@dataclass
class Settings:
    """What makes two runs comparable: stored with a saved reference."""

    model: str
    prompts: list[str]
    seeds: list[int]
    shapes: list[tuple[int, int]]
    parity_shapes: list[tuple[int, int]]
    batch_size: int
    steps: int
    guidance_scale: float
    max_sequence_length: int


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    shapes = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        height, sep, width = entry.partition("x")
        if not sep or not height.isdigit() or not width.isdigit():
            raise QualifyError(f"--shapes entry '{entry}' is not HxW (e.g. 1024x1024)")
        shape = (int(height), int(width))
        if shape[0] % 16 or shape[1] % 16 or 0 in shape:
            raise QualifyError(f"--shapes entry '{entry}': height and width must be positive multiples of 16")
        if shape not in shapes:
            shapes.append(shape)
    if not shapes:
        raise QualifyError("--shapes names no shape")
    return shapes


def label(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def reduced(shape: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    """The largest multiple-of-16 shape of the same aspect within max_pixels."""
    height, width = shape
    if height * width <= max_pixels:
        return shape
    scale = math.sqrt(max_pixels / (height * width))
    return (max(16, int(height * scale) // 16 * 16), max(16, int(width * scale) // 16 * 16))


def read_prompt_file(path: Path, count: int) -> tuple[list[str], list[int]]:
    """The first `count` rows (repeated if fewer); a row's seed is kept, else its index."""
    from diffq.producer.sources import InputError, read_prompts

    rows = []
    try:
        for row in read_prompts(path):
            rows.append(row)
            if len(rows) == count:
                break
    except InputError as exc:
        raise QualifyError(str(exc)) from None
    if not rows:
        raise QualifyError(f"{path}: no prompts")
    rows = [rows[i % len(rows)] for i in range(count)]
    return [r.prompt for r in rows], [r.seed if r.seed is not None else i for i, r in enumerate(rows)]


def load_reference(directory: Path) -> Settings:
    path = directory / REFERENCE_FILE
    if not path.is_file():
        raise QualifyError(f"--reference {directory}: no {REFERENCE_FILE} (write one with --save-reference)")
    try:
        raw = json.loads(path.read_text())["settings"]
        settings = Settings(**{**raw, "shapes": [tuple(s) for s in raw["shapes"]],
                               "parity_shapes": [tuple(s) for s in raw["parity_shapes"]]})
    except (ValueError, KeyError, TypeError) as exc:
        raise QualifyError(f"{path}: not a diffq reference ({exc})") from None
    for shape in settings.parity_shapes:
        for index in range(settings.batch_size):
            if not image_file(directory, shape, index).is_file():
                raise QualifyError(f"--reference {directory}: image {image_file(directory, shape, index)} is missing")
    return settings


def image_file(root: str | Path, shape: tuple[int, int], index: int) -> Path:
    from diffq.worker.qualify import image_path

    return image_path(root, shape[0], shape[1], index)


# --- children -----------------------------------------------------------------------


def _run_child(name: str, spec, workdir: Path, timeout: float | None) -> dict:
    """Run worker/qualify.py in a fresh interpreter; its output and log stay in workdir."""
    out = Path(spec.out_dir)
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(spec.model_dump_json())
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run([sys.executable, "-m", "diffq.worker.qualify", str(spec_path)],
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the {name} run took longer than {timeout:g} s"}
    result_path = out / "result.json"
    if not result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"the {name} process exited with code {proc.returncode} before reporting: {tail[0]}"}
    return json.loads(result_path.read_text())


def _child_spec(config: RunConfig, *, slot: int, threads: int, compile_cache: str | None, settings: Settings,
                measure: bool, extra: list[tuple[int, int]], repeats: int, out_dir: Path):
    from diffq.worker.qualify import QualifySpec
    from diffq.worker.supervisor import plan_children

    # The same plan `diffq worker` makes for this device, minus the queues it would serve.
    (child,) = plan_children(device=config.device, devices=[slot], broker_url="memory://", queues=[],
                             name_prefix="diffq-qualify", threads=threads, compile=config.compile,
                             compile_cache=compile_cache, offload=config.offload, models=[settings.model],
                             dtype=config.dtype)
    return QualifySpec(child=child, model=settings.model, dtype=config.dtype,
                       shapes=settings.shapes if measure else settings.parity_shapes,
                       extra_parity_shapes=extra, batch_size=settings.batch_size, steps=settings.steps,
                       guidance_scale=settings.guidance_scale,
                       max_sequence_length=settings.max_sequence_length, prompts=settings.prompts,
                       seeds=settings.seeds, repeats=repeats, measure=measure, out_dir=str(out_dir))


# --- parity -------------------------------------------------------------------------


def _pixels(path: Path):
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float64)


def compare(device_path: Path, reference_path: Path) -> dict:
    import numpy as np

    a, b = _pixels(device_path), _pixels(reference_path)
    if a.shape != b.shape:
        return {"psnr_db": 0.0, "max_abs_diff": 255, "error": f"sizes differ: {a.shape[:2]} vs {b.shape[:2]}"}
    mse = float(np.mean((a - b) ** 2))
    psnr = PSNR_CAP if mse == 0 else min(PSNR_CAP, 10 * math.log10(255.0 ** 2 / mse))
    return {"psnr_db": round(psnr, 3), "max_abs_diff": int(np.max(np.abs(a - b)))}


def parity(settings: Settings, device_dir: Path, reference_dir: Path | None, reference: str,
           thresholds: Thresholds, error: str | None = None) -> dict:
    result = {"reference": reference, "thresholds": asdict(thresholds), "shapes": [],
              "psnr_db_min": None, "max_abs_diff": None, "passed": False}
    if error or reference_dir is None:
        result.update(error=error, passed=error is None, skipped=error is None)
        return result
    for shape in settings.parity_shapes:
        images = [compare(image_file(device_dir, shape, i), image_file(reference_dir, shape, i))
                  for i in range(settings.batch_size)]
        result["shapes"].append({"shape": label(shape), "images": images,
                                 "psnr_db_min": min(i["psnr_db"] for i in images),
                                 "max_abs_diff": max(i["max_abs_diff"] for i in images)})
    result["psnr_db_min"] = min(s["psnr_db_min"] for s in result["shapes"])
    result["max_abs_diff"] = max(s["max_abs_diff"] for s in result["shapes"])
    result["passed"] = (result["psnr_db_min"] >= thresholds.min_psnr
                        and result["max_abs_diff"] <= thresholds.max_abs_diff)
    return result


# --- verdict ------------------------------------------------------------------------


def checks(report: dict, thresholds: Thresholds) -> dict[str, dict]:
    found: dict[str, dict] = {}
    if report.get("error"):
        found["run"] = {"status": "fail", "detail": report["error"]}
        return found
    found["run"] = _run_check(report)
    ops = report["fallback_ops"]
    found["fallback_ops"] = ({"status": "warn", "detail": f"{len(ops)} op(s) ran on CPU: {', '.join(ops)}"}
                             if ops else {"status": "pass", "detail": "none reported"})
    if graph := report.get("graph_fallback"):
        # A compiled graph that re-ran uncompiled would make every timing here a lie.
        switch = f"{graph['env']}={graph['value']}"
        found["graph_fallback"] = (
            {"status": "fail", "detail": f"{graph['calls']} compiled-graph call(s) failed on the device and re-ran "
                                         f"uncompiled, op by op ({switch})"}
            if graph["calls"] else {"status": "pass", "detail": f"no compiled graph re-ran uncompiled ({switch})"})
    rc = report["recompiles"]
    extra = {name: n for name, n in (("steps_change", rc["steps_change"]), ("revisit", rc["revisit"]),
                                     ("steady", rc["steady"])) if n}
    idle = [shape for shape, graphs in rc["new_shapes"].items() if not graphs]
    if extra:
        found["recompiles"] = {"status": "fail", "detail": "graphs compiled where none should: "
                               + ", ".join(f"{k} {v}" for k, v in extra.items())}
    elif report["compile"]["backend"] and idle:
        found["recompiles"] = {"status": "warn", "detail": f"no graph compiled for new shape(s) {', '.join(idle)}"}
    else:
        found["recompiles"] = {"status": "pass", "detail": "steps change 0, revisit 0, "
                               + ("each new shape compiled once" if report["compile"]["backend"]
                                  else "eager: torch.compile not used")}
    p = report["parity"]
    if p.get("error"):
        found["parity"] = {"status": "fail", "detail": p["error"]}
    elif p.get("skipped"):
        found["parity"] = {"status": "skip", "detail": f"the device run is the reference configuration ({REFERENCE})"}
    else:
        detail = f"PSNR min {p['psnr_db_min']:.1f} dB, max abs diff {p['max_abs_diff']} vs {p['reference']}"
        status = ("fail" if not p["passed"] else
                  "warn" if p["psnr_db_min"] < thresholds.min_psnr + thresholds.warn_margin_db else "pass")
        found["parity"] = {"status": status, "detail": detail}
    return found


def _run_check(report: dict) -> dict:
    """Generated; failed where any image had non-finite values, warned where any was flat."""
    generated = f"{len(report['shapes'])} shape(s) generated"
    found = {kind: {shape: counts[kind] for shape, counts in (report.get("degenerate") or {}).items() if counts[kind]}
             for kind in DEGENERATE_CHECKS}
    for kind, status in (("nonfinite", "fail"), ("flat", "warn")):
        if found[kind]:
            per_shape = ", ".join(f"{n} at {shape}" for shape, n in found[kind].items())
            return {"status": status, "detail": f"{generated}; {sum(found[kind].values())} image(s) with "
                                                f"{DEGENERATE_CHECKS[kind]}: {per_shape}"}
    return {"status": "pass", "detail": f"{generated}, no degenerate image"}


def _throughput(shapes: list[dict], price: float | None) -> None:
    for shape in shapes:
        per_s = shape["images_per_s"]
        shape["images_per_device_hour"] = round(per_s * 3600, 1) if per_s else None
        shape["cost_per_1000_images"] = (round(price / (per_s * 3600) * 1000, 6)
                                         if price is not None and per_s else None)


# --- the command --------------------------------------------------------------------


def qualify(model: str, *, device: str = "cpu", slot: int = 0, compile: str = "none", dtype: str | None = None,
            offload: str | None = None, shapes: list[tuple[int, int]] | None = None,
            batch_size: int | None = None, steps: int | None = None, guidance_scale: float | None = None,
            max_sequence_length: int | None = None, prompts_file: Path | None = None,
            reference: str = "cpu", save_reference: Path | None = None, report_dir: Path | None = None,
            price_per_device_hour: float | None = None, thresholds: Thresholds = Thresholds(),
            threads: int = 1, compile_cache: str | None = None, repeats: int = DEFAULT_REPEATS,
            reference_max_pixels: int = REFERENCE_MAX_PIXELS, timeout: float | None = None) -> dict:
    """Run the qualification and return the report (the `--json` object)."""
    from diffq.worker.models import ModelUnavailable, resolve_model

    backend = get_backend(device)
    dtype = backend.dtype_for(dtype or "auto")  # what an auto queue runs at on this device
    if compile not in backend.compile_modes:
        raise QualifyError(f"--compile {compile} is not a mode of {device} (it has {', '.join(backend.compile_modes)})")
    if offload == "model" and compile == "full":
        raise QualifyError("--offload model cannot be combined with --compile full: offload hooks cannot be "
                           "traced; use --compile regional")
    try:
        resolve_model(model)
    except ModelUnavailable as exc:
        raise QualifyError(str(exc)) from None
    settings = _settings(model, reference, shapes, batch_size, steps, guidance_scale, max_sequence_length,
                         prompts_file, reference_max_pixels)
    config = RunConfig(device=device, dtype=dtype, compile=compile, offload=offload)
    self_reference = reference == "cpu" and config == REFERENCE
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="diffq-qualify-") as tmp:
        work = Path(tmp)
        device_dir, reference_dir = work / "device", work / "reference"
        extra = [s for s in settings.parity_shapes if s not in settings.shapes]
        spec = _child_spec(config, slot=slot, threads=threads, compile_cache=compile_cache, settings=settings,
                           measure=True, extra=extra, repeats=repeats, out_dir=device_dir)
        result = _run_child("device", spec, work, timeout)
        ref_error = None
        if result.get("error"):
            ref_dir = None
            ref_error = "no device images to compare"
        elif reference != "cpu":
            ref_dir = Path(reference)
        elif self_reference:
            ref_dir = None
        else:
            # A CPU reference gets the host's cores: it is not what is being timed.
            ref_spec = _child_spec(REFERENCE, slot=0, threads=os.cpu_count() or 1, compile_cache=None,
                                   settings=settings, measure=False, extra=[], repeats=0, out_dir=reference_dir)
            ref_result = _run_child("reference", ref_spec, work, timeout)
            ref_dir = reference_dir
            if ref_result.get("error"):
                ref_error = f"the CPU reference failed: {ref_result['error']}"
        report = _report(result, settings, device, dtype, price_per_device_hour)
        report["parity"] = parity(settings, device_dir, ref_dir, reference, thresholds, ref_error)
        report["checks"] = checks(report, thresholds)
        report["passed"] = all(c["status"] != "fail" for c in report["checks"].values())
        report["wall_s"] = round(time.time() - started, 3)
        if save_reference and not result.get("error"):
            _save_reference(save_reference, settings, device_dir, report)
        if report_dir:
            write_report(report_dir, report, settings, device_dir, ref_dir or (device_dir if self_reference else None))
            for log in work.glob("*.log"):
                shutil.copy(log, Path(report_dir) / log.name)
    return report


def _settings(model, reference, shapes, batch_size, steps, guidance_scale, max_sequence_length,
              prompts_file, reference_max_pixels) -> Settings:
    if reference != "cpu":
        saved = load_reference(Path(reference))
        for option, value, kept in (("--shapes", shapes, saved.shapes), ("--batch-size", batch_size, saved.batch_size),
                                    ("--steps", steps, saved.steps), ("--guidance-scale", guidance_scale, saved.guidance_scale),
                                    ("--max-sequence-length", max_sequence_length, saved.max_sequence_length)):
            if value is not None and value != kept:
                raise QualifyError(f"{option} {value} differs from the reference's {kept} ({reference}/{REFERENCE_FILE}); "
                                   f"leave it out to use the reference's")
        if prompts_file is not None:
            raise QualifyError(f"--prompts cannot be combined with --reference {reference}: it holds its own prompts")
        saved.model = model  # the pipeline under test; the reference says only what to generate
        return saved
    shapes = shapes or [DEFAULT_SHAPE]
    given = {"batch_size": batch_size, "steps": steps, "guidance_scale": guidance_scale,
             "max_sequence_length": max_sequence_length}
    chosen = {name: GENERATION_DEFAULTS[name] if value is None else value for name, value in given.items()}
    batch_size = chosen["batch_size"]
    if prompts_file is not None:
        prompts, seeds = read_prompt_file(prompts_file, batch_size)
    else:
        prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(batch_size)]
        seeds = list(range(batch_size))
    parity_shapes = []
    for shape in shapes:
        small = reduced(shape, reference_max_pixels)
        if small not in parity_shapes:
            parity_shapes.append(small)
    return Settings(model=model, prompts=prompts, seeds=seeds, shapes=shapes, parity_shapes=parity_shapes, **chosen)


def _report(result: dict, settings: Settings, device: str, dtype: str, price: float | None) -> dict:
    report = {"model": settings.model, "dtype": dtype, "batch_size": settings.batch_size, "steps": settings.steps,
              "prompts": settings.prompts, "seeds": settings.seeds,
              "parity_shapes": [label(s) for s in settings.parity_shapes]}
    if result.get("error"):
        report.update(device={"kind": device}, compile=None, versions=None, fallback_ops=[], graph_fallback=None,
                      shapes=[], recompiles=None, memory=None, degenerate=None, error=result["error"],
                      warnings=result.get("warnings", []))
        return report
    report.update(result)
    _throughput(report["shapes"], price)
    report["price_per_device_hour"] = price
    return report


def _save_reference(directory: Path, settings: Settings, device_dir: Path, report: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for shape in settings.parity_shapes:
        for index in range(settings.batch_size):
            target = image_file(directory, shape, index)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(image_file(device_dir, shape, index), target)
    made_with = {"device": report["device"], "dtype": report["dtype"], "compile": report["compile"]["mode"],
                 "versions": report["versions"], "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    data = {"settings": asdict(settings), "made_with": made_with}
    (directory / REFERENCE_FILE).write_text(json.dumps(data, indent=2) + "\n")


# --- output -------------------------------------------------------------------------


def render_text(report: dict) -> str:
    lines = []
    d = report["device"]
    lines.append(f"device {d['kind']}" + (f" (slot {d['slot']}, {d['count']} visible)" if "count" in d else "")
                 + f", dtype {report['dtype']}, model {report['model']}")
    if report.get("compile"):
        c = report["compile"]
        lines.append(f"compile {c['mode']}" + (f" (backend {c['backend']})" if c["backend"] else "")
                     + f", cache {c['cache_dir'] or 'backend default'}")
        lines.append("versions " + ", ".join(f"{k} {v or '-'}" for k, v in report["versions"].items()))
    for s in report["shapes"]:
        cost = f", {s['cost_per_1000_images']:.4f} per 1,000 images" if s.get("cost_per_1000_images") is not None else ""
        lines.append(f"shape {s['shape']} b{s['batch_size']}: first call {s['first_call_s']:.2f} s "
                     f"({s['first_call_graphs']} graphs), steady median {s['steady_s']['median']:.3f} s "
                     f"p90 {s['steady_s']['p90']:.3f} s, {s['images_per_s']:.2f} images/s, "
                     f"{s['images_per_device_hour']:,.0f} images/device-hour{cost}"
                     + (f", degenerate images: {found}" if (found := _degenerate_found(s.get("degenerate"))) else ""))
    if report.get("recompiles"):
        r = report["recompiles"]
        lines.append(f"recompiles: steps change {r['steps_change']}, revisit {r['revisit']}, steady {r['steady']}")
    if not report.get("error"):
        lines.append("fallback ops: " + (", ".join(report["fallback_ops"]) or "none"))
    if graph := report.get("graph_fallback"):
        lines.append(f"compiled graphs re-run uncompiled: {graph['calls']} ({graph['env']}={graph['value']})")
    for w in report.get("warnings", []):
        lines.append(f"warning ({w['count']}x): {w['message'][:300]}")
    if report.get("memory"):
        m = report["memory"]
        dev = f"{m['device_peak_bytes'] / 2**30:.2f} GiB" if m["device_peak_bytes"] is not None else "not reported"
        lines.append(f"memory: device peak {dev}, host peak RSS {m['host_peak_rss_bytes'] / 2**30:.2f} GiB")
    p = report["parity"]
    for s in p["shapes"]:
        lines.append(f"parity {s['shape']}: PSNR min {s['psnr_db_min']:.1f} dB, max abs diff {s['max_abs_diff']}")
    for name, check in report["checks"].items():
        lines.append(f"{check['status'].upper():5} {name}: {check['detail']}")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


def _degenerate_found(counts: dict | None) -> str:
    """A shape's degenerate images per check, e.g. "1 nonfinite"; empty for none."""
    return ", ".join(f"{n} {kind}" for kind, n in (counts or {}).items() if n)


def _png(array) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def heatmap(device_path: Path, reference_path: Path) -> tuple[bytes, int]:
    """|device − reference| per pixel (max over RGB), colour-mapped over 0..the max seen (returned)."""
    import matplotlib
    import numpy as np

    a, b = _pixels(device_path), _pixels(reference_path)
    if a.shape != b.shape:
        return _png(np.zeros((16, 16, 3), dtype=np.uint8)), 255
    diff = np.max(np.abs(a - b), axis=2)
    peak = int(diff.max())
    scaled = diff / max(1, peak)
    return _png((matplotlib.colormaps["inferno"](scaled)[:, :, :3] * 255).astype(np.uint8)), peak


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" title="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(report: dict, settings: Settings, device_dir: Path, reference_dir: Path | None) -> str:
    from diffq.results.report import _table

    status_colour = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e", "skip": "#57606a"}
    checks_rows = "".join(
        f'<tr><td>{html.escape(name)}</td><td style="color:{status_colour[c["status"]]};font-weight:600">'
        f'{c["status"]}</td><td>{html.escape(c["detail"])}</td></tr>' for name, c in report["checks"].items())
    env_rows = [["device", json.dumps(report["device"])], ["dtype", report["dtype"]], ["model", report["model"]]]
    if report.get("compile"):
        env_rows += [["compile", json.dumps(report["compile"])]]
        env_rows += [[k, v or "-"] for k, v in report["versions"].items()]
    if report.get("memory"):
        m = report["memory"]
        env_rows += [["device peak memory", m["device_peak_bytes"] if m["device_peak_bytes"] is not None else "not reported"],
                     ["host peak RSS", f"{m['host_peak_rss_bytes'] / 2**20:.0f} MiB"]]
    shapes = _table(["shape", "batch", "first call s", "graphs", "steady median s", "steady p90 s", "images/s",
                     "images/device-hour", "cost / 1,000", "degenerate images"],
                    [[s["shape"], s["batch_size"], f"{s['first_call_s']:.3f}", s["first_call_graphs"],
                      f"{s['steady_s']['median']:.4f}", f"{s['steady_s']['p90']:.4f}", f"{s['images_per_s']:.3f}",
                      f"{s['images_per_device_hour']:,.0f}",
                      "-" if s.get("cost_per_1000_images") is None else f"{s['cost_per_1000_images']:.4f}",
                      _degenerate_found(s.get("degenerate")) or "none"]
                     for s in report["shapes"]])
    recompiles = _table(["shape", "first call", "steady calls", "steps change", "revisit"],
                        [[s["shape"], s["first_call_graphs"], s["recompiles"]["steady"],
                          s["recompiles"]["steps_change"], s["recompiles"]["revisit"]]
                         for s in report["shapes"]]) if report["shapes"] else "<p>not measured</p>"
    fallback = _table(None, [[op] for op in report["fallback_ops"]]) if report["fallback_ops"] else "<p>none</p>"
    warns = (_table(["count", "warning"], [[w["count"], w["message"][:500]] for w in report.get("warnings", [])])
             if report.get("warnings") else "<p>none</p>")
    p = report["parity"]
    parity_rows = _table(["shape", "image", "PSNR dB", "max abs diff"],
                         [[s["shape"], i, im["psnr_db"], im["max_abs_diff"]]
                          for s in p["shapes"] for i, im in enumerate(s["images"])]) if p["shapes"] else ""
    galleries = []
    if reference_dir is not None and not report.get("error"):
        for shape in settings.parity_shapes:
            cells = []
            for index in range(settings.batch_size):
                dev, ref = image_file(device_dir, shape, index), image_file(reference_dir, shape, index)
                diff, peak = heatmap(dev, ref)
                cells.append("<div class=row>" + "".join(
                    f"<figure>{_img(png, caption)}<figcaption>{html.escape(caption)}</figcaption></figure>"
                    for png, caption in ((dev.read_bytes(), f"device, item {index} (seed {settings.seeds[index]})"),
                                         (ref.read_bytes(), "reference"),
                                         (diff, f"|difference|, black 0 to yellow {peak}"))) + "</div>")
            galleries.append(f"<h3>{label(shape)}</h3>" + "".join(cells))
    verdict = "passed" if report["passed"] else "FAILED"
    title = html.escape(f"diffq qualify {report['device']['kind']}: {verdict}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title><style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 980px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 24px; }} h3 {{ font-size: 14px; }}
table {{ border-collapse: collapse; margin: 8px 0; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; font-size: 13px; }}
th {{ background: #f3f3f3; }} img {{ max-width: 100%; }}
.row {{ display: flex; gap: 8px; }} .row img {{ width: 100%; image-rendering: pixelated; }} figure {{ margin: 0; flex: 1; }} figcaption {{ font-size: 12px; color: #555; }}
</style></head><body>
<h1>{title}</h1>
<h2>Checks</h2><table><tr><th>check</th><th>verdict</th><th>detail</th></tr>{checks_rows}</table>
<h2>Environment</h2>{_table(None, env_rows)}
<h2>Compile vs steady state</h2>{shapes}
<h2>Graphs compiled (recompile checks)</h2>{recompiles}
<h2>Fallback ops</h2>{fallback}
<h2>Warnings</h2>{warns}
<h2>Parity against {html.escape(str(p['reference']))}</h2>{parity_rows}
{''.join(galleries)}
</body></html>
"""


def write_report(directory: Path, report: dict, settings: Settings, device_dir: Path,
                 reference_dir: Path | None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    page = directory / "index.html"
    page.write_text(render_html(report, settings, device_dir, reference_dir))
    (directory / "qualify.json").write_text(json.dumps(report, indent=2) + "\n")
    return page
