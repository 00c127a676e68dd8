"""Run report from the run folder alone: text, an HTML page with plots, a contact sheet.

Timings come from the records: each batch's record carries its worker, device,
`generate_s` (the pipeline call) and `finished_at` (when its images were stored).
From those:

- a worker's active span runs from its first batch's start (finished_at − generate_s)
  to its last batch's finish; device-hours are the sum of the spans, one worker
  being one device;
- compile time is estimated per (worker, shape) as the first batch's generate_s
  minus the median of the later ones (the first call pays for compilation);
- "storing / idle" is the span minus generate time: encoding and uploads overlap
  the next batch, so this is what the device spent not generating;
- cost per 1,000 images = price × device-hours / images × 1000.

Memory: one small tuple per batch, an 8-byte digest per item, a fixed-size sample.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import random
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from diffq.core.records import FailureRecord, ImageRecord
from diffq.core.runfolder import read_failures, read_manifest, read_records, record_keys
from diffq.core.storage import Storage, open_storage


@dataclass
class Batch:
    finished_at: float
    generate_s: float
    images: int
    worker: str
    device: str
    queue: str


@dataclass
class WorkerFigures:
    worker: str
    device: str
    images: int = 0
    batches: int = 0
    generate_s: float = 0.0
    compile_s: float = 0.0
    start: float = float("inf")
    end: float = 0.0

    @property
    def active_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def other_s(self) -> float:
        return max(0.0, self.active_s - self.generate_s)

    @property
    def images_per_s(self) -> float:
        return self.images / self.active_s if self.active_s else 0.0


@dataclass
class ShapeFigures:
    label: str
    queue: str
    total: int
    done: int = 0
    # Size buckets: (height, width, items) of the sizes asked for; empty without.
    requested: list[tuple[int, int, int]] = field(default_factory=list)
    requested_sizes: int = 0  # distinct sizes asked for (the manifest keeps the commonest)

    def requested_text(self, limit: int = 8) -> str:
        shown = ", ".join(f"{h}x{w} ({n})" for h, w, n in self.requested[:limit])
        more = self.requested_sizes - min(limit, len(self.requested))
        return shown + (f", +{more} more sizes" if more > 0 else "")


@dataclass
class Report:
    out: str
    run_id: str
    created_at: float
    total: int
    done: int
    failed: int
    shapes: list[ShapeFigures]
    workers: list[WorkerFigures]
    batches: list[Batch]
    failures: list[FailureRecord]
    sample: list[ImageRecord]
    price_per_device_hour: float | None = None
    errors: Counter = field(default_factory=Counter)

    @property
    def device_hours(self) -> float:
        return sum(w.active_s for w in self.workers) / 3600

    @property
    def wall_s(self) -> float:
        if not self.batches:
            return 0.0
        return max(b.finished_at for b in self.batches) - min(b.finished_at - b.generate_s for b in self.batches)

    @property
    def images_per_s(self) -> float:
        return self.done / self.wall_s if self.wall_s else 0.0

    @property
    def cost_per_1000(self) -> float | None:
        if self.price_per_device_hour is None or not self.done:
            return None
        return self.price_per_device_hour * self.device_hours / self.done * 1000

    def per_device(self) -> dict[str, dict]:
        devices: dict[str, dict] = defaultdict(lambda: {"workers": 0, "images": 0, "generate_s": 0.0, "active_s": 0.0})
        for w in self.workers:
            d = devices[w.device]
            d["workers"] += 1
            d["images"] += w.images
            d["generate_s"] += w.generate_s
            d["active_s"] += w.active_s
        return dict(devices)

    def throughput(self, bins: int = 40) -> tuple[list[float], list[float]]:
        """(seconds since the first batch started, images/s) per time bin."""
        if not self.batches:
            return [], []
        # Fewer bins than batches would show gaps between batches, not a rate.
        bins = max(1, min(bins, len(self.batches) // 2))
        start = min(b.finished_at - b.generate_s for b in self.batches)
        width = max(self.wall_s / bins, 1e-3)
        counts = [0] * bins
        for b in self.batches:
            counts[min(bins - 1, int((b.finished_at - start) / width))] += b.images
        return [width * (i + 0.5) for i in range(bins)], [c / width for c in counts]


def _estimate_compile(batches: list[Batch], workers: dict[str, WorkerFigures]) -> None:
    by_key: dict[tuple[str, str], list[Batch]] = defaultdict(list)
    for b in batches:
        by_key[(b.worker, b.queue)].append(b)
    for (worker, _), group in by_key.items():
        if len(group) < 2:
            continue
        group.sort(key=lambda b: b.finished_at)
        steady = statistics.median(b.generate_s for b in group[1:])
        workers[worker].compile_s += max(0.0, group[0].generate_s - steady)


def build_report(out: str, *, price_per_device_hour: float | None = None, sample_size: int = 24,
                 seed: int = 0) -> Report:
    """Read the run folder once (records, failures) and compute every figure of the report."""
    storage = open_storage(out)
    manifest = read_manifest(storage)
    shapes = {s.queue: ShapeFigures(label=f"{s.shape.height}x{s.shape.width}", queue=s.queue, total=s.items,
                                    requested=[(r.height, r.width, r.items) for r in s.requested],
                                    requested_sizes=s.requested_sizes)
              for s in manifest.shapes}
    workers: dict[str, WorkerFigures] = {}
    batches: list[Batch] = []
    seen: set[bytes] = set()
    sample: list[ImageRecord] = []
    rng = random.Random(seed)
    for _, records in read_records(storage, record_keys(storage)):
        new = []
        for record in records:
            digest = hashlib.blake2b(record.id.encode(), digest_size=8).digest()
            if digest not in seen:
                seen.add(digest)
                new.append(record)
        if not new:
            continue
        head = new[0]
        batch = Batch(finished_at=head.finished_at, generate_s=head.generate_s, images=len(new),
                      worker=head.worker, device=head.device, queue=head.queue)
        batches.append(batch)
        w = workers.setdefault(batch.worker, WorkerFigures(worker=batch.worker, device=batch.device))
        w.images += batch.images
        w.batches += 1
        w.generate_s += batch.generate_s
        w.start = min(w.start, batch.finished_at - batch.generate_s)
        w.end = max(w.end, batch.finished_at)
        if batch.queue in shapes:
            shapes[batch.queue].done += batch.images
        # Reservoir sampling: a uniform sample whatever the run size.
        for n, record in enumerate(new, start=len(seen) - len(new) + 1):
            if len(sample) < sample_size:
                sample.append(record)
            elif (j := rng.randrange(n)) < sample_size:
                sample[j] = record
    _estimate_compile(batches, workers)
    failures = list(read_failures(storage))
    failed_ids = {i for f in failures for i in f.item_ids
                  if hashlib.blake2b(i.encode(), digest_size=8).digest() not in seen}
    batches.sort(key=lambda b: b.finished_at)
    sample.sort(key=lambda r: r.id)
    return Report(out=storage.url, run_id=manifest.run_id, created_at=manifest.created_at, total=manifest.total,
                  done=len(seen), failed=len(failed_ids), shapes=list(shapes.values()),
                  workers=sorted(workers.values(), key=lambda w: w.worker), batches=batches, failures=failures,
                  sample=sample, price_per_device_hour=price_per_device_hour,
                  errors=Counter(f.error for f in failures))


def render_text(report: Report) -> str:
    lines = [f"run {report.run_id}  ·  {report.out}",
             f"items      {report.done}/{report.total} done, {report.failed} failed, "
             f"{report.total - report.done - report.failed} pending",
             f"throughput {report.images_per_s:.2f} images/s over {report.wall_s:.1f} s",
             f"devices    {len(report.workers)} workers, {report.device_hours:.4f} device-hours"]
    if report.cost_per_1000 is not None:
        lines.append(f"cost       {report.cost_per_1000:.4f} per 1,000 images "
                     f"at {report.price_per_device_hour:g} per device-hour")
    lines += ["", "shapes"]
    for s in report.shapes:
        lines.append(f"  {s.label:>11}  {s.done:>7}/{s.total:<7} {s.queue}")
        if s.requested:  # size buckets: generated at s.label, asked for at these sizes
            lines.append(f"  {'':>11}  requested {s.requested_text()}")
    lines += ["", "workers     device   images  batches  img/s  compile_s  generate_s  storing/idle_s"]
    lines += [f"  {w.worker:<10} {w.device:<7} {w.images:>6} {w.batches:>8} {w.images_per_s:>6.2f} "
              f"{w.compile_s:>10.1f} {w.generate_s - w.compile_s:>11.1f} {w.other_s:>15.1f}" for w in report.workers]
    lines += ["", "devices"]
    lines += [f"  {name:<10} {d['workers']} worker(s), {d['images']} images, {d['active_s'] / 3600:.4f} device-hours"
              for name, d in report.per_device().items()]
    if report.failures:
        lines += ["", f"failures ({len(report.failures)} batches)"]
        lines += [f"  {count} × {error}" for error, count in report.errors.most_common(10)]
    return "\n".join(lines) + "\n"


def contact_sheet(storage: Storage, records: list[ImageRecord], *, thumb: int = 112, columns: int = 8) -> bytes:
    """A PNG grid of `records`' images, each scaled into a thumb × thumb cell with its id below."""
    from PIL import Image, ImageDraw

    label = 14
    rows = max(1, -(-len(records) // columns))
    sheet = Image.new("RGB", (columns * thumb, rows * (thumb + label)), "white")
    draw = ImageDraw.Draw(sheet)
    images = dict(storage.get_many(r.file_name for r in records))
    for n, record in enumerate(records):
        image = Image.open(io.BytesIO(images[record.file_name])).convert("RGB")
        image.thumbnail((thumb, thumb))
        x, y = (n % columns) * thumb, (n // columns) * (thumb + label)
        sheet.paste(image, (x + (thumb - image.width) // 2, y + (thumb - image.height) // 2))
        draw.text((x + 3, y + thumb), record.id[:20], fill="black")
    buffer = io.BytesIO()
    sheet.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _figure_png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()


def _legend_above(ax) -> None:
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=3, fontsize=8, frameon=False)


def charts(report: Report) -> dict[str, bytes]:
    """Title → PNG: throughput over time, time per worker, progress per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    x, y = report.throughput()
    ax.step(x, y, where="mid", color="#3465a4")
    ax.fill_between(x, y, step="mid", alpha=0.25, color="#3465a4")
    ax.set_xlabel("seconds since the first batch started")
    ax.set_ylabel("images/s")
    out["Images per second over time"] = _figure_png(fig)

    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.45 * max(1, len(report.workers))))
    names = [w.worker for w in report.workers]
    parts = [("compile (est.)", [w.compile_s for w in report.workers], "#cc0000"),
             ("generate", [w.generate_s - w.compile_s for w in report.workers], "#4e9a06"),
             ("storing / idle", [w.other_s for w in report.workers], "#babdb6")]
    left = [0.0] * len(names)
    for title, values, color in parts:
        ax.barh(names, values, left=left, label=title, color=color)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("seconds")
    _legend_above(ax)
    out["Time per worker"] = _figure_png(fig)

    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.45 * max(1, len(report.shapes))))
    labels = [s.label for s in report.shapes]
    ax.barh(labels, [s.total for s in report.shapes], color="#d3d7cf", label="total")
    ax.barh(labels, [s.done for s in report.shapes], color="#3465a4", label="done")
    ax.set_xlabel("images")
    _legend_above(ax)
    out["Images per shape"] = _figure_png(fig)
    return out


def _table(header: list[str] | None, rows: list[list]) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(report: Report, sheet_png: bytes | None = None) -> str:
    """One self-contained page: figures, tables, and the plots and contact sheet as data URLs."""
    cost = (f"{report.cost_per_1000:.4f} per 1,000 images at {report.price_per_device_hour:g} per device-hour"
            if report.cost_per_1000 is not None else "pass --price-per-device-hour")
    summary = _table(None, [
        ["items", f"{report.done} / {report.total} done, {report.failed} failed, "
                  f"{report.total - report.done - report.failed} pending"],
        ["throughput", f"{report.images_per_s:.2f} images/s over {report.wall_s:.1f} s"],
        ["device-hours", f"{report.device_hours:.4f} ({len(report.workers)} workers)"],
        ["cost", cost]])
    workers = _table(["worker", "device", "images", "batches", "images/s", "compile s (est.)", "generate s",
                      "storing / idle s"],
                     [[w.worker, w.device, w.images, w.batches, f"{w.images_per_s:.2f}", f"{w.compile_s:.1f}",
                       f"{w.generate_s - w.compile_s:.1f}", f"{w.other_s:.1f}"] for w in report.workers])
    devices = _table(["device", "workers", "images", "device-hours"],
                     [[name, d["workers"], d["images"], f"{d['active_s'] / 3600:.4f}"]
                      for name, d in report.per_device().items()])
    shapes = _table(["shape", "done", "total", "queue", "requested sizes (items)"],
                    [[s.label, s.done, s.total, s.queue, s.requested_text() or "as generated"] for s in report.shapes])
    failures = (_table(["batch", "items", "attempts", "worker", "error"],
                       [[f.batch_id, len(f.item_ids), f.attempts, f.worker, f.error[:200]]
                        for f in report.failures[:50]]) if report.failures else "<p>none</p>")
    plots = "".join(f"<h2>{html.escape(title)}</h2>{_img(png, title)}" for title, png in charts(report).items())
    sheet = f"<h2>Sample ({len(report.sample)} images)</h2>{_img(sheet_png, 'contact sheet')}" if sheet_png else ""
    title = html.escape(f"diffq run {report.run_id}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title><style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 980px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 24px; }}
table {{ border-collapse: collapse; margin: 8px 0; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; font-size: 13px; }}
th {{ background: #f3f3f3; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>{title}</h1><p><code>{html.escape(report.out)}</code></p>
{summary}
<h2>Shapes</h2>{shapes}
<h2>Workers</h2>{workers}
<h2>Devices</h2>{devices}
<h2>Failures</h2>{failures}
{plots}
{sheet}
</body></html>
"""


def report(out: str, *, html_path: str | Path | None = None, contact_sheet_path: str | Path | None = None,
           price_per_device_hour: float | None = None, sample_size: int = 24) -> Report:
    """Build the report; write the HTML page and/or the contact sheet PNG when given paths."""
    result = build_report(out, price_per_device_hour=price_per_device_hour, sample_size=sample_size)
    sheet = None
    if (html_path or contact_sheet_path) and result.sample:
        sheet = contact_sheet(open_storage(out), result.sample)
        if contact_sheet_path:
            Path(contact_sheet_path).write_bytes(sheet)
    if html_path:
        Path(html_path).write_text(render_html(result, sheet))
    return result


def to_json(report: Report) -> dict:
    """The headline figures, for scripts."""
    return {"run_id": report.run_id, "total": report.total, "done": report.done, "failed": report.failed,
            "images_per_s": report.images_per_s, "wall_s": report.wall_s, "device_hours": report.device_hours,
            "cost_per_1000": report.cost_per_1000,
            "workers": [{"worker": w.worker, "device": w.device, "images": w.images, "batches": w.batches,
                         "compile_s": w.compile_s, "generate_s": w.generate_s, "active_s": w.active_s}
                        for w in report.workers],
            "shapes": [{"shape": s.label, "queue": s.queue, "done": s.done, "total": s.total,
                        "requested": [{"height": h, "width": w, "items": n} for h, w, n in s.requested]}
                       for s in report.shapes],
            "failures": dict(report.errors)}


__all__ = ["Report", "build_report", "charts", "contact_sheet", "render_html", "render_text", "report", "to_json"]
