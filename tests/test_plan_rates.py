"""`diffq plan --rates`: a fleet plan from measured rates, kept by `run --rates`, compared
with what the run did. The rates come from a real `diffq qualify --json` of the tiny
pipeline on CPU and from a finished run's `diffq report --json`, both made here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffq.app.fleet_plan import RatesError, fleet_plan, keep, parse_duration, read_rates
from diffq.core import layout
from diffq.core.records import FleetPlanFigures
from diffq.core.runfolder import iter_records
from diffq.core.storage import open_storage
from diffq.producer.submit import plan as plan_file
from tests.test_export import make_run

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "prompts.jsonl")  # 128x128 ×20, 64x64 ×8, 128x64 ×4


def diffq(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "diffq", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def qualified(tiny_model, tmp_path_factory) -> Path:
    """Rates of two of the example's three shapes, at the run's batch size and steps."""
    path = tmp_path_factory.mktemp("rates") / "qualify.json"
    path.write_text(diffq("qualify", "--model", tiny_model, "--shapes", "128x128,64x64", "--batch-size", "4",
                          "--steps", "4", "--repeats", "3", "--json").stdout)
    return path


def test_plan_from_a_qualify_json(qualified, tiny_model):
    q = json.loads(qualified.read_text())
    rate = {(s["height"], s["width"]): s for s in q["shapes"]}
    plan = json.loads(diffq("plan", EXAMPLE, "--model", tiny_model, "--rates", str(qualified), "--devices", "2",
                            "--price-per-device-hour", "3", "--json").stdout)
    fleet = plan["fleet"]
    shapes = {(s["height"], s["width"]): s for s in fleet["shapes"]}
    # Per shape: batches × the measured steady call; compile = first call − steady.
    assert set(shapes) == {(128, 128), (64, 64)}
    for size, shape in shapes.items():
        steady = rate[size]["steady_s"]["median"]
        assert shape["steps"] == 4 and shape["batches"] == {(128, 128): 5, (64, 64): 2}[size]
        assert shape["device_s"] == pytest.approx(shape["batches"] * steady)
        assert shape["compile_s"] == pytest.approx(max(0.0, rate[size]["first_call_s"] - steady))
    # The shape the rates do not cover is named, and in no figure.
    (uncovered,) = fleet["uncovered"]
    assert (uncovered["height"], uncovered["width"], uncovered["items"]) == (128, 64, 4)
    assert uncovered["reason"] == "no rate for 128x64" and fleet["items"] == 28 and fleet["total_items"] == 32
    device_s = sum(s["device_s"] for s in shapes.values()) + sum(s["compile_s"] for s in shapes.values())
    assert fleet["device_s"] == pytest.approx(device_s) and fleet["warm_cache"] is False
    # Two devices: start-up (qualify's load time), then the device time shared out.
    floor = max(s["compile_s"] + s["device_s"] / s["batches"] for s in shapes.values())
    finish = q["load_s"] + max(device_s / 2, floor)
    assert fleet["finish_s"] == pytest.approx(finish) and fleet["startup_s"] == q["load_s"]
    assert (fleet["devices"], fleet["devices_per_pod"], fleet["pods"]) == (2, 2, 1)  # the cpu pod facts
    assert fleet["cost"] == pytest.approx(3 * 2 * finish / 3600)
    assert fleet["cost_per_1000"] == pytest.approx(fleet["cost"] / 28 * 1000)

    text = diffq("plan", EXAMPLE, "--model", tiny_model, "--rates", str(qualified), "--warm-cache",
                 "--devices", "1").stdout
    assert "128x64 b4, 4 steps, 4 items: no rate for 128x64" in text and "not covered" in text
    assert "compile cache warm" in text and "1 device(s)" in text


def test_deadline_gives_the_fewest_devices(qualified, tiny_model):
    plan = plan_file(EXAMPLE, model=tiny_model, batch_size=4, steps=4)
    figures = fleet_plan(plan, [qualified]).figures
    # A deadline a third of the way from start-up to one device's finish.
    deadline = figures.startup_s + max(figures.device_s / 3, figures.floor_s) + 1e-6
    fleet = fleet_plan(plan, [qualified], deadline_s=deadline)
    needed = fleet.devices_needed
    assert needed == math.ceil(figures.device_s / (deadline - figures.startup_s))
    assert fleet.figures.finish_s(needed) <= deadline < fleet.figures.finish_s(needed - 1)
    assert fleet.pods == math.ceil(needed / 2)
    # Not even a shape's compile and one batch fit: no number of devices.
    late = fleet_plan(plan, [qualified], deadline_s=figures.startup_s + figures.floor_s / 2)
    assert late.devices_needed is None and any("no number of devices" in note for note in late.notes)
    text = diffq("plan", EXAMPLE, "--model", tiny_model, "--rates", str(qualified), "--deadline", "1s").stdout
    assert "deadline 1.0 s: not reachable with any number of devices" in text


def test_rates_that_differ_are_named_not_used(qualified, tiny_model):
    plan = plan_file(EXAMPLE, model=tiny_model, batch_size=8, steps=2)
    fleet = fleet_plan(plan, [qualified])
    assert fleet.figures.shapes == [] and fleet.figures.device_s == 0
    reasons = {(u.height, u.width): u.reason for u in fleet.figures.uncovered}
    assert reasons[(128, 128)] == "rates for 128x128 differ: batch 4 (plan: 8), 4 steps (plan: 2)"
    assert reasons[(128, 64)] == "no rate for 128x64"


def test_run_keeps_its_plan_and_the_report_compares(qualified, tiny_model, tmp_path):
    out = tmp_path / "run"
    run = diffq("run", EXAMPLE, "--model", tiny_model, "--out", str(out), "--workers", "1", "--rates",
                str(qualified), "--no-progress")
    assert "fleet plan: " in run.stderr and "not covered: 128x64 4 steps (4 items); kept in fleet-plan.json" in run.stderr
    kept = FleetPlanFigures.model_validate_json((out / layout.FLEET_PLAN).read_text())
    assert kept.devices == 1 and {(s.height, s.width) for s in kept.shapes} == {(128, 128), (64, 64)}
    assert kept.device_s == pytest.approx(
        fleet_plan(plan_file(EXAMPLE, model=tiny_model), [qualified], devices=1).figures.device_s)

    records = list(iter_records(open_storage(str(out))))
    per_batch = {r.batch_id: r for r in records}.values()
    covered = sum(r.generate_s for r in per_batch if (r.height, r.width) != (128, 64))
    report = json.loads(diffq("report", str(out), "--json", "--price-per-device-hour", "2").stdout)
    planned = report["planned"]
    assert planned["devices"] == 1 and planned["planned_device_s"] == pytest.approx(kept.device_s)
    assert planned["actual_device_s"] == pytest.approx(covered, rel=1e-6)
    assert planned["planned_finish_s"] == pytest.approx(kept.finish_s(1))
    assert planned["planned_cost"] == pytest.approx(2 * kept.finish_s(1) / 3600)
    assert [u["height"] for u in planned["uncovered"]] == [128]
    text = diffq("report", str(out)).stdout
    assert "planned vs actual (28 items the rates covered, 1 device)" in text and "busy device-hours" in text

    # The finished run's report as rates: its plan's device time is what its records show.
    (tmp_path / "report.json").write_text(json.dumps(report))
    again = fleet_plan(plan_file(EXAMPLE, model=tiny_model), [tmp_path / "report.json"])
    assert again.figures.uncovered == [] and again.figures.items == 32
    actual = sum(r.generate_s for r in per_batch)
    assert again.figures.device_s == pytest.approx(actual, rel=0.2), (again.figures.device_s, actual)


def test_a_folder_holding_a_run_keeps_the_plan_it_has(qualified, tiny_model, tmp_path):
    fleet = fleet_plan(plan_file(EXAMPLE, model=tiny_model), [qualified])
    make_run(str(tmp_path / "run"), 8)  # a run continued with --rates: its folder is not touched
    assert keep(str(tmp_path / "run"), fleet) is False and not (tmp_path / "run" / layout.FLEET_PLAN).exists()
    assert keep(str(tmp_path / "new"), fleet) is True
    assert FleetPlanFigures.model_validate_json((tmp_path / "new" / layout.FLEET_PLAN).read_text()) == fleet.figures


def test_rates_files_are_checked(tmp_path, qualified):
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(RatesError, match="neither `diffq qualify --json`, a `qualify --speedups --profile` file nor `diffq report --json`"):
        read_rates([tmp_path / "other.json"])
    cuda = json.loads(qualified.read_text())
    cuda["device"]["kind"] = "cuda"
    (tmp_path / "cuda.json").write_text(json.dumps(cuda))
    with pytest.raises(RatesError, match=r"several device kinds \(cpu, cuda\)"):
        read_rates([qualified, tmp_path / "cuda.json"])


@pytest.mark.parametrize("text, seconds", [("6h", 21600), ("90m", 5400), ("1h30m", 5400), ("45s", 45),
                                           ("3600", 3600), ("1.5h", 5400), ("2d", 172800)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_bad_duration_and_options_are_clear_errors(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("six hours")
    proc = subprocess.run([sys.executable, "-m", "diffq", "plan", EXAMPLE, "--model", tiny_model, "--deadline", "6h"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "need --rates" in proc.stderr


@pytest.mark.parametrize("device", ["cpu", "neuron"])
def test_fleet_manifests_size_their_pools_from_the_plan(qualified, tiny_model, tmp_path, device):
    """`plan --rates … --devices|--deadline --json` → `fleet manifests --fleet-plan`: each
    pool's maxReplicaCount is the pods its queues need (device time split by
    queue, devices per pod from the backend table)."""
    import yaml

    from diffq.worker.device.backends import get_backend

    q = json.loads(qualified.read_text())
    rates = tmp_path / "rates.json"
    # The same rates as if measured there (at that device's own dtype, what auto runs at).
    rates.write_text(json.dumps({**q, "device": {**q["device"], "kind": device},
                                 "dtype": get_backend(device).default_dtype}))
    plan_json = tmp_path / "plan.json"
    plan_json.write_text(diffq("plan", EXAMPLE, "--model", tiny_model, "--rates", str(rates), "--devices", "20",
                               "--json").stdout)
    fleet = json.loads(plan_json.read_text())["fleet"]
    assert fleet["devices"] == 20 and {s["queue"] for s in fleet["shapes"]}
    out = tmp_path / "manifests"
    diffq("fleet", "manifests", "--model", tiny_model, "--shapes", "128x128,64x64,128x64", "--device", device,
          "--fleet-plan", str(plan_json), "--out", str(out), "--out-prefix", str(tmp_path))
    docs = [d for p in sorted(out.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    scaled = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    per_pod = get_backend(device).k8s.devices_per_pod
    work: dict[str, float] = {}
    for shape in fleet["shapes"]:
        work[shape["queue"]] = work.get(shape["queue"], 0.0) + shape["device_s"]
    total = sum(work.values())
    for so in scaled.values():
        queues = [t["metadata"]["listName"] for t in so["spec"]["triggers"] if t["type"] == "redis"]
        planned = [queue for queue in queues if queue in work]
        if not planned:  # 128x64 has no rate: the plan names it, the pool keeps --max-replicas
            assert so["spec"]["maxReplicaCount"] == 8
            continue
        devices = sum(max(1, math.ceil(fleet["devices"] * work[queue] / total)) for queue in planned)
        assert so["spec"]["maxReplicaCount"] == max(1, math.ceil(devices / per_pod))


def test_a_lora_runs_queues_count_toward_the_pool_of_their_shape():
    """A plan's queues of a LoRA run end in their layout; the fleet renders each shape's
    queue without it (one pool serves every layout of the model): the plan's devices
    count there, not nowhere."""
    from diffq.app.fleet import planned_devices
    from diffq.core.contract import ShapeKey

    shape = ShapeKey(model="/m/flux", height=64, width=64, batch_size=2, max_sequence_length=16, cfg=False)
    layered = shape.model_copy(update={"lora": "r8-0123abcd"})
    assert layered.queue != shape.queue
    plan = {"fleet": {"devices": 4, "shapes": [{"queue": layered.queue, "device_s": 30.0},
                                                {"queue": shape.queue, "device_s": 10.0}]}}
    assert planned_devices(plan) == {shape.queue: 4}
