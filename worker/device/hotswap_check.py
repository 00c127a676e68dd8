"""`qualify --lora A,B [--lora-mode M]`'s check: changing a run's adapter set keeps the
compiled graphs (or, under `--lora-mode compile`, compiles once per new set), and shows.

On this device and compile mode, through the pipeline host a worker serves with
(PipelineHost.use_adapters, worker/device/adapters.py): the scaffold for the adapters'
layout before the compile, a first batch without an adapter (it compiles, unless the
host already served the shape), then per adapter one batch with it and one with only its
scale changed, and back to none. Each of those batches must compile 0 graphs; its swap
time is what that change of adapter set costs a batch. And each change must be seen in
the images: a device whose graphs baked the LoRA weights or scalings in as constants
(backends.py, the TPU row) would compile nothing and change nothing. An adapter's batch
must differ from the no-adapter batch, a scale change from the batch before it, and
back to none must give the first batch's pixels again (within BACK_TO_NONE_LEVELS).
The host's own change check (lora_apply.ChangeCheck) runs at the first adapter batch; a
change it did not see ends the check there, its reason said (`refused`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from diffq.core import adapters as A
from diffq.core.contract import AdapterRef, BatchItem, BatchParams, ShapeKey
from diffq.worker.device.lora_apply import LoraChangeUnseen
from diffq.worker.device.pipeline_host import PipelineHost

# What each checked batch changes in the slot.
ADAPTER, SCALE, NONE = "adapter", "scale", "none"
# Back to no adapter: the same graphs on the same inputs as the first batch. Allowed a
# level of 8-bit difference for a device whose kernels are not bitwise reproducible run
# to run; a stale adapter left in the slot moves pixels by far more (tests/test_lora.py).
BACK_TO_NONE_LEVELS = 1


def other_scale(scale: float) -> float:
    """The scale a scale-only change goes to: half the adapter's own (1.0 from 0)."""
    return scale / 2 if scale else 1.0


@dataclass(frozen=True)
class Swap:
    change: str  # ADAPTER (another adapter into the slot), SCALE (its scale only), NONE (the scaffold's zeros)
    adapter: str | None  # the adapter's path; None: no adapter
    scale: float | None
    graphs_compiled: int
    swap_s: float
    generate_s: float
    vs_none: int  # max abs difference from the first (no-adapter) batch, 8-bit levels
    vs_previous: int  # the same, from the batch before

    @property
    def unseen(self) -> str | None:
        """Why the images say this change did not take effect, or None."""
        if self.change == ADAPTER and self.scale and not self.vs_none:
            return f"{self.adapter}@{self.scale:g}: the same pixels as without an adapter"
        if self.change == SCALE and not self.vs_previous:
            return f"{self.adapter}@{self.scale:g}: the same pixels as at its previous scale"
        if self.change == NONE and self.vs_none > BACK_TO_NONE_LEVELS:
            return f"back to none: {self.vs_none} levels from the first no-adapter batch (a stale adapter?)"
        return None


@dataclass
class HotswapCheck:
    layout: A.AdapterLayout
    first_graphs: int  # the first batch's compile (no adapter; 0 when the host had served the shape)
    mode: str = "swap"
    first_generate_s: float = 0.0
    batch_size: int = 1
    swaps: list[Swap] = field(default_factory=list)
    refused: str | None = None  # the host's change check did not see a change: why
    change_check: dict | None = None  # its probe: moved and noise

    @property
    def unseen(self) -> list[str]:
        return [why for swap in self.swaps if (why := swap.unseen)]

    @property
    def recompiled(self) -> list[Swap]:
        """Batches that compiled where none may: any under swap and fuse; under compile, a
        set seen before (back to none)."""
        return [swap for swap in self.swaps if swap.graphs_compiled and (self.mode != "compile"
                                                                           or swap.change == NONE)]

    @property
    def ok(self) -> bool:
        """No batch compiled a graph it should not have, and each change shows in the images."""
        return not self.recompiled and not self.unseen and self.refused is None

    def per_image(self, changes: tuple[str, ...]) -> float | None:
        """Median seconds per image of the batches of these changes (their calls)."""
        found = [swap.generate_s for swap in self.swaps if swap.change in changes]
        return round(statistics.median(found) / self.batch_size, 6) if found else None

    def seconds(self, change: str) -> dict | None:
        """The swap times of one kind of change: median, max and count."""
        found = [swap.swap_s for swap in self.swaps if swap.change == change]
        return {"median": round(statistics.median(found), 6), "max": round(max(found), 6),
                "count": len(found)} if found else None

    def to_json(self) -> dict:
        return {"ok": self.ok, "lora_mode": self.mode, "refused": self.refused, "change_check": self.change_check,
                "s_per_image_without": round(self.first_generate_s / self.batch_size, 6),
                "s_per_image_with": self.per_image((ADAPTER, SCALE)),
                "rank": self.layout.rank, "targets": len(self.layout.targets),
                "layout": self.layout.label, "first_graphs": self.first_graphs,
                "graphs_after_first": sum(swap.graphs_compiled for swap in self.swaps), "unseen": self.unseen,
                "recompiled": [f"{s.change} {s.adapter or 'none'} {s.graphs_compiled}" for s in self.recompiled],
                "swap_s": self.seconds(ADAPTER), "scale_change_s": self.seconds(SCALE), "none_s": self.seconds(NONE),
                "swaps": [{"change": s.change, "adapter": s.adapter, "scale": s.scale,
                           "graphs_compiled": s.graphs_compiled, "swap_s": round(s.swap_s, 6),
                           "generate_s": round(s.generate_s, 6), "vs_none": s.vs_none, "vs_previous": s.vs_previous}
                          for s in self.swaps]}


def _levels(a: list, b: list) -> int:
    """Max abs difference of two batches of 8-bit images."""
    return int(max(np.abs(np.asarray(x, dtype=np.int16) - np.asarray(y, dtype=np.int16)).max() for x, y in zip(a, b)))


def check_hotswap(host: PipelineHost, shape: ShapeKey, adapters: list[AdapterRef], layout: A.AdapterLayout, *,
                  steps: int = 1, guidance_scale: float = 1.0, items: list[BatchItem] | None = None) -> HotswapCheck:
    """Serve `adapters` (checked and pinned: core/adapters.py RunAdapters, whose `layout`
    is theirs) one batch each, then each again at another scale, on `host`: before it loads
    `shape.model`, or after, when the host was told this layout before it loaded."""
    host.use_adapters(shape.model, layout)
    items = items or [BatchItem(id=f"hotswap-{k}", prompt=f"a hot-swap check {k}", seed=k)
                      for k in range(shape.batch_size)]

    def batch(ref: AdapterRef | None):
        params = BatchParams(num_inference_steps=steps, guidance_scale=guidance_scale,
                             adapters=(ref,) if ref else ())
        return host.generate(shape, params, items)

    first = batch(None)
    result = HotswapCheck(layout=layout, first_graphs=first.graphs, mode=host.lora_mode,
                          first_generate_s=first.generate_s, batch_size=len(items))
    previous = first.images
    plan = [(change, ref) for one in adapters
            for change, ref in ((ADAPTER, one), (SCALE, one.model_copy(update={"scale": other_scale(one.scale)})))]
    for change, ref in [*plan, (NONE, None)]:
        try:
            generated = batch(ref)
        except LoraChangeUnseen as exc:
            result.refused = str(exc)
            break
        finally:
            if host.change_check is not None:
                result.change_check = {"moved": host.change_check.moved, "noise": host.change_check.noise,
                                       "showed": host.change_check.showed}
        result.swaps.append(Swap(change=change, adapter=ref.path if ref else None, scale=ref.scale if ref else None,
                                 graphs_compiled=generated.graphs, swap_s=generated.adapter_swap_s,
                                 generate_s=generated.generate_s, vs_none=_levels(generated.images, first.images),
                                 vs_previous=_levels(generated.images, previous)))
        previous = generated.images
    return result
