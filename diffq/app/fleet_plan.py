"""A fleet plan from measured rates: device time, devices for a deadline, finish time, cost.

`diffq plan PROMPTS --rates FILE…` (and `diffq fleet manifests`, through `fleet_plan`)
turns the shape histogram of the producer's validation pass into device time with
rates measured on the device:

- a rate is one shape's steady seconds per batch and its first call, from `diffq
  qualify --json` or from a finished run's `diffq report --json` (its `rates`);
- per shape and step count: device seconds = batches × steady seconds per batch;
- compile time = first call − steady, once per shape for a fleet sharing one compile
  cache (cold by default; `warm_cache` leaves it out);
- with a device count the finish time, with a deadline the devices needed
  (`FleetPlanFigures.finish_s` / `devices_for`, the one model of a fleet's time),
  pods from the backend table's pod facts, cost from a price per device-hour.

A rate covers a shape only where model, size, batch size, steps, dtype and CFG all
match; every shape the rates do not cover is named with the reason and left out of
every figure, never estimated.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diffq.core import layout
from diffq.core.contract import effective_dtype
from diffq.core.records import FleetPlanFigures, PlannedShape, UncoveredShape
from diffq.core.storage import open_storage
from diffq.producer.submit import Plan
from diffq.results.report import duration_text
from diffq.worker.api import get_backend


class RatesError(ValueError):
    """A rates file that is not a qualify or report JSON, or rates that cannot be combined."""


@dataclass(frozen=True)
class Rate:
    """One shape's measured time on one device kind."""

    height: int
    width: int
    batch_size: int
    steps: int
    dtype: str  # as the device ran it (never "auto")
    cfg: bool | None  # None: the file does not say (qualify's JSON has no guidance scale)
    model: str | None
    steady_s: float  # median pipeline call per batch, steady state
    first_call_s: float
    device_kind: str
    source: str
    startup_s: float | None = None  # loading the pipeline (qualify's load_s)
    # An object-storage model's fetch within that load, as qualify saw it: a cache miss
    # (in startup_s) or a hit (then a new pod's fetch is not); None: no such model.
    fetch_hit: bool | None = None
    fetch_s: float = 0.0
    from_first_calls: bool = False  # a report's shape no process ran twice: compile is in steady_s

    @property
    def compile_s(self) -> float:
        return max(0.0, self.first_call_s - self.steady_s)


def _qualify_rates(data: dict, source: str) -> list[Rate]:
    kind = data["device"]["kind"]
    cfg = data["guidance_scale"] > 1 if data.get("guidance_scale") is not None else None
    fetches = (data.get("start") or {}).get("fetches") or []
    fetch = {"fetch_hit": all(f["hit"] for f in fetches), "fetch_s": sum(f["seconds"] for f in fetches)} \
        if fetches else {}
    return [Rate(height=s["height"], width=s["width"], batch_size=s["batch_size"], steps=data["steps"],
                 dtype=data["dtype"], cfg=cfg, model=data.get("model"), steady_s=s["steady_s"]["median"],
                 first_call_s=s["first_call_s"], device_kind=kind, source=source, startup_s=data.get("load_s"),
                 **fetch)
            for s in data["shapes"]]


def _report_rates(data: dict, source: str) -> list[Rate]:
    return [Rate(height=r["height"], width=r["width"], batch_size=r["batch_size"], steps=r["steps"],
                 dtype=r["dtype"], cfg=r["cfg"], model=r["model"], steady_s=r["steady_s"]["median"],
                 first_call_s=r["first_call_s"], device_kind=r["device_kind"], source=source,
                 from_first_calls=r.get("from_first_calls", False))
            for r in data["rates"]]


def _profile_rates(data: dict, source: str) -> list[Rate]:
    """A speed-up profile's chosen candidates (core/profile.py): each shape's tuned rate,
    as fast as its speed-up and batch size make it. Its compile time is not measured
    per candidate: the first call is taken as the steady one."""
    from diffq.core.profile import SpeedupProfile

    profile = SpeedupProfile.model_validate(data)
    if profile.dtype is None:
        raise KeyError("dtype")
    cfg = profile.guidance_scale > 1 if profile.guidance_scale is not None else None
    rates = []
    for shape in profile.shapes:
        call = shape.chosen.seconds_per_image * shape.chosen.batch_size
        rates.append(Rate(height=shape.height, width=shape.width, batch_size=shape.chosen.batch_size,
                          steps=profile.steps, dtype=profile.dtype, cfg=cfg, model=profile.model, steady_s=call,
                          first_call_s=call, device_kind=profile.device, source=source, startup_s=profile.load_s))
    return rates


def read_rates(paths: Iterable[str | Path]) -> list[Rate]:
    """The rates of `diffq qualify --json` and `diffq report --json` files, in the order given."""
    rates: list[Rate] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise RatesError(f"--rates {path}: {exc}") from None
        try:
            if isinstance(data, dict) and "rates" in data and "run_id" in data:
                found = _report_rates(data, str(path))
            elif isinstance(data, dict) and "budget" in data and "shapes" in data:
                found = _profile_rates(data, str(path))
            elif isinstance(data, dict) and "checks" in data and "shapes" in data:
                if data.get("error"):
                    raise RatesError(f"--rates {path}: that qualify run failed ({data['error']}): nothing measured")
                found = _qualify_rates(data, str(path))
            else:
                raise RatesError(f"--rates {path}: neither `diffq qualify --json`, a `qualify --speedups --profile` "
                                 "file nor `diffq report --json` output")
        except (KeyError, TypeError) as exc:
            raise RatesError(f"--rates {path}: missing field {exc}") from None
        rates += found
    kinds = sorted({rate.device_kind for rate in rates})
    if len(kinds) > 1:
        raise RatesError(f"--rates measure several device kinds ({', '.join(kinds)}): plan one kind at a time")
    return rates


def parse_duration(text: str) -> float:
    """'6h', '90m', '1h30m', '45s', '2d' or plain seconds -> seconds."""
    text = text.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)([dhms]?)", text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise ValueError(f"'{text}' is not a duration (e.g. 6h, 90m, 1h30m, 3600)")
    scale = {"d": 86400, "h": 3600, "m": 60, "s": 1, "": 1}
    return sum(float(number) * scale[unit] for number, unit in parts)


def _same_model(a: str | None, b: str) -> bool:
    if a is None or a == b:
        return True
    try:
        return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _mismatch(rate: Rate, want: dict) -> list[str]:
    """What differs between a rate and a shape's batches, worded for a person."""
    found = []
    if rate.batch_size != want["batch_size"]:
        found.append(f"batch {rate.batch_size} (plan: {want['batch_size']})")
    if rate.steps != want["steps"]:
        found.append(f"{rate.steps} steps (plan: {want['steps']})")
    if rate.dtype != want["dtype"]:
        found.append(f"{rate.dtype} (plan: {want['dtype']})")
    if rate.cfg is not None and rate.cfg != want["cfg"]:
        found.append(f"CFG {'on' if rate.cfg else 'off'} (plan: {'on' if want['cfg'] else 'off'})")
    if rate.cfg is None and want["cfg"]:
        found.append("no guidance scale in the rates (the plan's batches use CFG)")
    if not _same_model(rate.model, want["model"]):
        found.append(f"model {rate.model} (plan: {want['model']})")
    return found


@dataclass
class FleetPlan:
    """`fleet_plan`'s answer; `figures` is what a run folder keeps (fleet-plan.json)."""

    figures: FleetPlanFigures
    total_items: int
    devices_per_pod: int | None
    notes: list[str] = field(default_factory=list)
    kept: bool | None = None  # `plan_for_run`: stored in OUT (False: OUT already held a run and its plan)

    @property
    def devices(self) -> int | None:
        """The devices planned for: --devices as given, or what the deadline needs."""
        return self.figures.devices

    @property
    def devices_needed(self) -> int | None:
        """For a deadline: the fewest devices that meet it (None without one, or when none can)."""
        return self.figures.devices if self.figures.deadline_s is not None else None

    @property
    def pods(self) -> int | None:
        if not self.devices or not self.devices_per_pod:
            return None
        return math.ceil(self.devices / self.devices_per_pod)

    @property
    def finish_s(self) -> float | None:
        return self.figures.finish_s(self.devices) if self.devices else None

    @property
    def device_hours(self) -> float:
        """Busy device time: pipeline calls and compiles."""
        return self.figures.device_s / 3600

    @property
    def billed_device_hours(self) -> float:
        """What a fleet pays for: every device from start-up to the finish."""
        finish = self.finish_s
        return self.devices * finish / 3600 if finish is not None else self.device_hours

    @property
    def cost(self) -> float | None:
        price = self.figures.price_per_device_hour
        return price * self.billed_device_hours if price is not None else None

    @property
    def cost_per_1000(self) -> float | None:
        cost = self.cost
        return cost / self.figures.items * 1000 if cost is not None and self.figures.items else None

    def summary(self) -> str:
        """One line: what `submit`/`run --rates` kept."""
        f = self.figures
        finish = f", finishing in {duration_text(self.finish_s)} on {self.devices} device(s)" if self.devices else ""
        left = ("; not covered: " + ", ".join(f"{u.height}x{u.width} {u.steps} steps ({u.items} items)"
                                               for u in f.uncovered)) if f.uncovered else ""
        kept = {True: f"; kept in {layout.FLEET_PLAN}", False: "; not kept: OUT already holds a run, whose plan stays",
                None: ""}[self.kept]
        return f"fleet plan: {f.device_s:,.1f} device-s for {f.items} of {self.total_items} items{finish}{left}{kept}"

    def to_json(self) -> dict:
        f = self.figures
        return {
            "device_kind": f.device_kind, "warm_cache": f.warm_cache, "startup_s": f.startup_s,
            "items": f.items, "total_items": self.total_items,
            "work_s": f.work_s, "compile_s": f.compile_s, "device_s": f.device_s, "floor_s": f.floor_s,
            "device_hours": self.device_hours, "billed_device_hours": self.billed_device_hours,
            "deadline_s": f.deadline_s, "devices": self.devices, "devices_needed": self.devices_needed,
            "devices_per_pod": self.devices_per_pod, "pods": self.pods, "finish_s": self.finish_s,
            "price_per_device_hour": f.price_per_device_hour, "cost": self.cost, "cost_per_1000": self.cost_per_1000,
            "shapes": [{**s.model_dump(), "device_s": s.device_s} for s in f.shapes],
            "uncovered": [u.model_dump() for u in f.uncovered],
            "notes": self.notes,
        }


def _fetch_notes(rates: Sequence[Rate]) -> list[str]:
    """What the start-up says of an object-storage model's fetch: every new pod of a
    per-pod model cache (the rendered fleets') fetches it once, a miss."""
    fetched = [rate for rate in rates if rate.fetch_hit is not None]
    if not fetched:
        return []
    if any(rate.fetch_hit for rate in fetched):
        return ["the model came from the node's model cache when it was qualified (a hit): the start-up leaves out "
                "the fetch each new pod makes (a miss); qualify it on an empty DIFFQ_MODEL_CACHE to count it"]
    return [f"the start-up includes the model's fetch from object storage ({max(r.fetch_s for r in fetched):.1f} s, "
            "a cache miss), as each new pod makes it"]


def fleet_plan(plan: Plan, rates: Sequence[Rate] | Sequence[str | Path], *, deadline_s: float | None = None,
               devices: int | None = None, price_per_device_hour: float | None = None,
               warm_cache: bool = False) -> FleetPlan:
    """Time `plan` (the producer's validation pass: `diffq.producer.submit.plan`) with `rates`
    (Rate objects, or paths of qualify / report JSON files)."""
    if deadline_s is not None and devices is not None:
        raise ValueError("--deadline and --devices exclude each other: give the deadline to get the "
                         "devices, or the devices to get the finish time")
    rates = list(rates)
    if rates and not isinstance(rates[0], Rate):
        rates = read_rates(rates)
    if not rates:
        raise RatesError("no rates: give --rates a `diffq qualify --json` or `diffq report --json` file")
    kind = rates[0].device_kind
    default_dtype = get_backend(kind).default_dtype
    notes = []
    if any(rate.cfg is None for rate in rates):
        notes.append("qualify's JSON does not say its guidance scale: its rates are taken as CFG off")
    shapes: list[PlannedShape] = []
    uncovered: list[UncoveredShape] = []
    for summary in plan.shapes:
        key = summary.shape
        per_steps = plan.steps.get(summary.queue) or {}
        if not per_steps:  # a Plan built without the per-steps counts
            raise ValueError(f"the plan has no step counts for {summary.queue}")
        for steps, (items, batches) in sorted(per_steps.items()):
            want = {"batch_size": key.batch_size, "steps": steps, "dtype": effective_dtype(key.dtype, default_dtype),
                    "cfg": key.cfg, "model": key.model}
            common = dict(queue=summary.queue, height=key.height, width=key.width, batch_size=key.batch_size,
                          steps=steps, items=items, batches=batches)
            sized = [rate for rate in rates if (rate.height, rate.width) == (key.height, key.width)]
            match = next((rate for rate in sized if not _mismatch(rate, want)), None)
            if match is None:
                reason = (f"rates for {key.height}x{key.width} differ: " + ", ".join(_mismatch(sized[0], want))
                          if sized else f"no rate for {key.height}x{key.width}")
                uncovered.append(UncoveredShape(**common, reason=reason))
                continue
            shapes.append(PlannedShape(**common, steady_s=match.steady_s, compile_s=match.compile_s,
                                       source=match.source))
            if match.from_first_calls:
                notes.append(f"{key.height}x{key.width} {steps} steps: {match.source} has first calls only "
                             "(no process ran it twice), so its time per batch includes a compile")
    startups = [rate.startup_s for rate in rates if rate.startup_s is not None]
    figures = FleetPlanFigures(device_kind=kind, warm_cache=warm_cache, startup_s=max(startups, default=0.0),
                               shapes=shapes, uncovered=uncovered, devices=devices, deadline_s=deadline_s,
                               price_per_device_hour=price_per_device_hour)
    if not startups:
        notes.append("the rates do not say how long a device takes to load the pipeline: no start-up time")
    notes += _fetch_notes(rates)
    if deadline_s is not None:
        needed = figures.devices_for(deadline_s)
        figures = figures.model_copy(update={"devices": needed})
        if needed is None:
            notes.append(f"no number of devices finishes by the deadline: start-up {figures.startup_s:.1f} s, "
                         f"then the slowest shape's compile and one batch take {figures.floor_s:.1f} s")
    k8s = get_backend(kind).k8s
    return FleetPlan(figures=figures, total_items=plan.total, devices_per_pod=k8s.devices_per_pod if k8s else None,
                     notes=notes)


def plan_for_run(prompts: str | Path, out: str, *, model: str, rates: Sequence[str | Path],
                 devices: int | None = None, **generation) -> FleetPlan:
    """`submit`/`run --rates`: the fleet plan of this file and these options (the same
    validation pass), kept in OUT (`keep`) for `diffq report`'s planned vs actual.
    `generation`: `options=` the generation options object, or them as keywords."""
    from diffq.producer.submit import plan as plan_file

    fleet = fleet_plan(plan_file(prompts, model=model, **generation), rates, devices=devices)
    fleet.kept = keep(out, fleet)
    return fleet


def keep(out: str, fleet: FleetPlan) -> bool:
    """Store the plan's figures in a new run folder (`submit`/`run --rates`), before the
    run starts; a folder that already holds a run keeps the plan it has. Returns
    whether it was stored."""
    storage = open_storage(out)
    if storage.exists(layout.MANIFEST):
        return False
    storage.put_bytes(layout.FLEET_PLAN, fleet.figures.model_dump_json(indent=2).encode(),
                      content_type="application/json")
    return True


def render_text(fleet: FleetPlan) -> str:
    """The rates part of `diffq plan --rates`, after the shape table."""
    f = fleet.figures
    lines = [f"{'rates (' + f.device_kind + ')':<13} {'steps':>5} {'items':>9} {'batches':>8} {'s/batch':>8} "
             f"{'device s':>10} {'compile s':>9}  from"]
    for s in f.shapes:
        lines.append(f"  {f'{s.height}x{s.width}':<11} {s.steps:>5} {s.items:>9} {s.batches:>8} {s.steady_s:>8.4f} "
                     f"{s.device_s:>10.1f} {s.compile_s:>9.2f}  {s.source}")
    if f.uncovered:
        left = sum(u.items for u in f.uncovered)
        lines.append(f"not covered, left out of every figure below ({left} of {fleet.total_items} items):")
        lines += [f"  {u.height}x{u.width} b{u.batch_size}, {u.steps} steps, {u.items} items: {u.reason}"
                  for u in f.uncovered]
    cache = ("warm: every shape is in the compile cache, no compile time" if f.warm_cache else
             f"cold: each shape compiles once in the fleet's shared cache, {f.compile_s:.1f} s in all "
             "(--warm-cache if it already holds them)")
    lines.append(f"compile cache {cache}")
    lines.append(f"device time {f.device_s:,.1f} s = {fleet.device_hours:,.4f} device-hours for {f.items} items "
                 f"(pipeline calls {f.work_s:,.1f} s + compiles {f.compile_s:,.1f} s)")
    pods = (f", {fleet.pods} pod(s) of {fleet.devices_per_pod} (the {f.device_kind} pod facts)"
            if fleet.pods else "")
    if f.deadline_s is not None:
        if fleet.devices_needed is None:
            lines.append(f"deadline {duration_text(f.deadline_s)}: not reachable with any number of devices")
        else:
            lines.append(f"deadline {duration_text(f.deadline_s)}: {fleet.devices_needed} device(s){pods}, "
                         f"finishing in {duration_text(fleet.finish_s)}")
    elif fleet.devices:
        lines.append(f"{fleet.devices} device(s){pods}: finishing in {duration_text(fleet.finish_s)} "
                     f"(start-up {f.startup_s:.1f} s included)")
    if fleet.cost is not None:
        billed = "billed" if fleet.devices else "busy"
        lines.append(f"cost {fleet.cost:,.4f} for {fleet.billed_device_hours:,.4f} {billed} device-hours at "
                     f"{f.price_per_device_hour:g} per device-hour, {fleet.cost_per_1000:,.4f} per 1,000 images")
    lines += [f"note: {note}" for note in fleet.notes]
    return "\n".join(lines) + "\n"
