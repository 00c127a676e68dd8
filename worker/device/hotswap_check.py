"""`qualify --lora A,B`'s check: hot-swapping a run's adapters keeps the compiled graphs.

On this device and compile mode, through the pipeline host a worker serves with
(PipelineHost.use_adapters, worker/device/adapters.py): the scaffold for the adapters'
layout before the compile, a first batch without an adapter (it compiles), then one batch
per adapter and back to none. Each swap's batch must compile 0 graphs; its swap time is
what a change of adapter set costs a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffq.core import adapters as A
from diffq.core.contract import AdapterRef, BatchItem, BatchParams, ShapeKey
from diffq.worker.device.pipeline_host import PipelineHost


@dataclass(frozen=True)
class Swap:
    adapter: str | None  # None: back to no adapter (the scaffold's zeros)
    graphs_compiled: int
    swap_s: float
    generate_s: float


@dataclass
class HotswapCheck:
    layout: A.AdapterLayout
    first_graphs: int  # the first batch's compile (no adapter)
    swaps: list[Swap] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No swap's batch compiled a graph."""
        return all(swap.graphs_compiled == 0 for swap in self.swaps)

    def to_json(self) -> dict:
        return {"ok": self.ok, "rank": self.layout.rank, "targets": len(self.layout.targets),
                "first_graphs": self.first_graphs,
                "swaps": [{"adapter": s.adapter, "graphs_compiled": s.graphs_compiled, "swap_s": round(s.swap_s, 4),
                           "generate_s": round(s.generate_s, 4)} for s in self.swaps]}


def check_hotswap(host: PipelineHost, shape: ShapeKey, adapters: list[str], *, steps: int = 1,
                  guidance_scale: float = 1.0) -> HotswapCheck:
    """Serve `adapters` (paths, each checked from its header and fitted to the model) one
    batch each on `host`, which must not have loaded `shape.model` yet."""
    run = A.RunAdapters(shape.model)
    refs = [ref for index, path in enumerate(adapters) for ref in run.add(path, f"lora[{index}]")]
    layout = run.layout
    if layout is None:
        raise A.AdapterError("lora", "no adapter to check")
    host.use_adapters(shape.model, layout)
    items = [BatchItem(id=f"hotswap-{k}", prompt=f"a hot-swap check {k}", seed=k) for k in range(shape.batch_size)]

    def batch(ref: AdapterRef | None):
        params = BatchParams(num_inference_steps=steps, guidance_scale=guidance_scale,
                             adapters=(ref,) if ref else ())
        return host.generate(shape, params, items)

    result = HotswapCheck(layout=layout, first_graphs=batch(None).graphs)
    for ref in [*refs, None]:
        generated = batch(ref)
        result.swaps.append(Swap(adapter=ref.path if ref else None, graphs_compiled=generated.graphs,
                                 swap_s=generated.adapter_swap_s, generate_s=generated.generate_s))
    return result
