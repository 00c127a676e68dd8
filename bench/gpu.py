"""Real-size figures on one accelerator: a FLUX.1-dev-sized pipeline with random weights,
the whole `diffq run` against the bare diffusers loop, compile, speed-ups and qualify.

    python -m bench.gpu --out DIR [--tiny] [--deadline S] [--parts a,b,c,d,e] [--lora-modes swap,fuse,compile]
                           [--items N] [--keep-model]
    python -m bench.gpu --wheels DIR      # here: the cp312 wheels the device machine lacks

No weights exist on the device machine and nothing can be fetched there, so step 0
builds the pipeline directly on the GPU in bf16 at FLUX.1-dev's own sizes (transformer
19 double + 38 single blocks, 24 heads x 128, guidance embeds; its VAE; CLIP-L) and a
T5 encoder at T5-XXL's width (d_model 4096) with 2 of its 24 layers: the other 22
would add ~9.5 GB of disk and load time for ~1 % of a step's work (the encoder runs
once a call, the transformer 28 times). Tokenizers are built offline as the tiny
pipelines' are. It is saved once to local disk (free disk checked first; fewer blocks
if it does not fit), so every process below loads it as a user's would. Then, in this
order, so that a run cut short keeps the first:

(a) the whole `diffq run` (embedded broker, `--device cuda`, defaults) against the
    bare loop (the same pipeline call on the same prompts and seeds, each batch's images
    brought to host memory as 8-bit, nothing stored), one process each, interleaved, at
    batch 1 and at the best batch size (probed in the first bare process: the lowest
    s/image of a short call at 1, 2, 4, 8 until out of memory);
(b) `--compile regional` and `full`: a cold `diffq run` on an empty compile cache
    (its first batch's call: the compile), steady s/image, then a second process on that
    cache (its time to first image, from the worker's own start record);
(c) every speed-up `diffq qualify --speedups` offers on this device (the tables'
    caches and attention backends), on one process's pipeline host (the worker's own
    path): s/image against full compute at the same batch size, PSNR/SSIM against full
    compute, whether an item's pixels are identical across two batch compositions of the
    same batch size, and, apart, across batch sizes;
(d) `diffq qualify --speedups --profile` end to end on one shape (judged against the
    full-compute images of (c) as its saved reference: a CPU reference of a 12B model
    would take longer than the whole call), its profile then driving a `diffq run`;
(e) `diffq qualify --lora A,B --lora-mode M --compile regional` per LoRA mode (swap,
    fuse, compile; two random adapters of mixed rank written for the built transformer
    without loading its weights): graphs after the first batch, whether each change
    showed, the change's time, s/image with and without adapters — what settles the
    LoRA mode table for the device (issue 59).

Each figure is printed as it is taken; `DIR/gpu.json` (device, driver, torch and
diffusers versions, the exact configs) and `DIR/gpu.png` are rewritten after each
measurement; at the deadline the running process is stopped and what is left is
listed as cut. `--tiny`: the tiny FLUX.1 pipeline on the CPU, a few steps (the suite
dry-runs the whole script this way; no `full` compile there). bench/gpu_device.sh is
the device machine's one command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.e2e import timeline
from bench.speedups import prompts

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("a", "b", "c", "d", "e")
# (e)'s LoRA modes (worker/device/lora_modes.py), each one `diffq qualify --lora` process.
LORA_MODES = ("swap", "fuse", "compile")
LORA_RANKS = (8, 16)  # two adapters of mixed rank: the layout pads to the larger
RESULT = "gpu.json"
CHART = "gpu.png"
# Published anchors on the same work (FLUX.1-dev, 1024², 28 steps), for docs/BENCHMARKS.md.
ANCHORS = (
    "xDiT's docs: FLUX.1-dev 1024², 28 steps, about 4.3 s an image on one H100, compiled",
    "flux-fast: about 2.5x over eager on an H100",
    "cache-dit: FLUX.1-dev 24.9 -> 8.2 s an image on an L20",
    "diffusers' regional compilation: about 1.5x, at a fraction of full compilation's time",
)


@dataclasses.dataclass(frozen=True)
class Scale:
    """One size of the whole benchmark: the pipeline, the device and the workload."""

    name: str
    device: str
    size: int  # height = width
    steps: int
    max_sequence_length: int
    guidance_scale: float
    items: int  # per process in (a), at each batch size
    batch_sizes: tuple[int, ...]  # probed for the best, smallest first
    probe_steps: int
    compile_modes: tuple[str, ...]
    qualify_candidates: int  # (d)'s --max-candidates: (c) measures every one already


# FLUX.1-dev's defaults (512 T5 tokens, guidance 3.5), as the anchors ran it.
REAL = Scale(name="flux1-dev-size", device="cuda", size=1024, steps=28, max_sequence_length=512,
             guidance_scale=3.5, items=2, batch_sizes=(1, 2, 4, 8), probe_steps=4, compile_modes=("regional", "full"),
             qualify_candidates=6)
# The 2-core CI: no `full` compile (minutes of Inductor on CPU).
TINY = Scale(name="tiny-flux", device="cpu", size=64, steps=4, max_sequence_length=64, guidance_scale=3.5,
             items=4, batch_sizes=(1, 2), probe_steps=2, compile_modes=("regional",), qualify_candidates=4)

# FLUX.1-dev's component configs (its model_index.json and each folder's config.json).
FLUX_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                        guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
                shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu")
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=24, relative_attention_num_buckets=32,
              relative_attention_max_distance=128, feed_forward_proj="gated-gelu", dense_act_fn="gelu_new")
T5_LAYERS = 2

# What the device machine lacks (its image holds torch, transformers, accelerate,
# safetensors, numpy, pillow, pyarrow, rich, typer, prometheus-client, python-dateutil,
# ...: /work/.library/device/KINDS.md): diffq's dependency closure less those, carried as
# cp312 wheels at the versions installed here, which the suite ran (`uncarried` checks
# it; torchao for quant:SCHEME). LEFT_BEHIND stays behind: each is loaded on demand.
CARRIED = ("diffusers", "importlib-metadata", "lazy-importer", "celery", "kombu", "billiard", "vine", "amqp",
           "click-didyoumean", "click-repl", "click-plugins", "prompt-toolkit", "wcwidth", "tzlocal", "redis",
           "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "annotated-types", "typing-inspection",
           "typing-extensions", "orjson", "torchao")
# The device image's packages (KINDS.md, "Python packages already there", read off a
# machine on 2026-11-17): `uncarried` checks CARRIED against diffq's closure less these.
DEVICE_IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
# diffq's dependencies the GPU run never imports, left behind with the reason (each is
# imported only inside the feature that needs it; test_bench_gpu imports the run's
# modules with them blocked).
# Each: (the module it provides, why the GPU run does without it).
LEFT_BEHIND = {
    "boto3": ("boto3", "s3:// storage and model fetch (core/storage/s3.py, loaded on demand)"),
    "google-cloud-storage": ("google.cloud.storage", "gs:// storage (core/storage/gcs.py, loaded on demand)"),
    "grafana-foundation-sdk": ("grafana_foundation_sdk",
                               "fleet dashboards (app/monitoring.py imports it in the function that builds them)"),
}
# The device's interpreter, for requirement markers.
DEVICE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                 "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                 "platform_python_implementation": "CPython", "os_name": "posix"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CARRY_LIMIT_MB = 64


# --- the parent: steps, deadline, JSON after each ------------------------------------


class Bench:
    """The measurements in order, each against the deadline, the JSON rewritten after each."""

    def __init__(self, scale: Scale, out: Path, deadline_s: float, parts: tuple[str, ...], items: int,
                 keep_model: bool = False, lora_modes: tuple[str, ...] = LORA_MODES):
        self.scale, self.out, self.parts, self.items, self.lora_modes = scale, out, parts, items, lora_modes
        # --keep-model: a second call on the same (still warm) machine loads the first's
        # pipeline instead of building and saving it again, and carries on its figures
        # (the parts it does not run again, and (a)'s best batch size).
        self.kept = Path(tempfile.gettempdir()) / f"diffq-bench-gpu-{scale.name}" if keep_model else None
        self.deadline = time.monotonic() + deadline_s
        self.work = Path(tempfile.mkdtemp(prefix="diffq-bench-gpu-"))
        self.rows = prompts(max(2 * max(scale.batch_sizes), items * max(scale.batch_sizes)))
        self.result: dict = {"scale": dataclasses.asdict(scale), "deadline_s": deadline_s, "parts": list(parts),
                             "items": items, "anchors": list(ANCHORS), "cut": [], "figures": {}}
        earlier = self.kept / RESULT if self.kept else None
        if earlier and earlier.is_file():
            before = json.loads(earlier.read_text())
            self.result["figures"] = {step: found for step, found in before["figures"].items()
                                      if step not in parts and step != "build"}
            self.result["earlier"] = {k: before.get(k) for k in ("parts", "cut", "wall_s")}
            if "probe" in before["figures"].get("a", {}):
                self.best = before["figures"]["a"]["probe"]["best_batch_size"]
        out.mkdir(parents=True, exist_ok=True)
        # Processes run in the work folder; this module's children find bench/ after
        # whatever PYTHONPATH holds first (on the device: the installed diffq).
        path = [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}

    # Each step's figures land here, and on the terminal as they come.
    def say(self, step: str, key: str, value) -> None:
        self.result["figures"].setdefault(step, {})[key] = value
        print(f"[{step}] {key}: {json.dumps(value) if not isinstance(value, str) else value}", flush=True)
        self.save()

    def save(self) -> None:
        body = json.dumps(self.result, indent=1, default=str) + "\n"
        tmp = self.out / f".{RESULT}.tmp"
        tmp.write_text(body)
        tmp.replace(self.out / RESULT)
        if self.kept and self.kept.is_dir():
            (self.kept / RESULT).write_text(body)
        chart(self.result, self.out / CHART)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def process(self, name: str, command: list[str]) -> dict:
        """One whole process, timed from spawn to exit; stopped at the deadline."""
        log = self.work / f"{name}.log"
        budget = self.left()
        if budget <= 1:
            raise Cut(name)
        started = time.perf_counter()
        with log.open("wb") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=self.work, env=self.env,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole session: diffq's workers too
                proc.wait()
                raise Cut(name) from None
        seconds = time.perf_counter() - started
        if code:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise Failed(f"{name} exited with {code}: {' | '.join(tail)}")
        return {"process_s": round(seconds, 2)}

    def child(self, name: str, role: str, spec: dict) -> dict:
        """A child of this module (`--child ROLE SPEC`): its result."""
        path = self.work / f"{name}.spec.json"
        spec = {**spec, "result": str(self.work / f"{name}.result.json")}
        path.write_text(json.dumps(spec))
        timing = self.process(name, [sys.executable, "-m", "bench.gpu", "--child", role, str(path)])
        return {**json.loads(Path(spec["result"]).read_text()), **timing}

    def run(self) -> dict:
        started = time.monotonic()
        steps = [("build", self.build)] + [(part, getattr(self, f"part_{part}")) for part in self.parts]
        for index, (name, step) in enumerate(steps):
            try:
                step()
            except Cut as cut:
                self.result["cut"] = [f"{name}: stopped at the deadline in {cut}"] + [n for n, _ in steps[index + 1:]]
                print(f"[{name}] cut at the deadline ({cut}); not run: {', '.join(self.result['cut'][1:]) or '-'}",
                      flush=True)
                break
            except Failed as failed:
                self.say(name, "error", str(failed))
                if name == "build":
                    break
        self.result["wall_s"] = round(time.monotonic() - started, 1)
        self.save()
        shutil.rmtree(self.work, ignore_errors=True)  # the model too, unless kept: tens of GB at real size
        return self.result

    # --- step 0: the pipeline, saved once ------------------------------------------

    def build(self) -> None:
        marker = self.kept / "built.json" if self.kept else None
        if marker and marker.is_file():
            built = {**json.loads(marker.read_text()), "reused": str(self.kept)}
        else:
            built = self.child("build", "build", {"scale": self.scale.name, "out": str(self.kept or self.work / "model")})
            if marker:
                marker.write_text(json.dumps(built))
        self.model = built.pop("model")
        self.result["device"] = built.pop("device")
        self.result["versions"] = built.pop("versions")
        for key, value in built.items():
            self.say("build", key, value)

    # --- (a) the whole process against the bare loop ---------------------------------

    def part_a(self) -> None:
        best = None
        for batch in (1, None):
            batch = batch or best
            items = self.items * batch
            rows = self.rows[:items]
            source = self.prompt_file(f"a-b{batch}", rows)
            bare = self.child(f"a-bare-b{batch}", "bare", {
                **self.workload(batch), "model": self.model, "rows": rows,
                "probe": list(self.scale.batch_sizes) if best is None else []})
            if best is None:
                best = bare["best_batch_size"]
                self.say("a", "probe", {"s_per_image": bare["probe"], "best_batch_size": best})
            run = self.diffq_run(f"a-diffq-b{batch}", source, batch)
            bare_s = round(bare["process_s"] - bare.get("probe_s", 0), 2)  # the probe ran after its images
            figures = {"items": items, "bare_process_s": bare_s, "diffq_process_s": run["process_s"],
                       "bare_images_per_s": round(items / bare_s, 4),
                       "diffq_images_per_s": round(items / run["process_s"], 4),
                       "whole_ratio": round(bare_s / run["process_s"], 4),
                       "bare_load_s": bare["load_s"], "bare_steady_s_per_batch": bare["steady_s"],
                       "diffq_steady_s_per_batch": run["steady_s"], "diffq_in_run_s": run["in_run_s"],
                       "diffq_idle_gap_ms": run["idle_gap_ms"], "diffq_start": run["start"],
                       "goal_whole_ratio": 0.97}
            if bare["steady_s"] and run["steady_s"]:
                figures["steady_ratio"] = round(bare["steady_s"] / run["steady_s"], 4)
            self.say("a", f"batch {batch}", figures)
            if best == 1:
                break
        self.best = best

    # --- (b) compile: cold, steady, a second process's warm start --------------------

    def part_b(self) -> None:
        batch = getattr(self, "best", 1)
        rows = self.rows[:2 * batch]
        source = self.prompt_file(f"b-b{batch}", rows)
        for mode in self.scale.compile_modes:
            cache = self.work / f"cache-{mode}"
            cold = self.diffq_run(f"b-{mode}-cold", source, batch, "--compile", mode, "--compile-cache", str(cache))
            figures = {"batch_size": batch, "cold_process_s": cold["process_s"], "cold_first_call_s": cold["first_call_s"],
                       "compile_s": round(cold["first_call_s"] - (cold["steady_s"] or 0), 2),
                       "steady_s_per_image": round(cold["steady_s"] / batch, 4) if cold["steady_s"] else None,
                       "cold_time_to_first_image_s": cold["start"].get("time_to_first_image_s"),
                       "cold_start": cold["start"]}
            self.say("b", mode, figures)  # kept if the deadline comes during the warm start
            warm = self.diffq_run(f"b-{mode}-warm", source, batch, "--compile", mode, "--compile-cache", str(cache))
            self.say("b", mode, {**figures, "warm_time_to_first_image_s": warm["start"].get("time_to_first_image_s"),
                                 "warm_first_call_s": warm["first_call_s"], "warm_process_s": warm["process_s"],
                                 "warm_start": warm["start"]})

    # --- (c) each speed-up on the worker's own pipeline host --------------------------

    def part_c(self) -> None:
        batch = max(2, getattr(self, "best", 2))  # two compositions need two items a batch
        found = self.child("c-speedups", "speedups", {
            **self.workload(batch), "model": self.model, "rows": self.rows[:2 * batch],
            "reference": str(self.work / "reference"), "images": str(self.work / "c-images"),
            "deadline_at": time.time() + self.left() - 5})
        self.say("c", "speedups", {"batch_size": batch, "load_s": found["load_s"], "rows": found["rows"],
                                   "not_offered": found["not_offered"], "stopped": found["stopped"]})
        self.reference = found["rows"] and self.work / "reference"

    # --- (d) qualify --speedups end to end, its profile driving a run ------------------

    def part_d(self) -> None:
        scale, batch = self.scale, max(2, getattr(self, "best", 2))
        reference = getattr(self, "reference", None)
        if not reference:
            raise Failed("(d) needs (c)'s full-compute images as its reference")
        profile = self.work / "profile.json"
        report = self.work / "qualify.json"
        command = [sys.executable, "-m", "diffq", "qualify", "--model", self.model, "--device", scale.device,
                   "--reference", str(reference), "--speedups", "--profile", str(profile),
                   "--max-candidates", str(scale.qualify_candidates), "--repeats", "1", "--json"]
        found, seconds, code = self.json_process("d-qualify", command)
        shapes = found.get("speedups", {}).get("shapes", [])
        self.say("d", "qualify", {
            "process_s": seconds, "exit": code, "passed": found.get("passed"),
            "checks": {k: v.get("status") for k, v in found.get("checks", {}).items()},
            "chosen": [s.get("chosen") for s in shapes],
            "candidates": [{k: c.get(k) for k in ("speedup", "batch_size", "seconds_per_image", "time_vs_full",
                                                   "psnr", "ssim", "verdict", "refused")}
                           for s in shapes for c in s["candidates"]]})
        if not profile.is_file():
            raise Failed("qualify wrote no profile")
        source = self.prompt_file("d-run", self.rows[:2 * batch])
        run = self.diffq_run("d-run", source, None, "--speedup", str(profile))
        self.say("d", "run with the profile", {k: run[k] for k in ("process_s", "steady_s", "in_run_s", "speedups",
                                                                    "batch_sizes", "images")})

    # --- (e) qualify --lora per LoRA mode ---------------------------------------------

    def part_e(self) -> None:
        """Per mode, `diffq qualify --lora A,B --lora-mode M --compile regional`: graphs
        compiled after the first batch, whether each change showed, the change's time and
        s/image with and without adapters (issue 59: what a lent device settles for the
        mode table). Judged against (c)'s full-compute images; on the CPU dry run, a CPU
        reference if (c) did not run."""
        scale = self.scale
        reference = getattr(self, "reference", None) or ("cpu" if scale.device == "cpu" else None)
        if not reference:
            raise Failed("(e) needs (c)'s full-compute images as its reference")
        loras = self.child("e-loras", "loras", {"model": self.model, "out": str(self.work / "loras"),
                                                "ranks": list(LORA_RANKS)})
        self.say("e", "adapters", {k: loras[k] for k in ("ranks", "targets", "bytes", "process_s")})
        for mode in self.lora_modes:
            command = [sys.executable, "-m", "diffq", "qualify", "--model", self.model, "--device", scale.device,
                       "--reference", str(reference), "--compile", "regional", "--lora", ",".join(loras["paths"]),
                       "--lora-mode", mode, "--shapes", f"{scale.size}x{scale.size}", "--steps", str(scale.steps),
                       "--max-sequence-length", str(scale.max_sequence_length), "--guidance-scale",
                       str(scale.guidance_scale), "--repeats", "1", "--json"]
            found, seconds, code = self.json_process(f"e-{mode}", command)
            lora = found.get("lora") or {}
            self.say("e", mode, {
                "process_s": seconds, "exit": code, "check": found.get("checks", {}).get("lora"),
                **{k: lora.get(k) for k in ("batch_size", "rank", "targets", "first_graphs", "recompiled", "unseen",
                                            "refused", "swap_s", "scale_change_s", "s_per_image_without",
                                            "s_per_image_with")},
                "graphs_after_first": sum(swap["graphs_compiled"] for swap in lora.get("swaps", [])),
                "changes": [{k: swap.get(k) for k in ("change", "adapter", "graphs_compiled", "swap_s", "vs_none")}
                            for swap in lora.get("swaps", [])]})

    # --- shared -----------------------------------------------------------------------

    def json_process(self, name: str, command: list[str]) -> tuple[dict, float, int]:
        """A process printing one JSON object (`--json`): it, its seconds, its exit code."""
        log = self.work / f"{name}.out"
        budget = self.left()
        if budget <= 1:
            raise Cut(name)
        started = time.perf_counter()
        with log.open("wb") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.PIPE, cwd=self.work, env=self.env,
                                    start_new_session=True)
            try:
                _, err = proc.communicate(timeout=budget)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise Cut(name) from None
        try:
            found = json.loads(log.read_text())
        except ValueError:
            raise Failed(f"{name} exited with {proc.returncode}: {err.decode(errors='replace')[-400:]}") from None
        return found, round(time.perf_counter() - started, 2), proc.returncode

    def workload(self, batch: int) -> dict:
        s = self.scale
        return {"device": s.device, "size": s.size, "steps": s.steps, "batch_size": batch,
                "max_sequence_length": s.max_sequence_length, "guidance_scale": s.guidance_scale,
                "probe_steps": s.probe_steps}

    def prompt_file(self, name: str, rows: list[dict]) -> Path:
        path = self.work / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    def diffq_run(self, name: str, source: Path, batch: int | None, *extra: str) -> dict:
        """A whole `diffq run` on this scale's defaults (batch None: the profile's), and
        what its run folder says: steady call, first call, idle gaps, the worker's start."""
        s = self.scale
        out = self.work / name
        command = [sys.executable, "-m", "diffq", "run", str(source), "--model", self.model, "--out", str(out),
                   "--device", s.device, "--batch-size", str(batch or "auto"), "--steps", str(s.steps),
                   "--height", str(s.size), "--width", str(s.size), "--max-sequence-length",
                   str(s.max_sequence_length), "--guidance-scale", str(s.guidance_scale), "--no-progress", *extra]
        return {**self.process(name, command), **folder_figures(out, self.model)}


class Cut(Exception):
    """The deadline came during this process."""


class Failed(Exception):
    """A step's process failed; the next step still runs."""


def folder_figures(out: Path, model: str) -> dict:
    """From a run folder: per batch its call, the steady call (median after the first),
    the in-run seconds, idle gaps, speed-ups recorded, the worker's start record."""
    from diffq.core import layout
    from diffq.core.contract import shape_from_queue
    from diffq.core.records import WorkerStart
    from diffq.core.runfolder import iter_records
    from diffq.core.storage import open_storage

    storage = open_storage(str(out))
    batches: dict[str, tuple] = {}
    images, speedups, sizes = 0, set(), set()
    for record in iter_records(storage):
        images += 1
        speedups.add(record.speedup)
        sizes.add(shape_from_queue(record.queue, [model]).batch_size)
        batches[record.batch_id] = (record.generate_started_at, record.generate_s)
    calls = [seconds for _, seconds in sorted(batches.values())]
    gaps, in_run = timeline(str(out))
    starts = [WorkerStart.model_validate_json(body)
              for _, body in storage.get_many(list(storage.list(layout.STARTS_PREFIX)))]
    return {"images": images, "batches": len(calls), "first_call_s": round(calls[0], 3) if calls else None,
            "steady_s": round(statistics.median(calls[1:]), 4) if len(calls) > 1 else None,
            "in_run_s": round(in_run, 3), "idle_gap_ms": round(1000 * statistics.median(gaps), 2) if gaps else None,
            "speedups": sorted(map(str, speedups)), "batch_sizes": sorted(sizes),
            "start": starts[0].model_dump(mode="json") if starts else {}}


# --- the children: build, bare loop, speed-ups ---------------------------------------


def child_build(spec: dict) -> dict:
    """The pipeline saved once under spec['out']; the machine's facts."""
    import torch

    out = Path(spec["out"])
    started = time.perf_counter()
    if spec["scale"] == TINY.name:
        from diffq.app.tiny import build_tiny_pipeline

        build_tiny_pipeline(out, family="flux")
        config = {"family": "flux", "tiny": True}
    else:
        config = build_flux_size(out)
    built_s = time.perf_counter() - started
    on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"model": str(out), "build_and_save_s": round(built_s, 1), "on_disk_gb": round(on_disk / 1e9, 2),
            "config": config, "device": machine(), "versions": versions(torch)}


def flux_size_params(single: int, double: int) -> float:
    """About FLUX.1-dev's transformer parameters (billions) with these block counts (12.2 at 38 + 19, against
    11.9 counted): enough to check the disk."""
    width = FLUX_TRANSFORMER["num_attention_heads"] * FLUX_TRANSFORMER["attention_head_dim"]
    double_block = 2 * (4 * width * width + 2 * 4 * width * width + 6 * width * width)  # attn, MLP, modulation
    single_block = 3 * width * width + 4 * width * width + (width + 4 * width) * width + 3 * width * width
    return (double * double_block + single * single_block) / 1e9 + 0.4  # embedders, norms, out


def build_flux_size(out: Path, device: str = "cuda") -> dict:
    """FLUX.1-dev's layout at its real sizes, random weights, built on the GPU in bf16 and
    saved; fewer transformer blocks (same ratio) if the disk cannot hold it."""
    import torch
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffq.app.tiny import _clip, _scheduler, _t5

    transformer_config = dict(FLUX_TRANSFORMER)
    out.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(out).free / 1e9
    need_gb = 2 * (flux_size_params(38, 19) + 0.5) * 1.1  # bf16, the encoders and VAE, a margin
    shrunk = None
    if need_gb > free_gb:
        keep = max(0.05, free_gb / need_gb * 0.9)
        transformer_config.update(num_layers=max(1, int(19 * keep)), num_single_layers=max(1, int(38 * keep)))
        shrunk = f"disk: {free_gb:.0f} GB free, {need_gb:.0f} GB needed; kept {keep:.0%} of the blocks"
    tokenizer, _ = _clip(8)  # offline tokenizers, as the tiny pipelines build them
    tokenizer_2, _ = _t5(8)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            text_encoder = CLIPTextModel(CLIPTextConfig(
                vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **CLIP_L))
            text_encoder_2 = T5EncoderModel(T5Config(
                vocab_size=len(tokenizer_2), pad_token_id=tokenizer_2.pad_token_id,
                eos_token_id=tokenizer_2.eos_token_id, decoder_start_token_id=tokenizer_2.pad_token_id,
                **{**T5_XXL, "num_layers": T5_LAYERS}))
            vae = AutoencoderKL(**FLUX_VAE)
            transformer = FluxTransformer2DModel(**transformer_config)
        finally:
            torch.set_default_dtype(previous)
    pipe = FluxPipeline(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(out)
    return {"family": "flux", "transformer": {**transformer_config, "axes_dims_rope": list(FLUX_TRANSFORMER["axes_dims_rope"])},
            "transformer_params_b": round(sum(p.numel() for p in transformer.parameters()) / 1e9, 3),
            "vae": {k: list(v) if isinstance(v, tuple) else v for k, v in FLUX_VAE.items()}, "clip": CLIP_L,
            "t5": {**T5_XXL, "num_layers": T5_LAYERS}, "dtype": "bfloat16", "shrunk": shrunk,
            "t5_note": f"T5-XXL's width with {T5_LAYERS} of its 24 layers: the rest would add ~9.5 GB of disk and "
                       "load time for ~1 % of a step's work (it runs once a call, the transformer every step)"}


def machine() -> dict:
    import torch

    found = {"torch_device": "cpu", "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update(torch_device=props.name, memory_gb=round(props.total_memory / 2**30, 1),
                     multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
        try:
            found["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            found["nvidia_smi"] = None
    return found


def versions(torch) -> dict:
    import diffusers
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "diffusers": diffusers.__version__, "transformers": transformers.__version__}


def _host(spec: dict):
    """The worker's own pipeline host on this device, model loaded; and the load seconds."""
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost

    backend = get_backend(spec["device"])
    host = PipelineHost(backend=backend, compile_mode="none")
    started = time.perf_counter()
    host.pipeline(spec["model"], "auto")
    return host, backend, round(time.perf_counter() - started, 2)


def _key(spec: dict, batch: int):
    from diffq.core.contract import ShapeKey

    return ShapeKey(model=spec["model"], height=spec["size"], width=spec["size"], batch_size=batch,
                    max_sequence_length=spec["max_sequence_length"], cfg=False)


def child_bare(spec: dict) -> dict:
    """The bare loop a user writes: load, then the pipeline called back to back on the
    same prompts and seeds as `diffq run` (one CPU generator per item, as diffq seeds
    them), each batch's images brought to host memory as 8-bit; nothing stored. With
    `probe`: afterwards, a short call at each batch size (the best s/image wins)."""
    import torch
    from diffusers import DiffusionPipeline

    from diffq.core.families import family_of
    from diffq.worker.device.backends import get_backend

    backend = get_backend(spec["device"])
    started = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(spec["model"], dtype=getattr(torch, backend.default_dtype),
                                             local_files_only=True).to(backend.torch_device)
    pipe.set_progress_bar_config(disable=True)
    load_s = round(time.perf_counter() - started, 2)
    family = family_of(spec["model"])
    batch, rows = spec["batch_size"], spec["rows"]

    def call(batch_rows: list[dict], steps: int) -> float:
        kwargs = family.call_kwargs(
            prompts=[r["prompt"] for r in batch_rows], negative_prompts=[None] * len(batch_rows),
            height=spec["size"], width=spec["size"], num_inference_steps=steps,
            guidance_scale=spec["guidance_scale"], max_sequence_length=spec["max_sequence_length"],
            generator=[torch.Generator("cpu").manual_seed(r["seed"]) for r in batch_rows])
        began = time.perf_counter()
        with torch.inference_mode():
            images = pipe(**kwargs).images
            (images * 255).round().clamp(0, 255).to(torch.uint8).cpu()
        return time.perf_counter() - began

    calls = [call(rows[i:i + batch], spec["steps"]) for i in range(0, len(rows), batch)]
    found = {"load_s": load_s, "calls_s": [round(c, 3) for c in calls],
             "steady_s": round(statistics.median(calls[1:]), 4) if len(calls) > 1 else None}
    if spec["probe"]:
        probe_started = time.perf_counter()
        per_image, best = {}, spec["probe"][0]
        for size in spec["probe"]:
            batch_rows = (rows * size)[:size]
            try:
                call(batch_rows, 1)  # the first call of a batch size: allocator, kernels
                per_image[size] = round(call(batch_rows, spec["probe_steps"]) / size, 4)
            except torch.OutOfMemoryError:
                per_image[size] = "out of memory"
                break
            if per_image[size] <= per_image[best]:
                best = size
        found.update(probe=per_image, best_batch_size=best, probe_s=round(time.perf_counter() - probe_started, 2))
    return found


def child_speedups(spec: dict) -> dict:
    """(c): every speed-up qualify offers here, on the worker's pipeline host, at one
    batch size: s/image against full compute, PSNR/SSIM against full compute, and
    whether item 0's pixels are the same in another composition of the same batch size
    (other neighbours, another position) and, apart, at batch size 1. Full compute's
    first composition is also written as a qualify reference (for (d))."""
    import numpy as np
    from PIL import Image

    from diffq.app.qualify import Settings, fidelity, offered_speedups
    from diffq.core.contract import BatchItem, BatchParams
    from diffq.core.families import family_of
    from diffq.worker.process.qualify import image_path

    host, backend, load_s = _host(spec)
    family = family_of(spec["model"])
    specs, refused, not_offered = offered_speedups(backend, "none", family)
    batch = spec["batch_size"]
    items = [BatchItem(id=r["id"], prompt=r["prompt"], seed=r["seed"]) for r in spec["rows"]]
    first = items[:batch]
    other = items[batch:2 * batch - 1] + items[:1]  # item 0 among other neighbours, last
    images = Path(spec["images"])

    def call(speedup: str | None, batch_items, size: int):
        params = BatchParams(num_inference_steps=spec["steps"], guidance_scale=spec["guidance_scale"],
                             speedup=speedup)
        return host.generate(_key(spec, size), params, batch_items)

    def saved(name: str, arrays) -> list[Path]:
        paths = []
        for index, array in enumerate(arrays):
            path = images / name / f"{index}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(array).save(path)
            paths.append(path)
        return paths

    call(None, first, batch)  # the first call: allocator, kernels, cuDNN's choices
    rows, full_paths, full_s, stopped = [], None, None, None
    for index, speedup in enumerate([None, *specs]):
        if time.time() > spec["deadline_at"]:
            stopped = f"deadline: {len(specs) + 1 - index} speed-up(s) not measured"
            break
        row = {"speedup": speedup or "none (full compute)"}
        try:
            a, b, single = call(speedup, first, batch), call(speedup, other, batch), call(speedup, first[:1], 1)
        except Exception as exc:  # one that fails on the device is shown failed, not hidden
            rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        seconds = statistics.median([a.generate_s, b.generate_s]) / batch
        paths = saved(f"s{index}", a.images)
        if speedup is None:
            full_paths, full_s = paths, seconds
            write_reference(Path(spec["reference"]), Settings, image_path, spec, first, a.images)
        row.update(s_per_image=round(seconds, 4), time_vs_full=round(seconds / full_s, 4),
                   same_in_other_composition=bool(np.array_equal(a.images[0], b.images[-1])),
                   max_diff_other_composition=int(np.abs(a.images[0].astype(int) - b.images[-1].astype(int)).max()),
                   same_at_batch_1=bool(np.array_equal(a.images[0], single.images[0])),
                   max_diff_at_batch_1=int(np.abs(a.images[0].astype(int) - single.images[0].astype(int)).max()))
        if speedup is not None:
            measured = fidelity(full_paths, paths)
            row.update(psnr_min=min(m["psnr_db"] for m in measured), ssim_min=min(m["ssim"] for m in measured))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"load_s": load_s, "rows": rows, "stopped": stopped, "refused": refused, "not_offered": not_offered}


def write_reference(directory: Path, settings_class, image_path, spec: dict, items, arrays) -> None:
    """Full compute's images as a `diffq qualify --reference DIR` (qualify's own format:
    its Settings, images/HxW/N.png), made on this device."""
    from PIL import Image

    from diffq.app.qualify import REFERENCE_FILE

    size = spec["size"]
    settings = settings_class(model=spec["model"], prompts=[i.prompt for i in items], seeds=[i.seed for i in items],
                              shapes=[(size, size)], parity_shapes=[(size, size)], batch_size=len(items),
                              steps=spec["steps"], guidance_scale=spec["guidance_scale"],
                              max_sequence_length=spec["max_sequence_length"])
    for index, array in enumerate(arrays):
        path = image_path(directory, size, size, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(path, format="PNG")
    made_with = {"device": spec["device"], "note": "bench.gpu (c): full compute on the device under test"}
    (directory / REFERENCE_FILE).write_text(json.dumps({"settings": dataclasses.asdict(settings),
                                                        "made_with": made_with}, indent=2) + "\n")


def child_loras(spec: dict) -> dict:
    """LoRA files for the built model's transformer, one per rank, without loading its
    weights (a FLUX.1-dev-sized one is 24 GB): the transformer made on the meta device,
    PEFT's adapter added to the tiny adapters' targets, each A and B drawn at random on
    the host (B scaled as the tiny adapters' are, so a change shows in the images)."""
    import diffusers
    import torch
    from accelerate import init_empty_weights
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    from diffq.app.tiny import TINY_LORA_GAIN, TINY_LORA_TARGETS

    config = DiffusionPipeline.load_config(spec["model"])
    pipeline_class = getattr(diffusers, config["_class_name"])
    transformer_class = getattr(diffusers, config["transformer"][1])
    with init_empty_weights():
        transformer = transformer_class.from_config(transformer_class.load_config(spec["model"],
                                                                                  subfolder="transformer"))
    out, paths, size = Path(spec["out"]), [], 0
    generator = torch.Generator().manual_seed(0)
    for k, rank in enumerate(spec["ranks"]):
        name = f"lora{k}"
        with init_empty_weights():
            transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TINY_LORA_TARGETS)),
                                    adapter_name=name)
        layers = {}
        for key, meta in get_peft_model_state_dict(transformer, adapter_name=name).items():
            fan_in = meta.shape[1]
            value = torch.randn(tuple(meta.shape), generator=generator) / fan_in ** 0.5
            layers[key] = (value * TINY_LORA_GAIN if ".lora_B." in key else value).to(torch.bfloat16)
        path = out / f"{name}-r{rank}.safetensors"
        out.mkdir(parents=True, exist_ok=True)
        pipeline_class.save_lora_weights(str(out), transformer_lora_layers=layers, weight_name=path.name)
        paths.append(str(path))
        size += path.stat().st_size
    return {"paths": paths, "ranks": spec["ranks"], "targets": list(TINY_LORA_TARGETS), "bytes": size}


CHILDREN = {"build": child_build, "bare": child_bare, "speedups": child_speedups, "loras": child_loras}


# --- the chart ---------------------------------------------------------------------


def chart(result: dict, path: Path) -> None:
    """Three panels from whatever has been measured so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["figures"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": (1, 1, 1.3)})
    device = result.get("device", {}).get("torch_device", "?")
    fig.suptitle(f"bench.gpu, {result['scale']['name']} on {device}: {result['scale']['size']}², "
                 f"{result['scale']['steps']} steps")
    a = {k: v for k, v in steps.get("a", {}).items() if k.startswith("batch ")}
    ax = axes[0]
    for offset, (side, label) in enumerate((("bare_images_per_s", "bare loop"), ("diffq_images_per_s", "diffq run"))):
        ax.bar([i + 0.4 * offset for i in range(len(a))], [v[side] for v in a.values()], width=0.4, label=label)
    ax.set_xticks([i + 0.2 for i in range(len(a))], list(a))
    ax.set_title("(a) whole process, images/s")
    ax.legend()
    b = steps.get("b", {})
    ax = axes[1]
    modes = [m for m in b if isinstance(b[m], dict)]
    for offset, (key, label) in enumerate((("cold_time_to_first_image_s", "cold"),
                                           ("warm_time_to_first_image_s", "warm (cache)"))):
        ax.bar([i + 0.4 * offset for i in range(len(modes))], [b[m].get(key) or 0 for m in modes], width=0.4,
               label=label)
    ax.set_xticks([i + 0.2 for i in range(len(modes))], modes)
    ax.set_title("(b) time to first image, s")
    ax.legend()
    rows = [r for r in steps.get("c", {}).get("speedups", {}).get("rows", []) if "time_vs_full" in r]
    ax = axes[2]
    ax.barh(range(len(rows)), [r["time_vs_full"] for r in rows],
            color=["tab:green" if r["same_in_other_composition"] else "tab:red" for r in rows])
    ax.set_yticks(range(len(rows)), [r["speedup"].replace("pyramidattentionbroadcast", "pab") for r in rows],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_title("(c) s/image over full compute's\n(red: an item's pixels change with its neighbours)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --- docs/BENCHMARKS.md's section -------------------------------------------------


SAVED = ROOT / "docs" / RESULT  # a device run's gpu.json, copied into docs/ with its chart


def render(result: dict | None) -> list[str]:
    """The "On an H200" section: how to run it, the anchors, what random weights say, and
    the figures of a device run's gpu.json where one was committed (docs/gpu.json)."""
    lines = ["## On an H200", "",
             "`python -m bench.gpu --out DIR`: FLUX.1-dev's own sizes with random weights (transformer 19 + 38 "
             "blocks, 24 heads x 128; its VAE; CLIP-L; T5 at T5-XXL's width with 2 of its 24 layers, the rest "
             "~9.5 GB of disk and load time for ~1 % of a step), built on the GPU in bf16 and saved once; 1024², "
             "28 steps, 512 text tokens, guidance 3.5. In order, so that a call cut short keeps the first: (a) the "
             "whole `diffq run` (embedded broker, `--device cuda`, defaults) against the bare diffusers loop on "
             "the same prompts and seeds, one process each, at batch 1 and the best batch size (goal: ≥ 0.97 x "
             "the bare loop's images/s); (b) `--compile regional` and `full`: cold compile, steady s/image, a "
             "second process's time to first image from the compile cache; (c) every speed-up qualify offers on "
             "CUDA: s/image and PSNR/SSIM against full compute at the same batch size, and whether an item's "
             "pixels are identical in another composition of the same batch size and, apart, at batch size 1; "
             "(d) `diffq qualify --speedups` on the shape, its profile then driving a `diffq run` (judged against "
             "(c)'s full-compute images saved as its `--reference`: qualify's default CPU float32 reference of a "
             "12B-parameter transformer would need ~48 GB of host memory and outlast the call); (e) `diffq "
             "qualify --lora A,B --lora-mode swap --compile regional` and the same with `fuse` and `compile` ( two random "
             "adapters of ranks 8 and 16 over the attention projections): graphs after the first batch, whether "
             "each change showed, the change's time, s/image with and without adapters — the figures that settle "
             "the device's LoRA mode (issue 59).", "",
             "To run it (a session lent the `device` tool's H200; 15 minutes of device time in all):", "",
             "1. here: `.venv/bin/python -m bench.gpu --wheels .whl` (the cp312 wheels the device machine lacks, "
             "at the versions the suite ran, and a check that the tree and wheels fit the 64 MiB a call carries: "
             "on 2026-12-04, 23 wheels, 11.8 MiB, with the tree 15.2 MiB; torchao, carried since, adds 3.2 MiB);",
             "2. the device tool's `run` with `command: bash bench/gpu_device.sh`, `carry: [\".whl\"]`, "
             "`timeout_s: 420` (bench.gpu stops itself at 330 s and writes `gpu.json`, `gpu.png` and `gpu.log` "
             "under `$OUT` after each figure); what the deadline cut, in a second call right after (the machine "
             "still warm: the pipeline kept under /tmp is loaded, not built again, and the first call's figures "
             "carry on into the second's `gpu.json`): `PARTS=b,c,d,e bash bench/gpu_device.sh` (the LoRA modes alone: `PARTS=c,e`, (c) giving (e) its reference);",
             "3. copy `gpu.json` and `gpu.png` into docs/ and `python -m bench --render`.", "",
             "Published anchors on the same work (same model, resolution and steps):", ""]
    lines += [f"- {anchor}" for anchor in ANCHORS] + [
        "", "Random weights: the timings are real (the same shapes, kernels and bytes as the trained model); "
        "PSNR and SSIM against full compute show the mechanism only (a random model's trajectories are smooth, so "
        "a step cache loses far less there than on the trained one); whether an item's pixels depend on its "
        "batch is a property of the kernels, and holds for any weights.", ""]
    if not result:
        return lines + ["**No figures yet**: no session lent an H200 has run it (issue 52).", ""]
    figures, device = result["figures"], result.get("device", {})
    versions = result.get("versions", {})
    lines += [f"Measured on {device.get('nvidia_smi') or device.get('torch_device')}: torch {versions.get('torch')} "
              f"(CUDA {versions.get('cuda')}), diffusers {versions.get('diffusers')}, transformers "
              f"{versions.get('transformers')}; {result['wall_s']} s in all"
              + (f"; cut: {'; '.join(result['cut'])}" if result["cut"] else "") + ".", ""]
    build = figures.get("build", {})
    lines += [f"Built and saved in {build.get('build_and_save_s')} s ({build.get('on_disk_gb')} GB on disk"
              + (f"; {build['config']['shrunk']}" if build.get("config", {}).get("shrunk") else "") + ").", ""]
    a = {k: v for k, v in figures.get("a", {}).items() if k.startswith("batch ")}
    if a:
        lines += ["| (a) batch | items | bare images/s | diffq images/s | whole process x bare | steady call x bare "
                  "| bare load s | diffq first image s | idle gap ms |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {k[6:]} | {v['items']} | {v['bare_images_per_s']} | {v['diffq_images_per_s']} | "
                  f"**{v['whole_ratio']}** | {v.get('steady_ratio', '–')} | {v['bare_load_s']} | "
                  f"{v['diffq_start'].get('time_to_first_image_s', '–')} | {v['diffq_idle_gap_ms']} |"
                  for k, v in a.items()] + [""]
    b = figures.get("b", {})
    if any(isinstance(v, dict) for v in b.values()):
        lines += ["| (b) compile | batch | compile s | steady s/image | cold first image s | warm first image s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {mode} | {v['batch_size']} | {v['compile_s']} | {v['steady_s_per_image']} | "
                  f"{v['cold_time_to_first_image_s']} | {v.get('warm_time_to_first_image_s', 'cut')} |"
                  for mode, v in b.items() if isinstance(v, dict)] + [""]
    c = figures.get("c", {}).get("speedups")
    if c:
        lines += [f"(c) at batch size {c['batch_size']}:", "",
                  "| speed-up | s/image | x full | PSNR min dB | SSIM min | same pixels, other neighbours | "
                  "same pixels, batch 1 |", "|---|---|---|---|---|---|---|"]
        lines += [f"| `{r['speedup']}` | " + (f"failed: {r['error']} | | | | | |" if "error" in r else
                  f"{r['s_per_image']} | {r['time_vs_full']} | {r.get('psnr_min', '–')} | {r.get('ssim_min', '–')} | "
                  f"{'yes' if r['same_in_other_composition'] else 'no (max %d)' % r['max_diff_other_composition']} | "
                  f"{'yes' if r['same_at_batch_1'] else 'no (max %d)' % r['max_diff_at_batch_1']} |")
                  for r in c["rows"]] + [""]
    d = figures.get("d", {})
    if "qualify" in d:
        chosen = (d["qualify"]["chosen"] or [None])[0] or {}
        lines += [f"(d) `diffq qualify --speedups`: {d['qualify']['process_s']} s, chose "
                  f"`{chosen.get('speedup') or 'full compute'}` at batch size {chosen.get('batch_size')}"
                  + (f"; the run with its profile: {d['run with the profile']['steady_s']} s a batch"
                     if "run with the profile" in d else "") + ".", ""]
    e = {mode: found for mode, found in figures.get("e", {}).items() if mode in LORA_MODES}
    if e:
        lines += ["(e) `diffq qualify --lora` per mode (`--compile regional`):", "",
                  "| mode | check | graphs after the first batch | change s (median) | s/image without | "
                  "s/image with |", "|---|---|---|---|---|---|"]
        lines += [f"| {mode} | {(r.get('check') or {}).get('status', 'exit %s' % r.get('exit'))} | "
                  f"{r['graphs_after_first']} | {(r.get('swap_s') or {}).get('median', '–')} | "
                  f"{r.get('s_per_image_without', '–')} | {r.get('s_per_image_with', '–')} |"
                  for mode, r in e.items()] + [""]
    return lines + ["![bench.gpu](gpu.png)", ""]


# --- the wheels the device machine lacks --------------------------------------------


def uncarried(root: str = "diffq") -> list[str]:
    """`root`'s runtime dependency closure, as installed here (requirement markers read
    for the device's CPython 3.12 on Linux, an extra only where a requirement names it),
    that neither the device image holds nor CARRIED carries, LEFT_BEHIND apart: what
    the GPU run would fail to import there. Empty when the wheel list is whole."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    carried, left = {canonicalize_name(n) for n in CARRIED}, {canonicalize_name(n) for n in LEFT_BEHIND}
    image = {canonicalize_name(n) for n in DEVICE_IMAGE}
    environment = {**default_environment(), **DEVICE_PYTHON}
    missing, seen, stack = set(), set(), [(root, frozenset())]
    while stack:
        name, extras = stack.pop()
        for line in metadata.requires(name) or ():
            need = Requirement(line)
            if need.marker and not any(need.marker.evaluate({**environment, "extra": extra})
                                       for extra in (extras or {""})):
                continue
            dist = canonicalize_name(need.name)
            if dist in left or dist in image or (dist, frozenset(need.extras)) in seen:
                continue
            seen.add((dist, frozenset(need.extras)))
            if dist not in carried:
                missing.add(dist)
            try:
                stack.append((need.name, frozenset(need.extras)))
                metadata.distribution(need.name)
            except metadata.PackageNotFoundError:
                stack.pop()  # not installed here: its own needs unknown, itself already counted
                missing.add(dist)
    return sorted(missing)


def download_wheels(folder: Path) -> dict:
    """CARRIED at the versions installed here, cp312 manylinux x86_64, no dependencies
    (each is named); and what the tree plus the wheels weigh against the 64 MiB a call carries."""
    from importlib.metadata import version

    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version(name)}" for name in CARRIED]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *pins],
                   check=True)
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((ROOT / name.decode()).stat().st_size for name in tracked if name and (ROOT / name.decode()).is_file())
    wheels = sum(f.stat().st_size for f in folder.glob("*.whl"))
    found = {"wheels": len(list(folder.glob("*.whl"))), "wheels_mib": round(wheels / 2**20, 1),
             "tree_mib": round(tree / 2**20, 1), "total_mib": round((tree + wheels) / 2**20, 1),
             "limit_mib": CARRY_LIMIT_MB}
    print(json.dumps(found), flush=True)
    if tree + wheels > CARRY_LIMIT_MB * 2**20:
        raise SystemExit(f"the tree and wheels weigh {found['total_mib']} MiB, over the {CARRY_LIMIT_MB} MiB a call carries")
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where gpu.json and gpu.png are written")
    parser.add_argument("--tiny", action="store_true", help="the tiny FLUX.1 pipeline on the CPU (a dry run)")
    parser.add_argument("--deadline", type=float, default=330.0, help="seconds for everything (default 330)")
    parser.add_argument("--parts", default=",".join(PARTS), help="which of a,b,c,d,e to run, in order")
    parser.add_argument("--items", type=int, help="images per process in (a), per batch size (x the batch size)")
    parser.add_argument("--keep-model", action="store_true",
                        help="keep the built pipeline under the temp dir, and load it from there if a run kept it")
    parser.add_argument("--lora-modes", default=",".join(LORA_MODES), help="(e)'s LoRA modes, in order")
    parser.add_argument("--wheels", type=Path, metavar="DIR", help="download the wheels the device lacks into DIR")
    parser.add_argument("--child", nargs=2, metavar=("ROLE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        role, path = args.child
        spec = json.loads(Path(path).read_text())
        found = CHILDREN[role](spec)
        Path(spec["result"]).write_text(json.dumps(found, default=str))
        return found
    if args.wheels:
        return download_wheels(args.wheels)
    if args.out is None:
        parser.error("--out DIR is required")
    parts = tuple(p for p in args.parts.split(",") if p)
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))} (a, b, c, d, e)")
    scale = TINY if args.tiny else REAL
    lora_modes = tuple(m for m in args.lora_modes.split(",") if m)
    if unknown := set(lora_modes) - set(LORA_MODES):
        parser.error(f"--lora-modes: unknown {', '.join(sorted(unknown))} ({', '.join(LORA_MODES)})")
    return Bench(scale, args.out, args.deadline, parts, args.items or scale.items, args.keep_model, lora_modes).run()


if __name__ == "__main__":
    main()
