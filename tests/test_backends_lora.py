"""The backend table's `lora` column (worker/device/backends.py `LoraFacts`) and what it
decides: the mode `--lora-mode auto` resolves to, whether a compile mode's graphs may bake
the weights, and which device / compile mode / --tp combination takes no adapters.

No Trainium or TPU here: these pin the vendor lines the Neuron and TPU rows rest on, so a
row cannot drift from its source without a test saying so (../shared/BACKENDS.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from diffq.worker.device import lora_modes
from diffq.worker.device.backends import BACKENDS, COMPILING_MODES, get_backend
from diffq.worker.process.supervisor import plan_children


def test_every_compile_mode_of_every_device_has_a_lora_row():
    for backend in BACKENDS.values():
        assert set(backend.lora) == set(backend.compile_modes), backend.name
        for mode in backend.compile_modes:
            assert backend.lora_facts(mode) is backend.lora[mode]
            assert backend.lora_facts(mode).mode in lora_modes.LORA_MODES


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_inductor_devices_swap_because_weights_are_graph_inputs(device):
    # Inductor without freezing keeps parameters as graph inputs; tests/test_lora.py counts
    # 0 graphs compiled across swaps on CPU.
    backend = get_backend(device)
    for mode in backend.compile_modes:
        facts = backend.lora_facts(mode)
        assert (facts.mode, facts.graph_inputs) == ("swap", True)
        assert lora_modes.resolve(backend, mode, "auto") == ("swap", f"the backend table (--device {device} "
                                                                     f"--compile {mode}): {facts.why}")
    assert "tests/test_lora.py" in backend.lora_facts("regional").why
    assert not lora_modes.bakes_weights(backend, "regional")


def test_neuron_compiles_per_set_citing_the_dynamo_backend_read():
    # torch-neuronx's dynamo backend: stock aot_autograd, no freezing pass, then torch-mlir's
    # stateless import (read at a public mirror, the commits named).
    backend = get_backend("neuron")
    for mode in backend.compile_modes:
        facts = backend.lora_facts(mode)
        assert (facts.mode, facts.graph_inputs) == ("compile", False)
        assert lora_modes.resolve(backend, mode, "auto")[0] == "compile"
        assert lora_modes.bakes_weights(backend, mode)  # eager Neuron compiles too (eager_compiles)
    why = backend.lora_facts("regional").why
    for line in ("parmoham-aws/test-repo-parmoham", "torch_neuronx/neuron_dynamo_backend/backend.py @ 98154b86",
                 "keep_inference_input_mutations=True", "fx/fx_transform.py @ 67d8dc4a",
                 "fx.stateless_fx_import", "qualify --lora"):
        assert line in why, line


def test_tpu_compiles_per_set_citing_the_backend_read():
    # torch_tpu's TpuBackend: stock aot_autograd without freezing; only get_attr tensors embedded.
    backend = get_backend("tpu")
    for mode in backend.compile_modes:
        facts = backend.lora_facts(mode)
        assert (facts.mode, facts.graph_inputs) == ("compile", False)
        assert lora_modes.resolve(backend, mode, "auto")[0] == "compile"
    why = backend.lora_facts("defer-fuse").why
    for line in ("jonathan1920/torch_tpu", "torch_tpu/_internal/compile/_backend.py @ 03c2f67a",
                 "keep_inference_input_mutations=False", "fx_passes/mark_embedded_constants.py @ 15e74f41",
                 "get_attr", "qualify --lora"):
        assert line in why, line


@pytest.mark.parametrize("device", ["neuron", "tpu"])
@pytest.mark.parametrize("mode", ["swap", "fuse", "compile"])
def test_neuron_and_tpu_refuse_no_lora_mode(device, mode):
    # swap and fuse asked for explicitly are left to the change check, compile is right anywhere.
    backend = get_backend(device)
    for compile_mode in backend.compile_modes:
        assert lora_modes.refusal(backend, compile_mode, mode) is None


def test_a_compile_mode_without_a_lora_row_and_a_tp_group_are_refused():
    backend = dataclasses.replace(get_backend("neuron"), lora={"none": get_backend("neuron").lora["none"]})
    assert "has no LoRA row" in lora_modes.refusal(backend, "regional", "compile")
    assert lora_modes.refusal(backend, "none", "compile") is None
    reason = lora_modes.refusal(get_backend("neuron"), "regional", "compile", tp=2)
    assert reason.startswith("LoRA adapters on a tensor-parallel group (--tp 2)")
    assert "auto" in lora_modes.refusal(get_backend("cpu"), "none", "nope")


def test_a_worker_plan_names_the_resolved_mode_never_auto():
    for device, expected in (("cpu", "swap"), ("neuron", "compile"), ("tpu", "compile")):
        kwargs = {"generation": "v6e"} if device == "tpu" else {}
        (spec,) = plan_children(device=device, devices=[0], broker_url="memory://", queues=[], **kwargs)
        assert spec.lora_mode == expected
        (spec,) = plan_children(device=device, devices=[0], broker_url="memory://", queues=[], lora_mode="fuse",
                                **kwargs)
        assert spec.lora_mode == "fuse"


def test_a_tp_group_serving_a_run_with_adapters_is_refused_at_start():
    from diffq.core.adapters import AdapterLayout

    layouts = {"m": AdapterLayout(targets=("x",), rank=4)}
    with pytest.raises(ValueError, match=r"tensor-parallel group \(--tp 2\)"):
        plan_children(device="neuron", devices=[0, 1], broker_url="memory://", queues=[], tp=2,
                      adapter_layouts=layouts)
    assert len(plan_children(device="neuron", devices=[0, 1], broker_url="memory://", queues=[], tp=2)) == 2


# --- a profile measured on the device (`qualify --lora --profile`) -------------------------


def _profile(path, device: str, compile_mode: str, passed: dict[str, float], failed=("swap",), **recorded):
    """A profile as qualify writes it on this host (its versions, its generation), unless `recorded` says otherwise."""
    from diffq.core.profile import LoraMeasure, LoraProfile

    measured = [LoraMeasure(mode=m, ok=True, s_per_image_with=s) for m, s in passed.items()]
    measured += [LoraMeasure(mode=m, ok=False, s_per_image_with=0.01, refused="did not show") for m in failed]
    here = {"model": "m", "versions": lora_modes.installed_versions(get_backend(device)),
            "generation": lora_modes.generation_here(get_backend(device))}
    LoraProfile(device=device, compile=compile_mode, measured=measured, **{**here, **recorded}).dump(path)
    return str(path)


def test_auto_takes_the_cheapest_mode_that_passed_on_the_same_device_only(tmp_path):
    from diffq.core.profile import LoraProfile, lora_mode_and_profile

    neuron = get_backend("neuron")
    path = _profile(tmp_path / "lora.json", "neuron", "regional", {"fuse": 1.2, "compile": 1.5})
    mode, profile = lora_mode_and_profile(path)
    assert mode == "auto" and isinstance(profile, LoraProfile)
    chosen, why = lora_modes.resolve(neuron, "regional", mode, profile)
    assert chosen == "fuse"  # swap was cheaper but failed its check
    torch_version = lora_modes.installed_versions(neuron)["torch"]
    assert f"measured on --device neuron --compile regional (" in why and f"torch {torch_version}" in why
    # Another compile mode or device: the table's mode; a mode named wins over the profile.
    assert lora_modes.resolve(neuron, "full", mode, profile)[0] == "compile"
    assert lora_modes.resolve(get_backend("tpu"), "regional", mode, profile)[0] == "compile"
    assert lora_modes.resolve(neuron, "regional", "swap", profile)[0] == "swap"
    # Nothing passed: the table's.
    none_passed = LoraProfile.load(_profile(tmp_path / "bad.json", "neuron", "regional", {}))
    assert lora_modes.resolve(neuron, "regional", "auto", none_passed)[0] == "compile"
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match=r"junk.json: not a diffq LoRA profile \(model"):
        lora_mode_and_profile(str(tmp_path / "junk.json"))


def test_a_profile_measured_on_other_versions_generation_or_model_is_passed_over_with_the_reason(tmp_path, caplog):
    """A profile speaks for the device generation, compile mode, model and versions it was
    measured on: elsewhere `auto` is the table's mode, and the reason is said and logged."""
    from diffq.core.profile import LoraProfile

    tpu = get_backend("tpu")
    here = lora_modes.installed_versions(tpu)
    cases = {
        "versions": ({"versions": {**here, "torch": "0.0.1"}}, {},
                     f"torch {here['torch']} here, 0.0.1 in the profile"),
        "a package gone": ({"versions": {**here, "libtpu": "0.1"}}, {}, "libtpu absent here, 0.1 in the profile"),
        "generation": ({"generation": "v5e"}, {"generation": "v6e"}, "generation v6e here, v5e in the profile"),
        "model": ({}, {"models": ["other"]}, "model other here, m in the profile"),
    }
    for name, (recorded, where, reason) in cases.items():
        profile = LoraProfile.load(_profile(tmp_path / f"{name}.json", "tpu", "regional", {"fuse": 1.0}, **recorded))
        with caplog.at_level("WARNING", logger=lora_modes.__name__):
            mode, why = lora_modes.resolve(tpu, "regional", "auto", profile, **where)
        assert mode == "compile" and why.startswith("the backend table (--device tpu --compile regional)"), name
        assert f"{lora_modes.PASSED_OVER}" in why and reason in why, (name, why)
        assert any(reason in record.getMessage() for record in caplog.records), name
    # The same profile on what it was measured on: its mode; the pods' generation given
    # (a fleet render), versions not this host's to check.
    profile = LoraProfile.load(_profile(tmp_path / "v6e.json", "tpu", "regional", {"fuse": 1.0},
                                        generation="v6e", versions={"torch": "0.0.1", "torch-tpu": "9"}))
    mode, why = lora_modes.resolve(tpu, "regional", "auto", profile, generation="v6e", models=["m"], versions=None)
    assert mode == "fuse" and "measured on --device tpu v6e --compile regional" in why
    assert "versions recorded, not checked here" in why
    assert lora_modes.resolve(tpu, "regional", "auto", profile, generation="v6e")[0] == "compile"


def test_worker_plan_and_run_resolve_auto_through_the_profile(tmp_path):
    import json

    from typer.testing import CliRunner

    from diffq.app.cli import app
    from diffq.app.runner import LocalWorkers

    path = _profile(tmp_path / "lora.json", "cpu", "none", {"fuse": 0.5, "swap": 0.9}, failed=())
    assert LocalWorkers(device="cpu", lora_mode=path).resolved_lora_mode() == "fuse"
    assert LocalWorkers(device="cpu", compile="regional", lora_mode=path).resolved_lora_mode() == "swap"
    assert LocalWorkers(device="neuron").resolved_lora_mode() == "compile"
    for given, expected in ((path, "fuse"), ("auto", "swap"), ("compile", "compile")):
        result = CliRunner().invoke(app, ["worker", "--plan", "--broker", "memory://", "--workers", "1",
                                          "--lora-mode", given])
        assert result.exit_code == 0, result.output
        assert [child["lora_mode"] for child in json.loads(result.stdout)] == [expected]
    result = CliRunner().invoke(app, ["worker", "--plan", "--broker", "memory://", "--lora-mode", "sometimes"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "choose auto, swap, fuse, compile" in result.output


@pytest.mark.parametrize("device", ["neuron", "tpu"])
def test_run_resume_and_worker_on_neuron_and_tpu_take_adapters(device, monkeypatch):
    """No chip here: run's check and the children it plans, and a worker's host, as the
    rows stand (auto: compile) and with the row faked as a chip run would prove it (swap)."""
    from diffq.app.runner import LocalWorkers
    from diffq.core.adapters import AdapterLayout
    from diffq.worker.device import backends
    from diffq.worker.device.backends import LoraFacts
    from diffq.worker.device.pipeline_host import PipelineHost

    layouts = {"m": AdapterLayout(targets=("x",), rank=4)}
    kwargs = {"generation": "v6e"} if device == "tpu" else {}
    for row_mode in ("compile", "swap"):
        if row_mode == "swap":  # the row as a qualify --lora run on the chip would turn it
            monkeypatch.setitem(backends.BACKENDS, device, dataclasses.replace(
                BACKENDS[device], lora={m: LoraFacts("swap", True, "proven") for m in BACKENDS[device].lora}))
        local = LocalWorkers(device=device, compile="regional")
        local.check(["m"], adapters=True)  # run and resume check this before any worker starts
        assert local.resolved_lora_mode() == row_mode
        (spec,) = plan_children(device=device, devices=[0], broker_url="memory://", queues=[], compile="regional",
                                adapter_layouts=layouts, lora_mode=local.resolved_lora_mode(), **kwargs)
        assert spec.lora_mode == row_mode
        host = PipelineHost(backend=backends.BACKENDS[device], compile_mode="regional")
        assert host.lora_mode == row_mode and host.adapter_refusal() is None
        assert lora_modes.bakes_weights(backends.BACKENDS[device], "regional") is (row_mode == "compile")


def test_a_tp_worker_with_an_adapter_allow_list_is_refused_at_start():
    import json

    from typer.testing import CliRunner

    from diffq.app.cli import app

    args = ["worker", "--plan", "--broker", "memory://", "--workers", "2", "--tp", "2"]
    result = CliRunner().invoke(app, args, env={"DIFFQ_ALLOWED_ADAPTERS": '["s3://loras"]', "COLUMNS": "400"})
    assert result.exit_code == 2
    assert "LoRA adapters on a tensor-parallel group (--tp 2)" in result.output
    assert "DIFFQ_ALLOWED_ADAPTERS is set" in result.output
    result = CliRunner().invoke(app, args, env={"DIFFQ_ALLOWED_ADAPTERS": None})
    assert result.exit_code == 0, result.output
    assert [rank["lora_mode"] for group in json.loads(result.stdout) for rank in group["ranks"]] == ["swap", "swap"]
    # A LoRA run's queue (its name ends in the layout label) named to a --tp worker.
    from diffq.core.adapters import AdapterLayout
    from diffq.core.contract import ShapeKey, queue_name

    label = AdapterLayout(targets=("x",), rank=4).label
    queue = queue_name(ShapeKey(model="m", height=64, width=64, batch_size=1, max_sequence_length=64, cfg=False,
                                lora=label))
    result = CliRunner().invoke(app, [*args, "--queues", queue], env={"DIFFQ_ALLOWED_ADAPTERS": None,
                                                                       "COLUMNS": "400"})
    assert result.exit_code == 2 and f"(queue {queue} carries a LoRA layout)" in result.output, result.output


def test_a_tp_group_does_not_discover_lora_runs_queues():
    """A --tp worker without --queues leaves a LoRA run's queue (its name ends in the layout
    label) to the single-device workers, rather than taking its batches and failing them."""
    from diffq.core.adapters import AdapterLayout
    from diffq.core.contract import ShapeKey, queue_name
    from diffq.core.transports import transport_for
    from diffq.worker.delivery.routing import Discovery

    key = ShapeKey(model="m", height=64, width=64, batch_size=1, max_sequence_length=64, cfg=False)
    plain = queue_name(key)
    lora = queue_name(key.model_copy(update={"lora": AdapterLayout(targets=("x",), rank=4).label}))
    transport = transport_for("redis://x")
    assert Discovery(transport).keep([plain, lora]) == [plain, lora]
    assert Discovery(transport, layouts=False).keep([plain, lora]) == [plain]
