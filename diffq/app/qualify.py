"""`diffq qualify`: does this model run right, and how fast, on this device.

The parent never imports torch. It plans one pinned child exactly as `diffq worker`
would (supervisor.plan_children: backend table, env before `import torch`, compile
cache), runs worker/process/qualify.py in it, then the reference:

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

`--speedups`: per shape, the candidates planned from the tables (core/speedups.py
CACHES, each offered cache at two or three settings; the attention backends worth
trying on the device; batch sizes 1, 2, 4, ... up to --max-batch-size), each filtered
by worker/device/speedups.py `refusal` for this device, compile mode and family, capped at
--max-candidates and said (with the compiles they cost) before the child starts. The
same child measures them; here each is compared with full compute at its batch size
on the same prompts and seeds (PSNR and SSIM per image), judged against the budget,
and the fastest within it is each shape's choice in the profile (core/profile.py).

`--lora A,B [--lora-mode M]`: `auto` resolved as a worker would (the backend table's
`lora` column, or the profile given); refused where the LoRA mode table says the mode
cannot serve this device and compile mode (worker/device/lora_modes.py `refusal`);
each adapter checked and pinned here as submit checks a row's (core/adapters.py
`RunAdapters`), before any child starts. The device child installs the mode (swap: the
scaffold of their layout before compiling) and, after its measurement, puts each adapter
in, changes its scale alone, and goes back to none, one batch each
(worker/device/hotswap_check.py): a graph compiled by those batches (under compile: by
going back to a set already served) fails the `lora` check, and so does the host's change
check (its probe did not move at the first change: the mode's writes are not read).
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from diffq.core.adapters import AdapterError, AdapterLayout, RunAdapters
from diffq.core.contract import AdapterRef
from diffq.core.options import DEFAULTS
from diffq.core.records import DEGENERATE_CHECKS
from diffq.worker.api import COMPILING_MODES, QUALIFY_MAIN, REFERENCE, RunConfig, get_backend, lora_modes

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
    from diffq.worker.api import image_path

    return image_path(root, shape[0], shape[1], index)


# --- children -----------------------------------------------------------------------


def _run_child(name: str, spec, workdir: Path, timeout: float | None) -> dict:
    """Run worker/process/qualify.py in a fresh interpreter; its output and log stay in workdir."""
    out = Path(spec.out_dir)
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(spec.model_dump_json())
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        try:
            # -P: see worker/sink/helper.py
            proc = subprocess.run([sys.executable, "-P", "-m", QUALIFY_MAIN, str(spec_path)],
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the {name} run took longer than {timeout:g} s"}
    result_path = out / "result.json"
    if not result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"the {name} process exited with code {proc.returncode} before reporting: {tail[0]}"}
    return json.loads(result_path.read_text())


def _child_spec(config: RunConfig, *, slot: int, threads: int, compile_cache: str | None, settings: Settings,
                measure: bool, extra: list[tuple[int, int]], repeats: int, out_dir: Path, tuning: dict | None = None,
                lora: LoraPlan | None = None):
    from diffq.worker.api import QualifySpec
    from diffq.worker.api import plan_children

    # The same plan `diffq worker` makes for this device, minus the queues it would serve.
    (child,) = plan_children(device=config.device, devices=[slot], broker_url="memory://", queues=[],
                             name_prefix="diffq-qualify", threads=threads, compile=config.compile,
                             compile_cache=compile_cache, offload=config.offload, models=[settings.model],
                             dtype=config.dtype, **({"lora_mode": lora.mode} if lora else {}))
    return QualifySpec(child=child, model=settings.model, dtype=config.dtype,
                       shapes=settings.shapes if measure else settings.parity_shapes,
                       extra_parity_shapes=extra, batch_size=settings.batch_size, steps=settings.steps,
                       guidance_scale=settings.guidance_scale,
                       max_sequence_length=settings.max_sequence_length, prompts=settings.prompts,
                       seeds=settings.seeds, repeats=repeats, measure=measure, out_dir=str(out_dir),
                       **({"speedups": tuning["measure"], "speedup_prompts": tuning["prompts"],
                           "speedup_seeds": tuning["seeds"], "speedup_repeats": repeats} if tuning else {}),
                       **({"lora": lora.refs, "lora_layout": lora.layout} if lora else {}))


# --- LoRA hot-swap (--lora) ------------------------------------------------------------


@dataclass(frozen=True)
class LoraPlan:
    refs: list[AdapterRef]  # pinned
    layout: AdapterLayout
    mode: str = lora_modes.DEFAULT_LORA_MODE


def plan_lora(backend, compile_mode: str, model: str, specs: list[str],
              mode: str = lora_modes.DEFAULT_LORA_MODE, text_encoder: str | None = None) -> LoraPlan:
    """The adapters of `--lora`, each checked and pinned as submit checks a row's (the
    allow-list, its header, the fit to the model's transformer), and their layout, under
    `mode` resolved (auto: as a worker resolves it); refused where lora_modes.refusal says."""
    from diffq.core.settings import get_settings

    mode = lora_modes.resolve(backend, compile_mode, mode)[0]
    if reason := lora_modes.refusal(backend, compile_mode, mode):
        raise QualifyError(f"--lora refused: {reason}")
    if not specs:
        raise QualifyError("--lora names no adapter")
    run = RunAdapters(model, allowed_prefixes=get_settings().allowed_adapters, text_encoder=text_encoder)
    refs = []
    for index, spec in enumerate(specs):
        try:
            (ref,) = run.add(spec, f"lora[{index}]")
        except AdapterError as exc:
            raise QualifyError(f"--lora {spec}: {exc.message}") from None
        if any(ref.path == seen.path for seen in refs):
            raise QualifyError(f"--lora {spec}: names {ref.path} twice")
        refs.append(ref)
    return LoraPlan(refs=refs, layout=run.layout, mode=mode)


def write_lora_profile(path: Path, report: dict, model: str, backend, compile_mode: str) -> str:
    """Add this run's LoRA mode, as measured, to the LoRA profile at `path` (made if
    absent; one measured on another device, generation, compile mode, model or versions is
    replaced): what `--lora-mode FILE.json` resolves `auto` through (core/profile.py LoraProfile)."""
    from diffq.core.profile import LoraMeasure, LoraProfile

    found = report["lora"]
    # What `resolve` matches it against: this device's generation (where the backend table
    # detects it), the compile mode, the model and these versions.
    fresh = LoraProfile(model=model, device=backend.name, generation=lora_modes.generation_here(backend),
                        compile=compile_mode, versions=lora_modes.installed_versions(backend))
    profile = LoraProfile.load(path) if Path(path).is_file() else fresh
    if (profile.model, profile.device, profile.generation, profile.compile, profile.versions) != (
            fresh.model, fresh.device, fresh.generation, fresh.compile, fresh.versions):
        profile = fresh
    profile = profile.with_measure(LoraMeasure(
        mode=found["lora_mode"], ok=report["checks"]["lora"]["status"] == "pass",
        s_per_image_with=found.get("s_per_image_with"), s_per_image_without=found.get("s_per_image_without"),
        change_s=(found.get("swap_s") or {}).get("median"), refused=found.get("refused")))
    profile.dump(path)
    return str(path)


def lora_check(found: dict) -> dict:
    """Pass when no batch after the first compiled a graph and every change showed in its
    images; the swap times said."""
    mode = found.get("lora_mode", "swap")
    said = (f"{len(found['adapters'])} adapter(s), --lora-mode {mode}, rank {found['rank']} over {found['targets']} "
            f"module(s) at {found['shape']}: ")
    troubles = [f"change check: {found['refused']}"] if found.get("refused") else []
    if found.get("recompiled"):
        troubles.append("graphs compiled after the first batch: " + ", ".join(found["recompiled"]))
    troubles += [f"not seen in the images: {why}" for why in found["unseen"]]
    if troubles:
        return {"status": "fail", "detail": said + "; ".join(troubles)}
    graphs = sum(swap["graphs_compiled"] for swap in found["swaps"])
    return {"status": "pass", "detail": said + f"{graphs} graphs compiled over {len(found['swaps'])} change(s); "
            f"change median {found['swap_s']['median']:.4f} s, scale change median "
            f"{found['scale_change_s']['median']:.4f} s"}


def lora_lines(found: dict) -> list[str]:
    lines = [f"lora {found['shape']} b{found['batch_size']}: --lora-mode {found.get('lora_mode', 'swap')}, rank "
             f"{found['rank']} over {found['targets']} module(s) ({found['layout']}), first batch "
             f"{found['first_graphs']} graphs"]
    if found.get("s_per_image_with") is not None:
        lines.append(f"  s/image without adapters {found['s_per_image_without']:.4f}, with "
                     f"{found['s_per_image_with']:.4f}")
    if found.get("refused"):
        lines.append(f"  change check: {found['refused']}")
    lines += [f"  {swap['change']:7} {swap['adapter'] or 'none'}" + (f"@{swap['scale']:g}" if swap["adapter"] else "")
              + f": {swap['graphs_compiled']} graphs, swap {swap['swap_s']:.4f} s, call {swap['generate_s']:.3f} s, "
                f"{swap['vs_none']} levels from none"
              for swap in found["swaps"]]
    lines.append("lora: " + ", ".join(f"{name} median {times['median']:.4f} s max {times['max']:.4f} s"
                                      for name, times in (("swap", found["swap_s"]),
                                                          ("scale change", found["scale_change_s"]),
                                                          ("back to none", found["none_s"])) if times))
    if found.get("profile"):
        lines.append(f"  LoRA profile: {found['profile']} (--lora-mode {found['profile']}: auto through it)")
    return lines


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


# --- speed-ups (--speedups) ----------------------------------------------------------

# Each offered cache at two or three settings of its own diffusers fields (core/
# speedups.py CACHES). What is never tuned is listed with the reason instead: a cache
# the table refuses, one that decides from the whole batch (it runs only behind
# --unreproducible-speedup), one whose required calibration has no preset for this
# family (MagCache's `mag_ratios`: the one preset, `flux`, is diffusers' FLUX_MAG_RATIOS,
# calibrated on FLUX.1, so mag is offered for the flux family only). Under
# --compile regional only whole-block settings run (`refusal` says which): hence
# TaylorSeer's lite mode at two intervals besides its default mode.
CACHE_SETTINGS: dict[str, tuple[str, ...]] = {
    "taylorseer": ("cache_interval=2", "cache_interval=3", "cache_interval=2,use_lite_mode=true",
                   "cache_interval=3,use_lite_mode=true"),
    "mag": ("threshold=0.06", "threshold=0.12"),
    "pyramidattentionbroadcast": ("spatial_attention_block_skip_range=2", "spatial_attention_block_skip_range=3"),
}
# Defaults of --budget-psnr / --budget-ssim: the level where qualify's parity stops
# warning (--min-psnr 25 plus its 10 dB margin), and an SSIM commonly taken as visually
# near-lossless. Both judge a candidate against full compute on the same prompts and
# seeds, not the device against the reference (that is --min-psnr).
BUDGET_PSNR = 35.0
BUDGET_SSIM = 0.97
# Per shape, full compute at two batch sizes and every spec the CPU offers (eleven:
# eight cache settings, one attention backend, two quantization schemes) at the larger,
# with one to spare: the default measures every offered lever at the run's batch size.
MAX_CANDIDATES = 14
PERCEPTUAL = ("LPIPS and CLIP score not computed: their networks' weights are not available locally and qualify "
              "downloads nothing; fidelity is PSNR and SSIM per image")


@dataclass(frozen=True)
class SpeedupOptions:
    budget_psnr: float = BUDGET_PSNR
    budget_ssim: float = BUDGET_SSIM
    max_candidates: int = MAX_CANDIDATES  # measured per shape, full compute included
    max_batch_size: int | None = None  # default: the run's --batch-size
    profile: Path | None = None


def filled_prompts(count: int, prompts=(), seeds=()) -> tuple[list[str], list[int]]:
    """`count` prompts and seeds: those given, then the default prompts (each seeded by its position)."""
    prompts, seeds = list(prompts[:count]), list(seeds[:count])
    for i in range(len(prompts), count):
        prompts.append(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)])
        seeds.append(i)
    return prompts, seeds


def model_family(model: str):
    """The model's family (the table's speed-up facts), read torch-free."""
    from diffq.core.families import FamilyError, family_for_class, family_of

    try:
        family = family_of(model)
        if family is None:  # a hub id: its cached model_index.json
            from huggingface_hub import try_to_load_from_cache

            index = try_to_load_from_cache(model, "model_index.json")
            if isinstance(index, str):
                family = family_for_class(json.loads(Path(index).read_text())["_class_name"])
    except (FamilyError, OSError, ValueError, KeyError) as exc:
        raise QualifyError(f"--speedups: {exc}") from None
    if family is None:
        raise QualifyError(f"--speedups: the family of {model} cannot be read here (no model_index.json); "
                           "download the model first")
    return family


def batch_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... below `largest`, then `largest`."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def offered_speedups(backend, compile_mode: str, family, *, dtype: str | None = None,
                     adapters: bool = False) -> tuple[list[str], list[dict], list[dict]]:
    """(specs to measure, [{speedup, reason}] refused on this device / mode / family /
    dtype, [{speedup, reason}] never tuned), all read from the tables."""
    from diffq.core.speedups import (ATTENTION, BATCH, CACHES, PER_TENSOR, QUANT, SCHEMES, UNREPRODUCIBLE_OPTION,
                                     canonical, parse)
    from diffq.worker.api import DEFAULT_ATTENTION, speedup_refusal as refusal

    specs, not_offered = [], []
    for name, row in CACHES.items():
        if row.refused:
            not_offered.append({"speedup": name, "reason": row.refused})
            continue
        if row.decides == BATCH:
            not_offered.append({"speedup": name, "reason": f"decides from the whole batch ({row.source}): an image "
                                f"would depend on its neighbours; it runs only with {UNREPRODUCIBLE_OPTION} and is "
                                "never tuned"})
            continue
        if name not in CACHE_SETTINGS:
            not_offered.append({"speedup": name, "reason": "no settings to tune in qualify (CACHE_SETTINGS)"})
            continue
        missing = [f for f in row.required if family.name not in row.presets.get(f, ())]
        if missing:
            presets = ", ".join(p for f in missing for p in row.presets.get(f, ())) or "none"
            not_offered.append({"speedup": name, "reason": f"needs {', '.join(missing)} calibrated for the model: "
                                f"diffq's presets ({presets}) are for those families, not {family.name}"})
            continue
        given = [f"{f}={family.name}" for f in row.required]
        specs += [canonical(f"{name}:{','.join([*given, setting])}") for setting in CACHE_SETTINGS[name]]
    specs += [canonical(f"{ATTENTION}:{name}") for name in backend.attention_candidates
              if name != DEFAULT_ATTENTION]
    # Each quantization scheme alone (the table's rows; a device's refusal is listed).
    for name, scheme in SCHEMES.items():
        if scheme.activations == PER_TENSOR:
            not_offered.append({"speedup": f"{QUANT}:{name}", "reason": "one activation scale over the whole batch: "
                                f"an image would depend on its neighbours; it runs only with {UNREPRODUCIBLE_OPTION} "
                                "and is never tuned"})
        else:
            specs.append(canonical(f"{QUANT}:{name}"))
    kept, refused = [], []
    for spec in specs:
        if reason := refusal(parse(spec), backend, compile_mode, family, dtype=dtype, adapters=adapters):
            refused.append({"speedup": spec, "reason": reason})
        else:
            kept.append(spec)
    return kept, refused, not_offered


def plan_speedups(backend, compile_mode: str, family, settings: Settings, options: SpeedupOptions,
                  repeats: int, prompts_file: Path | None = None, *, dtype: str | None = None,
                  adapters: bool = False) -> dict:
    """What --speedups measures per shape, in order, capped, and what it costs: said
    before the child starts."""
    from diffq.core.contract import AUTO_DTYPE

    largest = options.max_batch_size or settings.batch_size
    sizes = batch_sizes(largest)
    specs, refused, not_offered = offered_speedups(backend, compile_mode, family,
                                                   dtype=backend.dtype_for(dtype or AUTO_DTYPE), adapters=adapters)
    # Kept under the cap in this order: full compute at every batch size (each the
    # fidelity reference of its batch size), then the speed-ups at the largest batch size
    # (the run's own by default), then at each smaller one.
    ranked = [(size, None) for size in sizes] + [(size, spec) for size in reversed(sizes) for spec in specs]
    kept = set(ranked[:options.max_candidates])
    order = [(size, spec) for size in sizes for spec in (None, *specs)]  # measured: smallest batch size first
    measure = [{"speedup": spec, "batch_size": size} for size, spec in order if (size, spec) in kept]
    skipped = [{"speedup": spec, "batch_size": size} for size, spec in order if (size, spec) not in kept]
    for index, call in enumerate(measure):
        call["index"] = index
    measured_sizes = sorted({call["batch_size"] for call in measure})
    compiling = compile_mode in COMPILING_MODES or backend.eager_compiles
    # Each new batch size is a new graph per shape; the run's own batch size is compiled
    # by the measurement already; a cache adds none (measured under regional), and an
    # attention switch is refused where it would.
    new_sizes = [size for size in measured_sizes if size != settings.batch_size] if compiling else []
    compiles = len(settings.shapes) * len(new_sizes)
    if compiling:
        how = (f"{len(settings.shapes)} shape(s) x new batch size(s) {', '.join(map(str, new_sizes))}: each batch "
               f"size is a new graph, a cache adds none" if new_sizes else
               f"batch size {settings.batch_size} is compiled by the measurement itself, a cache adds none")
    else:
        how = f"--compile {compile_mode} on {backend.name} compiles nothing"
    if prompts_file is not None:
        prompts, seeds = read_prompt_file(prompts_file, largest)
    else:
        prompts, seeds = filled_prompts(largest, settings.prompts, settings.seeds)
    announce = (f"speedups: {len(measure)} candidate(s) per shape to measure on {len(settings.shapes)} shape(s), "
                f"{1 + repeats} call(s) each (batch sizes {', '.join(map(str, measured_sizes))}; "
                f"{len(skipped)} over --max-candidates {options.max_candidates}, {len(refused)} refused on "
                f"{backend.name} --compile {compile_mode}); compiles: {compiles} ({how})")
    return {"measure": measure, "skipped": skipped, "refused": refused, "not_offered": not_offered,
            "batch_sizes": sizes, "largest_batch_size": largest, "prompts": prompts, "seeds": seeds,
            "compiles": compiles, "compiles_detail": how, "announce": announce,
            "shapes": [label(shape) for shape in settings.shapes]}


def _gaussian_blur(x, sigma: float = 1.5, radius: int = 5):
    """A separable Gaussian (window 11, sigma 1.5), 'valid' at the borders, vectorised."""
    import numpy as np

    k = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    k /= k.sum()
    n = 2 * radius
    rows = sum(w * x[i:x.shape[0] - n + i] for i, w in enumerate(k))
    return sum(w * rows[:, i:rows.shape[1] - n + i] for i, w in enumerate(k))


def ssim(a, b) -> float:
    """SSIM (Wang et al. 2004) of two HxWx3 images in [0, 255]: Gaussian window sigma
    1.5, per channel, the mean over the map and channels (as skimage's
    gaussian_weights=True, data_range=255). 1.0 means identical."""
    import numpy as np

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    if min(a.shape[:2]) < 11:
        return 1.0 if np.array_equal(a, b) else 0.0
    values = []
    for channel in range(a.shape[2]):
        x, y = a[..., channel].astype(np.float64), b[..., channel].astype(np.float64)
        mx, my = _gaussian_blur(x), _gaussian_blur(y)
        sxx = _gaussian_blur(x * x) - mx * mx
        syy = _gaussian_blur(y * y) - my * my
        sxy = _gaussian_blur(x * y) - mx * my
        values.append(float((((2 * mx * my + c1) * (2 * sxy + c2))
                             / ((mx * mx + my * my + c1) * (sxx + syy + c2))).mean()))
    return float(np.mean(values))


def fidelity(full_paths: list[Path], paths: list[Path]) -> list[dict]:
    """Per image against full compute: PSNR (100 dB: identical) and SSIM."""
    found = []
    for full, path in zip(full_paths, paths):
        measured = compare(path, full)
        a, b = _pixels(path), _pixels(full)
        measured["ssim"] = round(ssim(a, b), 6) if a.shape == b.shape else 0.0
        found.append(measured)
    return found


def speedup_results(plan: dict, tuned: list[dict] | None, device_dir: Path, options: SpeedupOptions) -> dict:
    """The table per shape: every candidate (measured, below budget, refused, over the
    cap), and the fastest within the budget."""
    from diffq.core.profile import SpeedupProfile
    from diffq.worker.api import speedup_image_path

    result = {"budget": {"min_psnr": options.budget_psnr, "min_ssim": options.budget_ssim},
              "max_candidates": options.max_candidates, "batch_sizes": plan["batch_sizes"],
              "compiles": plan["compiles"], "compiles_detail": plan["compiles_detail"], "announced": plan["announce"],
              "seeds": plan["seeds"], "perceptual": PERCEPTUAL,
              "note": SpeedupProfile.model_fields["note"].default, "not_offered": plan["not_offered"],
              "shapes": [], "profile": None}
    for shape in tuned or []:
        height, width = shape["height"], shape["width"]
        found = {entry["index"]: entry for entry in shape["candidates"]}

        def images(entry):
            return [speedup_image_path(device_dir, height, width, entry["index"], i)
                    for i in range(entry["batch_size"])]

        full = {e["batch_size"]: e for e in found.values() if e["speedup"] is None and "seconds_per_image" in e}
        candidates = []
        for call in plan["measure"]:
            entry = found[call["index"]]
            row = {"speedup": call["speedup"], "batch_size": call["batch_size"], "seconds_per_image": 0.0,
                   "psnr": None, "ssim": None, "within_budget": False, "refused": None, "skipped": None,
                   "index": call["index"], "failed": False}
            if "out_of_memory" in entry:
                at = entry["out_of_memory"]
                row["refused"] = (f"full compute ran out of memory at batch size {at}"
                                  if entry.get("untried") or call["speedup"] is None else
                                  "out of memory" if at == call["batch_size"] else f"out of memory at batch size {at}")
            elif "error" in entry or "seconds_per_image" not in entry:
                row.update(refused=f"failed: {entry.get('error', 'not measured')}", failed=True)
            else:
                # A scheme probed where full compute ran out of memory (`alone`): against full
                # compute's images of the same first items at the largest batch size that fitted.
                reference = full.get(call["batch_size"]) or max(
                    (e for size, e in full.items() if size < call["batch_size"]),
                    key=lambda e: e["batch_size"], default=None)
                row.update(seconds_per_image=entry["seconds_per_image"], steady_s=entry["steady_s"],
                           transformer_weight_bytes=entry.get("transformer_weight_bytes"),
                           device_peak_bytes=entry.get("device_peak_bytes"),
                           first_call_s=entry["first_call_s"], first_call_graphs=entry["first_call_graphs"],
                           steady_graphs=entry.get("steady_graphs", 0),
                           degenerate=entry.get("degenerate", 0),
                           images_per_s=round(1 / entry["seconds_per_image"], 4) if entry["seconds_per_image"] else None)
                if reference is not None and reference["seconds_per_image"]:
                    row["time_vs_full"] = round(entry["seconds_per_image"] / reference["seconds_per_image"], 4)
                if call["speedup"] is None:
                    row["within_budget"] = True
                elif reference is None:
                    row.update(refused="failed: no full-compute images to compare with", failed=True)
                else:
                    if reference["batch_size"] != call["batch_size"]:
                        row["reference_batch_size"] = reference["batch_size"]
                    per_image = fidelity(images(reference), images(entry))
                    row.update(psnr=min(i["psnr_db"] for i in per_image), ssim=min(i["ssim"] for i in per_image),
                               images=per_image)
                    row["within_budget"] = row["psnr"] >= options.budget_psnr and row["ssim"] >= options.budget_ssim
            candidates.append(row)
        candidates += [{"speedup": r["speedup"], "batch_size": plan["largest_batch_size"], "seconds_per_image": 0.0,
                        "psnr": None, "ssim": None, "within_budget": False, "refused": r["reason"], "skipped": None}
                       for r in plan["refused"]]
        candidates += [{"speedup": c["speedup"], "batch_size": c["batch_size"], "seconds_per_image": 0.0,
                        "psnr": None, "ssim": None, "within_budget": False, "refused": None,
                        "skipped": f"over --max-candidates {options.max_candidates}"} for c in plan["skipped"]]
        measured = [c for c in candidates if c["refused"] is None and c["skipped"] is None]
        within = [c for c in measured if c["within_budget"]]
        # The fastest within the budget; on a tie the earlier (full compute, then the smaller batch).
        chosen = min(within, key=lambda c: c["seconds_per_image"]) if within else None
        for c in measured:
            c["verdict"] = ("chosen" if c is chosen else "within budget" if c["within_budget"] else "below budget")
        result["shapes"].append({"shape": shape["shape"], "height": height, "width": width,
                                 "chosen": None if chosen is None else {k: v for k, v in chosen.items()
                                                                        if k != "images"},
                                 "candidates": candidates})
    return result


def speedups_check(found: dict) -> dict:
    if not found["shapes"]:
        return {"status": "fail", "detail": "nothing measured"}
    parts, troubles = [], []
    for shape in found["shapes"]:
        chosen = shape["chosen"]
        if chosen is None:
            troubles.append(f"{shape['shape']}: full compute was not measured, nothing chosen")
            continue
        below = sum(1 for c in shape["candidates"] if c.get("verdict") == "below budget")
        parts.append(f"{shape['shape']}: {chosen['speedup'] or 'full compute'} at batch size {chosen['batch_size']}, "
                     f"{chosen['seconds_per_image']:.4g} s/image ({below} below budget)")
        troubles += [f"{shape['shape']} {c['speedup'] or 'full compute'} b{c['batch_size']} {c['refused']}"
                     for c in shape["candidates"] if c.get("failed")]
    detail = "; ".join(parts + troubles)
    return {"status": "warn" if troubles else "pass", "detail": detail}


def write_profile(path: Path, report: dict, compile_mode: str) -> str | None:
    """The profile file (core/profile.py): per shape the choice and every candidate."""
    from diffq.core.profile import Budget, Candidate, ShapeChoice, SpeedupProfile

    found = report["speedups"]
    if report.get("error") or not any(s["chosen"] for s in found["shapes"]):
        return None

    def candidate(row: dict) -> Candidate:
        return Candidate(**{name: row[name] for name in Candidate.model_fields})

    profile = SpeedupProfile(
        model=report["model"], device=report["device"]["kind"], compile=compile_mode, steps=report["steps"],
        dtype=report.get("dtype"), guidance_scale=report.get("guidance_scale"), load_s=report.get("load_s"),
        budget=Budget(**found["budget"]),
        shapes=[ShapeChoice(height=s["height"], width=s["width"], chosen=candidate(s["chosen"]),
                            candidates=[candidate(c) for c in s["candidates"]])
                for s in found["shapes"] if s["chosen"]])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    profile.dump(path)
    return str(path)


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
    if report.get("speedups") is not None:
        found["speedups"] = speedups_check(report["speedups"])
    if report.get("lora") is not None:
        found["lora"] = lora_check(report["lora"])
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
            reference_max_pixels: int = REFERENCE_MAX_PIXELS, timeout: float | None = None,
            speedups: SpeedupOptions | None = None, announce: Callable[[str], None] | None = None,
            lora: list[str] | None = None, lora_mode: str = lora_modes.DEFAULT_LORA_MODE,
            lora_text_encoder: str | None = None, lora_profile: Path | None = None) -> dict:
    """Run the qualification and return the report (the `--json` object).

    `speedups`: tune them too (`--speedups`); `announce` hears, before any child
    starts, how many candidates and compiles that costs. `lora`: adapter specs
    (`PATH`, `PATH@SCALE`) to hot-swap on the device (`--lora`); `lora_text_encoder`:
    `drop` runs a file's transformer part without its text-encoder part (`--lora-text-encoder`);
    `lora_profile`: the LoRA profile FILE.json the mode's measure is added to (`--lora --profile`)."""
    from diffq.worker.api import ModelUnavailable, resolve_model

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
    adapters = plan_lora(backend, compile, model, lora, lora_mode, lora_text_encoder) if lora is not None else None
    settings = _settings(model, reference, shapes, batch_size, steps, guidance_scale, max_sequence_length,
                         prompts_file, reference_max_pixels)
    config = RunConfig(device=device, dtype=dtype, compile=compile, offload=offload)
    self_reference = reference == "cpu" and config == REFERENCE
    tuning = None
    if speedups is not None:
        tuning = plan_speedups(backend, compile, model_family(model), settings, speedups, repeats, prompts_file,
                               dtype=dtype, adapters=adapters is not None)
        if announce:
            announce(tuning["announce"])
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="diffq-qualify-") as tmp:
        work = Path(tmp)
        device_dir, reference_dir = work / "device", work / "reference"
        extra = [s for s in settings.parity_shapes if s not in settings.shapes]
        spec = _child_spec(config, slot=slot, threads=threads, compile_cache=compile_cache, settings=settings,
                           measure=True, extra=extra, repeats=repeats, out_dir=device_dir, tuning=tuning,
                           lora=adapters)
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
        if tuning is not None:
            report["speedups"] = speedup_results(tuning, result.get("speedups"), device_dir, speedups)
        if report.get("lora") is not None:
            report["lora"]["adapters"] = [ref.model_dump() for ref in adapters.refs]  # path, scale, pinned revision
        report["checks"] = checks(report, thresholds)
        if tuning is not None and speedups.profile is not None:
            report["speedups"]["profile"] = write_profile(speedups.profile, report, compile)
        if adapters is not None and lora_profile is not None and report.get("lora") is not None:
            report["lora"]["profile"] = write_lora_profile(lora_profile, report, model, backend, compile)
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
        prompts, seeds = filled_prompts(batch_size)
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
    if start := report.get("start"):
        fetched = "; ".join(f"{'hit' if f['hit'] else 'miss'} {f['bytes'] / 1e6:.1f} MB {f['mb_per_s']:.0f} MB/s"
                            for f in start["fetches"])
        lines.append(f"start: weights fetch {start['weights_fetch_s']:.2f} s" + (f" ({fetched})" if fetched else "")
                     + f", load {start['load_s']:.2f} s")
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
    if report.get("speedups") is not None:
        lines += speedup_lines(report["speedups"])
    if report.get("lora") is not None:
        lines += lora_lines(report["lora"])
    for name, check in report["checks"].items():
        lines.append(f"{check['status'].upper():5} {name}: {check['detail']}")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _speedup_status(c: dict) -> str:
    if c.get("skipped"):
        return f"skipped: {c['skipped']}"
    if c.get("refused"):
        return f"refused: {c['refused']}"
    against = c.get("reference_batch_size")
    return c.get("verdict", "") + (f" (full compute out of memory: against its batch {against})" if against else "")


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.3g}"


def speedup_rows(shape: dict) -> list[list[str]]:
    """One row per candidate: speed-up, batch, s/image, time vs full compute, the
    transformer's weights and the peak device memory (MiB), PSNR, SSIM, verdict."""
    return [[c["speedup"] or "none (full compute)", str(c["batch_size"]),
             _fmt(c["seconds_per_image"] if c["refused"] is None and c["skipped"] is None else None, ".4g"),
             _fmt(c.get("time_vs_full"), ".2f"), _mib(c.get("transformer_weight_bytes")),
             _mib(c.get("device_peak_bytes")), _fmt(c["psnr"], ".1f"), _fmt(c["ssim"], ".4f"),
             _speedup_status(c)] for c in shape["candidates"]]


SPEEDUP_COLUMNS = ["speed-up", "batch", "s/image", "time vs full", "weights MiB", "peak MiB", "PSNR min dB",
                   "SSIM min", "verdict"]


def speedup_lines(found: dict) -> list[str]:
    b = found["budget"]
    lines = [f"speedups: budget PSNR >= {b['min_psnr']:g} dB and SSIM >= {b['min_ssim']:g} against full compute at "
             f"the same batch size on the same prompts and seeds; {found['perceptual']}",
             f"speedups: compiles {found['compiles']} ({found['compiles_detail']}); {found['note']}"]
    for item in found["not_offered"]:
        lines.append(f"speedups: {item['speedup']} not tuned: {item['reason']}")
    for shape in found["shapes"]:
        rows = [SPEEDUP_COLUMNS] + speedup_rows(shape)
        widths = [max(len(row[i]) for row in rows) for i in range(len(SPEEDUP_COLUMNS) - 1)]
        lines.append(f"speedups {shape['shape']}:")
        lines += ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths))) + "  " + row[-1]
                  for row in rows]
    if found.get("profile"):
        lines.append(f"profile: {found['profile']}")
    return lines


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
    speedups = _speedups_html(report.get("speedups"), device_dir) if report.get("speedups") is not None else ""
    lora = _lora_html(report["lora"]) if report.get("lora") is not None else ""
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
{speedups}
{lora}
</body></html>
"""


def _lora_html(found: dict) -> str:
    """--lora: the slot, then one row per checked batch."""
    from diffq.results.report import _table

    adapters = _table(["adapter", "scale", "revision"], [[a["path"], f"{a['scale']:g}", a["revision"] or "-"]
                                                         for a in found["adapters"]])
    swaps = _table(["change", "adapter", "scale", "graphs compiled", "swap s", "call s", "levels from none",
                    "levels from the batch before"],
                   [[swap["change"], swap["adapter"] or "none", "-" if swap["scale"] is None else f"{swap['scale']:g}",
                     swap["graphs_compiled"], f"{swap['swap_s']:.4f}", f"{swap['generate_s']:.3f}", swap["vs_none"],
                     swap["vs_previous"]] for swap in found["swaps"]])
    refused = (f"<p><b>Change check failed:</b> {html.escape(found['refused'])}</p>" if found.get("refused")
               else "")
    return (f"<h2>LoRA hot-swap</h2><p>At {html.escape(found['shape'])}, batch size {found['batch_size']}, "
            f"<code>--lora-mode {html.escape(found.get('lora_mode', 'swap'))}</code>: rank {found['rank']} over "
            f"{found['targets']} module(s) ({html.escape(found['layout'])}); the first batch compiled "
            f"{found['first_graphs']} graph(s), each batch after it must compile none (under compile: none going "
            f"back to a set already served).</p>{refused}{adapters}{swaps}")


def _speedups_html(found: dict, device_dir: Path) -> str:
    """The candidates' table per shape, and for each measured speed-up its first image
    beside full compute's (same prompt, seed and batch size) and their difference."""
    from diffq.results.report import _table
    from diffq.worker.api import speedup_image_path

    b = found["budget"]
    parts = [f"<h2>Speed-ups</h2><p>Budget: PSNR &ge; {b['min_psnr']:g} dB and SSIM &ge; {b['min_ssim']:g} against "
             f"full compute at the same batch size on the same prompts and seeds; the fastest candidate within it "
             f"is chosen, one below it is shown and never chosen. {html.escape(found['perceptual'])}. "
             f"Compiles: {found['compiles']} ({html.escape(found['compiles_detail'])}).</p>"
             f"<p><b>{html.escape(found['note'])}.</b></p>"]
    if found["not_offered"]:
        parts.append("<h3>Not tuned</h3>" + _table(["speed-up", "why"], [[i["speedup"], i["reason"]]
                                                                           for i in found["not_offered"]]))
    for shape in found["shapes"]:
        height, width = shape["height"], shape["width"]
        parts.append(f"<h3>{html.escape(shape['shape'])}</h3>" + _table(SPEEDUP_COLUMNS, speedup_rows(shape)))
        full = {c["batch_size"]: c for c in shape["candidates"]
                if c["speedup"] is None and c.get("index") is not None and c["refused"] is None}
        for c in shape["candidates"]:
            reference = full.get(c["batch_size"])
            if c["speedup"] is None or c.get("images") is None or reference is None:
                continue
            sped = speedup_image_path(device_dir, height, width, c["index"], 0)
            whole = speedup_image_path(device_dir, height, width, reference["index"], 0)
            diff, peak = heatmap(sped, whole)
            first = c["images"][0]
            parts.append("<div class=row>" + "".join(
                f"<figure>{_img(png, caption)}<figcaption>{html.escape(caption)}</figcaption></figure>"
                for png, caption in ((whole.read_bytes(), f"full compute, batch size {c['batch_size']}, item 0"),
                                     (sped.read_bytes(), f"{c['speedup']} ({c['verdict']}): PSNR "
                                                         f"{first['psnr_db']:.1f} dB, SSIM {first['ssim']:.4f}"),
                                     (diff, f"|difference|, black 0 to yellow {peak}"))) + "</div>")
    return "".join(parts)


def write_report(directory: Path, report: dict, settings: Settings, device_dir: Path,
                 reference_dir: Path | None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    page = directory / "index.html"
    page.write_text(render_html(report, settings, device_dir, reference_dir))
    (directory / "qualify.json").write_text(json.dumps(report, indent=2) + "\n")
    return page
