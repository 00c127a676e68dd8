"""A simulated device for benchmarks (bench only: not a backend, not in the product's
device list).

`StandInPipeline` answers a pipeline call the way a fast accelerator does: it waits
`device_s` seconds per image of the batch in `time.sleep` (the GIL is free for the
worker's other threads, as when a kernel runs) and returns B images of the asked
H×W with realistic content. The wait is read from each batch's first prompt
(`device_s=0.0500`), so one run can sweep the device's speed. The images are
precomputed once per size (smooth structure, hard edges, texture that varies by
region, fine grain), so PNG/JPEG/WebP encoders meet the sizes and encode times of
real 1024² outputs rather than noise or flat colour; each call hands them over.

It enters a real worker through `device_child_main`, which the bench puts in place
of the supervisor's child entry point: the child sets its pinning environment,
swaps `PipelineHost._load` for folders holding `standin.json`, then runs the
unchanged `child_main` (Celery worker, batch task, sink helper, acks).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from bench import stamps

MARKER = "standin.json"
# Set: the sink helper gets its pixels through the socket, not shared memory (bench only).
SOCKET_PIXELS = "DIFFQ_BENCH_SOCKET_PIXELS"
# The family whose call arguments the stand-in takes: the producer and the host
# check a model folder's class against the family table (diffq/core/families.py).
FAMILY_CLASS = "Flux2KleinPipeline"
POOL = 8  # distinct images per size
_DEVICE_S = re.compile(r"device_s=([0-9.]+)")

_pools: dict[tuple[int, int], list] = {}
_tensors: dict[tuple[int, int], object] = {}
_pools_lock = threading.Lock()


def _smooth(rng, height: int, width: int, cells: int, channels: int = 3):
    """A field with about `cells` features across: random values, bicubic-upsampled."""
    import numpy as np
    from PIL import Image

    planes = [Image.fromarray((rng.random((cells, cells)) * 255).astype(np.uint8)).resize((width, height),
                                                                                         Image.BICUBIC)
              for _ in range(channels)]
    return np.stack([np.asarray(plane, dtype=np.float32) for plane in planes], axis=-1) / 255


def synth_image(seed: int, height: int, width: int):
    """A photo-like RGB image: colour structure over three scales, a region with hard
    edges, texture whose strength varies by region (sky vs grass) and sensor grain."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = (0.55 * _smooth(rng, height, width, 3) + 0.3 * _smooth(rng, height, width, 9)
            + 0.15 * _smooth(rng, height, width, 40))
    region = _smooth(rng, height, width, 6, 1)[..., 0] > 0.5
    tint = rng.random(3).astype(np.float32)
    base = np.where(region[..., None], 0.6 * base + 0.4 * tint, base)
    texture = _smooth(rng, height, width, max(8, width // 6), 1) - 0.5  # features ~6 px
    strength = _smooth(rng, height, width, 5, 1) ** 2 * 2
    grain = rng.normal(0, 3.0, (height, width, 1)).astype(np.float32)
    pixels = base * 255 + texture * 60 * strength + grain * (0.3 + strength)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def image_pool(height: int, width: int) -> list:
    """POOL distinct images of one size, made once per process."""
    with _pools_lock:
        if (height, width) not in _pools:
            _pools[(height, width)] = [synth_image(1000 + n, height, width) for n in range(POOL)]
        return _pools[(height, width)]


def pool_tensor(height: int, width: int, count: int):
    """`count` of the pool's images (cycled) as one count×H×W×3 uint8 tensor, made once."""
    import numpy as np
    import torch

    with _pools_lock:
        cached = _tensors.get((height, width))
    if cached is None or len(cached) < count:
        pool = image_pool(height, width)
        cached = torch.from_numpy(np.stack([np.asarray(pool[n % len(pool)]) for n in range(max(count, len(pool)))]))
        with _pools_lock:
            _tensors[(height, width)] = cached
    return cached[:count]


def device_seconds(prompt: str) -> float:
    found = _DEVICE_S.search(prompt)
    if not found:
        raise ValueError(f"stand-in prompt {prompt!r} does not say device_s=<seconds per image>")
    return float(found[1])


class StandInPipeline:
    """The pipeline call of a device that takes `device_s` per image and holds no GIL."""

    def __init__(self, folder: str | Path = ""):
        self.folder = str(folder)
        self.calls = 0
        self.busy_s = 0.0  # wall seconds inside calls
        self.cpu_s = 0.0  # CPU seconds of the calling thread inside calls

    def to(self, *_args, **_kwargs):
        return self

    def set_progress_bar_config(self, **_kwargs) -> None:
        pass

    def __call__(self, prompt, height: int = 1024, width: int = 1024, num_inference_steps: int = 1,
                 guidance_scale: float = 1.0, max_sequence_length: int = 64, generator=None,
                 output_type: str = "pil", **_family_arguments):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        stamps.stamp(stamps.DEVICE + ">")
        started, cpu_started = time.perf_counter(), time.thread_time()
        deadline = started + device_seconds(prompts[0]) * len(prompts)
        if output_type == "pt":
            # What an accelerator hands back for "pt", already scaled to 8 bits on the
            # device: a B×3×H×W view of the pool's channel-last pixels, so the host's
            # to_arrays (worker/device/pipeline_host.py) costs nothing, as after a DMA.
            images = pool_tensor(height, width, len(prompts)).permute(0, 3, 1, 2)
        else:
            pool = image_pool(height, width)
            seeds = [generator_seed(g, n) for n, g in enumerate(generator or [None] * len(prompts))]
            # The pool's own images, not copies: the sink only reads them, and a copy per
            # item would be the stand-in's CPU, not the host side this bench measures.
            images = [pool[seed % len(pool)] for seed in seeds]
        stamps.flush()  # bench.phases' stamps, if on: written while the "device" runs
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)  # releases the GIL, like a kernel running on the device
        stamps.stamp(stamps.DEVICE + "<")
        self.calls += 1
        self.busy_s += time.perf_counter() - started
        self.cpu_s += time.thread_time() - cpu_started
        return SimpleNamespace(images=images)


def generator_seed(generator, default: int) -> int:
    return int(generator.initial_seed()) if generator is not None else default


def write_standin(folder: Path) -> Path:
    """A model folder the embedded runner accepts (model_index.json) and the patched
    host loads as the stand-in (standin.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": FAMILY_CLASS}))
    (folder / MARKER).write_text(json.dumps({"images_per_size": POOL}))
    return folder


def install() -> None:
    """In a worker process: load the stand-in for folders holding standin.json."""
    from diffq.worker.device import pipeline_host

    original = pipeline_host.PipelineHost._load
    if getattr(original, "standin", False):
        return

    def _load(self, model: str, *rest):
        # `rest`: the key's other parts, as the host passes them (dtype, scheme, …): the
        # stand-in keys its family as the host keys its pipeline, whatever the key holds.
        if (Path(model) / MARKER).is_file():
            from diffq.core.families import family_of

            self._families[(model, *rest)] = family_of(model)  # what the host builds each call from
            return StandInPipeline(model)
        return original(self, model, *rest)

    _load.standin = True
    pipeline_host.PipelineHost._load = _load


def device_child_main(spec_json: str) -> None:
    """The supervisor's child entry point with the stand-in installed (spawned)."""
    from diffq.worker.process.child import child_main
    from diffq.worker.delivery.spec import ChildSpec

    # Pin first, as child_main does, since installing imports torch.
    os.environ.update(ChildSpec.model_validate_json(spec_json).env())
    install()
    stamps.install()  # DIFFQ_BENCH_PHASES: time stamps per step between two calls
    if os.environ.get(SOCKET_PIXELS):  # the hand-off before shared-memory slots, for comparison
        from diffq.worker.sink import helper as sink_process

        sink_process._slots_available = lambda: False
    child_main(spec_json)
