"""A run's items per LoRA adapter set, and the graphs its batches compiled per shape.

Per set, done / failed / pending (`status --by-adapter`, `report`): from the progress
summary (core/progress.py: each credit and failure names its set's short digest,
core/adapters.py set_digest) against the manifest's `adapter_sets`, never from the
records: a few segment reads whatever the run's size (`sets_from_summary`). A run
submitted before manifests listed their sets has no such view (None): callers fall back
to the records (`ByAdapter`) and say so.

Images/s, swap seconds and graphs from the image records alone (`ImageRecord.adapters`, `adapter_swap_s`,
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

import os
from dataclasses import dataclass, field

from diffq.core.records import ImageRecord, RunManifest

NONE = "none"  # the group of rows without an adapter
UNNAMED = "(unnamed)"  # items credited by workers that did not name their set


def adapter_key(record: ImageRecord) -> tuple[tuple[str, str | None, float], ...]:
    """(path, revision, scale) of each adapter the image was made with; () for none."""
    return tuple((a["path"], a.get("revision"), float(a.get("scale", 1.0))) for a in record.adapters or ())


def short_paths(paths) -> dict[str, str]:
    """Each path without the folders every one of them shares (and a .safetensors
    suffix): what tells a run's adapters apart, not where they all live."""
    paths = sorted(set(paths))
    split = [path.rstrip("/").split("/") for path in paths]
    common = 0
    if len(split) > 1:
        for parts in zip(*(parts[:-1] for parts in split)):
            if len(set(parts)) > 1:
                break
            common += 1
    else:
        common = len(split[0]) - 1 if split else 0
    return {path: os.path.splitext("/".join(parts[common:]))[0] if parts[-1].endswith(".safetensors")
            else "/".join(parts[common:]) for path, parts in zip(paths, split)}


def adapter_label(key: tuple[tuple[str, str | None, float], ...], short: dict[str, str] | None = None) -> str:
    if not key:
        return NONE
    short = short or {}
    return " + ".join(f"{short.get(path, path)}@{scale:g}" for path, _revision, scale in key)


def render_table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Text lines of a table (report's and status' text, the same cells as the HTML's)."""
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]

    def line(cells) -> str:
        return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers)] + [line(row) for row in rows]


@dataclass
class SetCounts:
    """One adapter set of a run: its items as submitted and where they stand."""

    digest: str | None  # None: credits without a set (workers before sets were credited)
    adapters: list[dict]  # path, revision, scale
    items: int | None  # None: not in the manifest
    done: int = 0
    failed: int = 0
    modes: set = field(default_factory=set)
    label: str = ""

    @property
    def pending(self) -> int | None:
        return None if self.items is None else max(0, self.items - self.done - self.failed)

    @property
    def mode(self) -> str:
        return "+".join(sorted(self.modes)) or "-"

    def to_json(self) -> dict:
        return {"set": self.digest, "label": self.label, "adapters": self.adapters, "lora_mode": self.mode,
                "items": self.items, "done": self.done, "failed": self.failed, "pending": self.pending}


SET_HEADERS = ["set", "adapters", "mode", "items", "done", "failed", "pending"]


def set_cells(rows: list[SetCounts]) -> list[list[str]]:
    """The per-set table's cells (status' text, report's text and HTML)."""
    return [[row.digest or "-", row.label, row.mode, "-" if row.items is None else str(row.items), str(row.done),
             str(row.failed), "-" if row.pending is None else str(row.pending)] for row in rows]


def sets_from_summary(manifest: RunManifest, progress) -> list[SetCounts] | None:
    """Done / failed / pending per adapter set from a refreshed ProgressSummary; None for
    a run whose manifest lists no sets (no adapters, or submitted before sets were listed)."""
    if not manifest.adapter_sets:
        return None
    short = short_paths(ref.path for entry in manifest.adapter_sets.values() for ref in entry.adapters)
    rows = []
    for digest, entry in manifest.adapter_sets.items():
        key = tuple((ref.path, ref.revision, float(ref.scale)) for ref in entry.adapters)
        rows.append(SetCounts(digest=digest, adapters=[{"path": p, "revision": r, "scale": s} for p, r, s in key],
                              items=entry.items, done=progress.done_per_set.get(digest, 0),
                              failed=progress.failed_per_set.get(digest, 0),
                              modes=set(progress.modes_per_set.get(digest, ())), label=adapter_label(key, short)))
    rows.sort(key=lambda row: (-row.items, row.label))
    # Rows without adapters, and credits from workers that named no set, share the None
    # digest: what is left of it after the rows without adapters is unnamed.
    without = manifest.total - sum(entry.items for entry in manifest.adapter_sets.values())
    unnamed_done = progress.done_per_set.get(None, 0)
    unnamed_failed = progress.failed_per_set.get(None, 0)
    if without or unnamed_done or unnamed_failed:
        rows.append(SetCounts(digest=None, adapters=[], items=without, done=unnamed_done, failed=unnamed_failed,
                              modes=set(progress.modes_per_set.get(None, ())), label=NONE))
    return rows


def set_lines(rows: list[SetCounts]) -> list[str]:
    """The per-set table as text."""
    return render_table(SET_HEADERS, set_cells(rows), right={3, 4, 5, 6})


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
        return adapter_label(self.key, short_paths(path for path, _, _ in self.key))

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

    def labels(self) -> dict[tuple, str]:
        """Each group's label, its paths shortened to what tells them apart (a revision
        added only where two groups would read the same)."""
        short = short_paths(path for key in self.groups for path, _, _ in key)
        labels = {key: adapter_label(key, short) for key in self.groups}
        seen: dict[str, int] = {}
        for label in labels.values():
            seen[label] = seen.get(label, 0) + 1
        return {key: label if seen[label] == 1 else label + " (" + ",".join((r or "-")[:19] for _, r, _ in key) + ")"
                for key, label in labels.items()}

    HEADERS = ["adapters (path@scale)", "mode", "images", "batches", "img/s", "swap_s"]

    def cells(self) -> list[list[str]]:
        """The adapter table's cells: the text report's and the HTML page's rows."""
        labels = self.labels()
        return [[labels[g.key], g.mode, str(g.images), str(g.batches), f"{g.images_per_s:.2f}", f"{g.swap_s:.3f}"]
                for g in sorted(self.groups.values(), key=lambda g: (bool(g.key), labels[g.key]))]

    def lines(self) -> list[str]:
        """The report's text section (empty for a run without adapters)."""
        if not self.with_adapters:
            return []
        return ["", *render_table(self.HEADERS, self.cells(), right={2, 3, 4, 5})] + [
            f"  {worker}: {changed} set change(s) over {batches} batch(es)"
            for worker, (changed, batches) in sorted(self.changes.items())]

    def to_json(self) -> dict:
        return {"adapters": [g.to_json() for g in self.rows()],
                "set_changes": {worker: {"changes": changed, "batches": batches}
                                for worker, (changed, batches) in sorted(self.changes.items())},
                "graphs": {queue: graphs.to_json() for queue, graphs in sorted(self.graphs.items())}}
