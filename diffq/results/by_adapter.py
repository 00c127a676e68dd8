"""A run's images grouped by LoRA adapter set, and the graphs its batches compiled per shape.

Both from the image records alone (`ImageRecord.adapters`, `adapter_swap_s`,
`graphs_compiled`), one batch at a time: `report` and `status --by-adapter` read them.

- an adapter group is one adapter set as the records name it: each adapter's path,
  pinned revision and scale (a scale is a group of its own: rows are batched by it);
  rows without an adapter are the group "none". Its images/s is over the device time
  its batches spent: their calls plus their hot-swaps; the LoRA modes its batches were
  made under (`lora_mode`: swap, fuse, compile; one unless workers were started apart);
- set changes per worker: its batches that changed the adapter set they found in the
  pipeline (`adapter_swap_s` > 0), against its batches: a worker meets sets in runs (rows
  of one set come in whole batches), which the `fuse` and `compile` modes count on;
- graphs per shape: the sum over its batches of `graphs_compiled`, and the part of it
  compiled by a batch that was not its worker's first of that shape: a steady-state
  recompile, which a hot-swap must never cause (0 when all is well).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffq.core.records import ImageRecord

NONE = "none"  # the group of rows without an adapter


def adapter_key(record: ImageRecord) -> tuple[tuple[str, str | None, float], ...]:
    """(path, revision, scale) of each adapter the image was made with; () for none."""
    return tuple((a["path"], a.get("revision"), float(a.get("scale", 1.0))) for a in record.adapters or ())


def adapter_label(key: tuple[tuple[str, str | None, float], ...]) -> str:
    if not key:
        return NONE
    return " + ".join(f"{path}@{scale:g}" + (f" ({revision[:19]})" if revision else "")
                      for path, revision, scale in key)


@dataclass
class AdapterGroup:
    key: tuple[tuple[str, str | None, float], ...]
    images: int = 0
    batches: int = 0
    generate_s: float = 0.0
    swap_s: float = 0.0
    modes: set = field(default_factory=set)  # the records' lora_mode (none before modes were recorded)

    @property
    def mode(self) -> str:
        return "+".join(sorted(self.modes)) or "-"

    @property
    def label(self) -> str:
        return adapter_label(self.key)

    @property
    def images_per_s(self) -> float:
        busy = self.generate_s + self.swap_s
        return self.images / busy if busy > 0 else 0.0

    def to_json(self) -> dict:
        return {"adapters": [{"path": p, "revision": r, "scale": s} for p, r, s in self.key],
                "lora_mode": self.mode, "images": self.images, "batches": self.batches, "generate_s": round(self.generate_s, 4),
                "swap_s": round(self.swap_s, 4), "images_per_s": round(self.images_per_s, 4)}


@dataclass
class ShapeGraphs:
    compiled: int = 0  # graphs its batches' calls compiled, all told
    # Per worker, its earliest batch of the shape: (call start, graphs it compiled).
    first: dict[str, tuple[float, int]] = field(default_factory=dict)

    @property
    def steady(self) -> int:
        """Graphs compiled by batches that were not their worker's first of the shape."""
        return self.compiled - sum(graphs for _, graphs in self.first.values())

    def to_json(self) -> dict:
        return {"compiled": self.compiled, "after_first_batch": self.steady}


@dataclass
class ByAdapter:
    """Accumulates one batch's first records at a time (runfolder.first_records)."""

    groups: dict[tuple, AdapterGroup] = field(default_factory=dict)
    graphs: dict[str, ShapeGraphs] = field(default_factory=dict)  # queue -> graphs
    changes: dict[str, list[int]] = field(default_factory=dict)  # worker -> [set changes, batches]

    def add(self, records: list[ImageRecord]) -> None:
        head = records[0]
        key = adapter_key(head)
        group = self.groups.setdefault(key, AdapterGroup(key=key))
        group.images += len(records)
        group.batches += 1
        group.generate_s += head.generate_s
        group.swap_s += head.adapter_swap_s
        counted = self.changes.setdefault(head.worker, [0, 0])
        counted[0] += head.adapter_swap_s > 0
        counted[1] += 1
        if head.lora_mode:
            group.modes.add(head.lora_mode)
        graphs = self.graphs.setdefault(head.queue, ShapeGraphs())
        graphs.compiled += head.graphs_compiled
        # A worker's first batch of a shape compiles (records are not in time order: the
        # earliest call wins). A worker name reused by a restart compiles again unseen here.
        earliest = graphs.first.get(head.worker)
        if earliest is None or head.generate_started_at < earliest[0]:
            graphs.first[head.worker] = (head.generate_started_at, head.graphs_compiled)

    @property
    def with_adapters(self) -> bool:
        return any(self.groups)  # a key is () for rows without an adapter

    def rows(self) -> list[AdapterGroup]:
        return sorted(self.groups.values(), key=lambda g: (bool(g.key), g.label))

    def lines(self) -> list[str]:
        """The report's text section (empty for a run without adapters)."""
        if not self.with_adapters:
            return []
        width = max(len(g.label) for g in self.groups.values())
        return ["", f"{'adapters (path@scale (revision))':<{max(width, 40) + 2}} mode     images  batches  img/s  "
                    f"swap_s"] + [
            f"  {g.label:<{max(width, 40)}} {g.mode:<8} {g.images:>6} {g.batches:>8} {g.images_per_s:>6.2f} "
            f"{g.swap_s:>7.3f}" for g in self.rows()] + [
            f"  {worker}: {changed} set change(s) over {batches} batch(es)"
            for worker, (changed, batches) in sorted(self.changes.items())]

    def to_json(self) -> dict:
        return {"adapters": [g.to_json() for g in self.rows()],
                "set_changes": {worker: {"changes": changed, "batches": batches}
                                for worker, (changed, batches) in sorted(self.changes.items())},
                "graphs": {queue: graphs.to_json() for queue, graphs in sorted(self.graphs.items())}}
