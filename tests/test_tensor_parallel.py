"""Tensor-parallel worker groups: N ranks that behave as one queue consumer.

The group protocol runs for real on CPU with gloo and 2 ranks over the tiny pipeline
(replicated weights: diffusers shards on cuda / neuron / tpu only). The sharded path
is pinned by contract tests of what each rank passes, citing ../shared/BACKENDS.md.
"""

from __future__ import annotations

import dataclasses
import io
import json
import socket

import pytest
from PIL import Image
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.producer.submit import submit
from diffq.core.storage import open_storage
from diffq.worker.device.backends import get_backend
from diffq.worker.process.supervisor import Supervisor, plan_children
from diffq.worker.device.tensor_parallel import (Group, RankMisplaced, check_shard_device, shard_device_index,
                                          shard_load_kwargs, sharded_components, sharding_plan)
from tests.helpers import assert_run_complete, wait_until


def plan(*args: str) -> list[dict]:
    result = CliRunner().invoke(app, ["worker", "--broker", "redis://127.0.0.1:1/0", "--queues", "q",
                                      "--plan", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --- planning: groups, ranks, environment -------------------------------------------


TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_cores_0_7_tp8_is_one_group_of_eight_ranks():
    groups = plan("--device", "neuron", "--cores", "0-7", "--tp", "8")
    assert len(groups) == 1
    group = groups[0]
    assert (group["world_size"], group["devices"], group["master"]) == (8, list(range(8)), "127.0.0.1:29500")
    assert [r["rank"] for r in group["ranks"]] == list(range(8))
    assert [r["consumes"] for r in group["ranks"]] == [True] + [False] * 7
    for rank in group["ranks"]:
        env = rank["env"]
        assert [env[k] for k in TORCHRUN] == [str(rank["rank"]), str(rank["rank"]), "8", "8", "127.0.0.1", "29500"]
        # BACKENDS.md Trainium "tensor parallel: what the backend checks"
        # (torch_neuronx/distributed/backend.py, _set_rt_visible_cores): the process sees
        # exactly one core, set explicitly; NEURON_RT_ROOT_COMM_ID is the backend's to set.
        assert env["NEURON_RT_VISIBLE_CORES"] == str(rank["rank"])
        assert "NEURON_RT_ROOT_COMM_ID" not in env and rank["unset"] == ["NEURON_RT_ROOT_COMM_ID"]


def test_cores_0_7_tp4_is_two_groups_on_their_own_ports():
    groups = plan("--device", "neuron", "--cores", "0-7", "--tp", "4")
    assert [g["devices"] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g["master"] for g in groups] == ["127.0.0.1:29500", "127.0.0.1:29501"]
    # The second group's ranks are LOCAL_RANK 0-3 but cores 4-7: set explicitly, never inferred.
    assert [r["env"]["NEURON_RT_VISIBLE_CORES"] for r in groups[1]["ranks"]] == ["4", "5", "6", "7"]
    assert [r["env"]["LOCAL_RANK"] for r in groups[1]["ranks"]] == ["0", "1", "2", "3"]
    assert [r["env"]["MASTER_PORT"] for r in groups[1]["ranks"]] == ["29501"] * 4
    assert len({r["name"] for g in groups for r in g["ranks"]}) == 8


def test_neuron_groups_need_no_consecutive_cores():
    (group,) = plan("--device", "neuron", "--cores", "0,2,4,6", "--tp", "4")
    assert [r["env"]["NEURON_RT_VISIBLE_CORES"] for r in group["ranks"]] == ["0", "2", "4", "6"]


def test_tpu_group_environment():
    # BACKENDS.md TPU "tensor parallel: launch env": torch_tpu requires RANK, LOCAL_RANK,
    # WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCH_TPU_SLICEBUILDER_ADDRESSES and
    # TORCH_TPU_TOPOLOGY (csrc/distributed/slicebuilder/discovery.cc,
    # ValidateRequiredDistributedEnvVars); its launcher sets the last two, one
    # localhost:<port> per rank and the same string everywhere
    # (_internal/distributed/launchers/singlehost_wrapper.py, prepare_tpu_environment).
    (group,) = plan("--device", "tpu", "--chips", "0-3", "--tp", "4", "--tpu-generation", "v6e")
    envs = [r["env"] for r in group["ranks"]]
    addresses = {e["TORCH_TPU_SLICEBUILDER_ADDRESSES"] for e in envs}
    assert addresses == {"localhost:8476,localhost:8477,localhost:8478,localhost:8479"}
    for rank, env in enumerate(envs):
        assert [env[k] for k in TORCHRUN] == [str(rank), str(rank), "4", "4", "127.0.0.1", "29500"]
        assert env["TORCH_TPU_TOPOLOGY"] == "2,2,1"  # tpu_topology.py: v6e, 4 chips
        # The rank's chip, named: newer torch_tpu honours a single TPU_VISIBLE_DEVICES per
        # rank (csrc/common/environment.cc, InitializeDistributedEnvironment), so one
        # inherited from the pod would put every rank on it; older releases bind chip
        # LOCAL_RANK (torch_tpu/common/environment.cc), the same chip here.
        assert env["TPU_VISIBLE_DEVICES"] == env["TPU_VISIBLE_CHIPS"] == env["LOCAL_RANK"] == str(rank)
        # torch_tpu writes these itself: setting them would be useless.
        for overwritten in ("TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID",
                            "ALLOW_MULTIPLE_LIBTPU_LOAD", "LIBTPU_INIT_ARGS"):
            assert overwritten not in env
    assert group["sharding"]["dist_backend"] == "tpu_dist"


def test_tpu_v7_group_of_two():
    (group,) = plan("--device", "tpu", "--chips", "0-1", "--tp", "2", "--tpu-generation", "v7")
    assert [r["env"]["TORCH_TPU_TOPOLOGY"] for r in group["ranks"]] == ["1,1,1,2"] * 2
    assert group["ranks"][0]["env"]["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "localhost:8476,localhost:8477"


def test_generation_is_the_option_and_tpu_generation_its_alias():
    """The choices come from the backend row's `generations`; the old name still works."""
    assert plan("--device", "tpu", "--chips", "0-1", "--tp", "2", "--generation", "v7") == \
        plan("--device", "tpu", "--chips", "0-1", "--tp", "2", "--tpu-generation", "v7")


def test_tpu_generation_is_detected_and_a_set_topology_wins(monkeypatch):
    from diffq.worker.device import backends

    tpu = backends.get_backend("tpu")
    monkeypatch.setitem(backends.BACKENDS, "tpu", dataclasses.replace(tpu, detect_generation=lambda: "v5e"))
    (group,) = plan("--device", "tpu", "--chips", "0-7", "--tp", "8")
    assert {r["env"]["TORCH_TPU_TOPOLOGY"] for r in group["ranks"]} == {"2,2,2"}
    monkeypatch.setenv("TORCH_TPU_TOPOLOGY", "4,2,1")
    (group,) = plan("--device", "tpu", "--chips", "0-7", "--tp", "8")
    assert {r["env"]["TORCH_TPU_TOPOLOGY"] for r in group["ranks"]} == {"4,2,1"}


def test_cuda_group_sees_its_gpus():
    groups = plan("--device", "cuda", "--gpus", "0-3", "--tp", "2")
    assert [[r["env"]["CUDA_VISIBLE_DEVICES"] for r in g["ranks"]] for g in groups] == [["0,1", "0,1"], ["2,3", "2,3"]]
    assert groups[0]["sharding"]["dist_backend"] == "nccl"


@pytest.mark.parametrize("args, message", [
    (["--device", "neuron", "--cores", "0-7", "--tp", "3"], "--tp 3 must divide the 8 devices"),
    (["--device", "tpu", "--chips", "0-1", "--tp", "2", "--tpu-generation", "v6e"],
     "--tp 2 on TPU v6e: torch_tpu's topology table (tpu_topology.py) has groups of 4, 8 chips only"),
    (["--device", "tpu", "--chips", "0-2", "--tp", "3", "--tpu-generation", "v7"], "has groups of 2, 4, 8 chips"),
    (["--device", "tpu", "--chips", "0-7", "--tp", "4", "--tpu-generation", "v6e"],
     "2 TPU groups of 4 chips on one host are unverified and refused"),
    (["--device", "tpu", "--chips", "4-7", "--tp", "4", "--tpu-generation", "v6e"], "uses chips 0-3"),
    (["--device", "tpu", "--chips", "0-3", "--tp", "4"], "pass --generation v5p|v5e|v6e|v7"),
    (["--device", "cuda", "--gpus", "0,1", "--tp", "2", "--offload", "model"], "--offload cannot be combined"),
])
def test_impossible_groups_fail_before_starting(args, message):
    result = CliRunner().invoke(app, ["worker", "--broker", "redis://127.0.0.1:1/0", "--queues", "q",
                                      "--plan", *args])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert message in result.output


def test_nothing_touches_the_device_before_init_process_group(monkeypatch):
    """BACKENDS.md Trainium "tensor parallel": init_process_group(backend="neuron") asserts
    the runtime is not initialised yet (torch_neuronx/distributed/backend.py); the rank's
    device is torch.neuron.current_device() after it. A one-rank gloo group stands in."""
    import sys
    import types

    import torch
    import torch.distributed as dist

    from diffq.worker.device.tensor_parallel import join

    calls = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: calls.append(("set_device", i)))
    init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: (calls.append(("init", kw["backend"])), init(**kw)))
    fake = types.ModuleType("torch.neuron")
    fake.current_device = lambda: calls.append(("current_device",)) or 5
    monkeypatch.setitem(sys.modules, "torch.neuron", fake)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    neuron = dataclasses.replace(get_backend("neuron"), dist_backend="gloo", tensor_parallel=False)
    assert neuron.rank_device == "torch.neuron.current_device" and not neuron.bind_local_rank
    group = join(0, 1, neuron)
    try:
        # ...and the rank's weights go to the device torch-neuronx names after it (its
        # LOCAL_RANK: distributed/backend.py, _set_local_device_start_index).
        assert calls == [("init", "gloo"), ("current_device",), ("set_device", 5)]
        assert group.device == "neuron:5"
    finally:
        dist.destroy_process_group()
    # CUDA ranks see the whole group and bind LOCAL_RANK first, as torchrun's do.
    assert get_backend("cuda").bind_local_rank and get_backend("cuda").rank_device is None


@pytest.mark.parametrize("rank, count, bound", [
    *[(r, 1, 0) for r in range(4)],  # torch_tpu: each rank addresses one chip, tpu:0, its own
    *[(r, 4, r) for r in range(4)],  # torch-neuronx: count = local world size, device id = LOCAL_RANK
    *[(r, 2, r) for r in range(2)],  # cuda: a rank sees its group's GPUs and binds LOCAL_RANK
])
def test_diffusers_puts_each_shard_on_its_ranks_device(rank, count, bound):
    # diffusers models/modeling_utils.py (_resolve_parallel_config): device =
    # rank % torch.accelerator.device_count(). On torch_tpu that is tpu:0 on every rank,
    # and right: a process is bound to its one device (_internal/device/_device_module.py,
    # set_device refuses another index; device_count is the addressable count once the
    # runtime is up, csrc/eager/tpu_hooks.cc).
    assert shard_device_index(rank, count) == bound
    check_shard_device(rank, count, bound)


def test_a_shard_bound_for_another_ranks_device_is_refused():
    # Before its runtime starts torch_tpu counts the host's chips (hardware.get_tpu_device_count
    # in _device_module.py): rank 1 would be told tpu:1, not its own tpu:0.
    with pytest.raises(RankMisplaced, match="rank 1 is bound to device 0, but diffusers would load its shard "
                                            "onto device 1"):
        check_shard_device(1, 4, 0)
    with pytest.raises(RankMisplaced):
        check_shard_device(0, 0, 0)  # no device seen at all


def test_a_sharded_rank_starts_its_runtime_before_counting(monkeypatch):
    """join on the sharded path: bind the rank's device, put a tensor on it (torch_tpu
    counts per process only once its runtime is up), then check diffusers' placement and
    build the mesh. A one-rank gloo group on the CPU stands in for a TPU rank."""
    import torch
    import torch.distributed as dist

    from diffq.worker.device import tensor_parallel
    from diffq.worker.device.tensor_parallel import join

    calls = []
    real_empty = torch.empty
    # One rank planned as a sharded group of one (a mesh of one device).
    monkeypatch.setattr(tensor_parallel, "sharding_plan",
                        lambda backend, world_size: dataclasses.replace(sharding_plan(backend, 2), mesh_shape=(1,)))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: calls.append("index") or 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: calls.append("count") or 1)
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: calls.append(("empty", str(kw["device"])))
                        or real_empty(*a, device="cpu"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    tpu = dataclasses.replace(get_backend("tpu"), dist_backend="gloo", torch_device="cpu")
    assert get_backend("tpu").rank_device == "torch.accelerator.current_device_index"
    group = join(0, 1, tpu)
    try:
        assert calls[:5] == ["index", ("set_device", 0), ("empty", "cpu:0"), "count", "index"]
        assert group.device == "cpu:0" and group.mesh is not None
    finally:
        group.leave()


# --- contract: what each rank passes on the sharded path ---------------------------


@pytest.mark.parametrize("device, dist_backend", [("neuron", "neuron"), ("tpu", "tpu_dist"), ("cuda", "nccl")])
def test_sharding_plan_per_backend(device, dist_backend):
    # BACKENDS.md Trainium/TPU "distributed": dist.init_process_group(backend="neuron" |
    # "tpu_dist"), DeviceMesh("neuron" | "tpu", ...); transformer via
    # TensorParallelConfig(mesh=mesh), text encoder via DistributedConfig(tp_plan="auto").
    # diffusers 0.42.1: TensorParallelConfig TP devices are cuda, neuron, tpu, xpu.
    shard = sharding_plan(get_backend(device), 4)
    assert (shard.dist_backend, shard.mesh_device, shard.mesh_shape, shard.mesh_dim_names) == (
        dist_backend, device, (4,), ("tp",))
    assert (shard.transformer, shard.text_encoders) == ("tensor-parallel", "tp_plan=auto")


def test_cpu_groups_replicate_weights():
    # diffusers' tensor parallelism does not support CPU: a gloo group holds full copies.
    shard = sharding_plan(get_backend("cpu"), 2)
    assert (shard.dist_backend, shard.transformer, shard.text_encoders) == ("gloo", "replicated", "replicated")


@pytest.mark.parametrize("device", ["neuron", "tpu", "cuda"])
def test_each_rank_loads_its_shard(device, tiny_pipelines, monkeypatch):
    """sharded_components passes the mesh to the transformer and tp_plan='auto' to the
    Qwen3 text encoder (it declares a TP plan); the VAE and tokenizer load whole."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel, TensorParallelConfig
    from transformers import DistributedConfig, Qwen3ForCausalLM

    calls = {}

    def recorder(cls):
        def from_pretrained(source, subfolder=None, dtype=None, **kwargs):
            calls[subfolder] = (cls.__name__, kwargs)
            return f"<{subfolder} shard>"
        return from_pretrained

    for cls in (Flux2Transformer2DModel, Qwen3ForCausalLM, AutoencoderKLFlux2):
        monkeypatch.setattr(cls, "from_pretrained", recorder(cls))
    mesh = object()  # a DeviceMesh(device, (4,), mesh_dim_names=("tp",)) on the hardware
    group = Group(rank=1, world_size=4, backend=get_backend(device))
    group.mesh = mesh
    components = sharded_components(tiny_pipelines["flux2-klein"], "bf16", group)
    assert components == {"transformer": "<transformer shard>", "text_encoder": "<text_encoder shard>"}
    transformer_kwargs = calls["transformer"][1]
    assert set(transformer_kwargs) == {"parallel_config"}
    assert isinstance(transformer_kwargs["parallel_config"], TensorParallelConfig)
    assert transformer_kwargs["parallel_config"].mesh is mesh
    encoder_kwargs = calls["text_encoder"][1]
    assert isinstance(encoder_kwargs["distributed_config"], DistributedConfig)
    assert encoder_kwargs["distributed_config"].tp_plan == "auto"
    assert "vae" not in calls


def test_encoders_without_a_tp_plan_are_replicated(tiny_pipelines):
    # Flux.1's CLIP and T5 encoders declare no TP plan in transformers: loaded whole.
    from transformers import CLIPTextModel, T5EncoderModel

    group = Group(rank=0, world_size=2, backend=get_backend("cuda"))
    group.mesh = object()
    source = tiny_pipelines["flux"]
    assert shard_load_kwargs("transformers", CLIPTextModel, source, "text_encoder", group) is None
    assert shard_load_kwargs("transformers", T5EncoderModel, source, "text_encoder_2", group) is None


# --- the group protocol, for real: gloo, 2 ranks, tiny pipeline ----------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_prompts(path, n):
    path.write_text("".join(json.dumps({"id": f"t{i:03d}", "prompt": f"prompt {i}"}) + "\n" for i in range(n)))
    return path


def run_with_group(tmp_path, broker: str, model: str, items: int):
    """Submit `items` prompts and let one CPU group of 2 ranks produce them all."""
    prompts = write_prompts(tmp_path / "p.jsonl", items)
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=model, broker_url=broker, batch_size=4, steps=2)
    specs = plan_children(device="cpu", devices=[0, 1], tp=2, master_port=free_port(), broker_url=broker,
                          queues=list(result.queues), models=[model], loglevel="ERROR")
    supervisor = Supervisor(specs, group_grace=30.0)
    supervisor.start()
    try:
        wait_until(out, supervisor, lambda s: s.done >= items, timeout=300)
    finally:
        supervisor.stop(timeout=60)
    return prompts, out, supervisor


def records(out: str) -> list[dict]:
    storage = open_storage(out)
    return [json.loads(line) for key in storage.list("records/")
            for line in storage.get_bytes(key).decode().splitlines() if line]


@pytest.mark.slow
def test_group_consumes_once_and_every_rank_makes_the_same_images(tmp_path, redis_server, tiny_model):
    prompts, out, supervisor = run_with_group(tmp_path, redis_server, tiny_model, 12)
    assert_run_complete(out, prompts, steps=2, model=tiny_model)
    lines = records(out)
    # One consumer: rank 0 wrote every record; both ranks' image digests agreed on each.
    assert {line["worker"].split("@")[0] for line in lines} == {"diffq-cpu-tp0-r0"}
    assert all(line["tp_world_size"] == 2 and line["tp_ranks_agree"] for line in lines)
    assert supervisor.deaths == 0
    # The group stopped together on the warm shutdown: both ranks exited cleanly.
    assert [child.process.exitcode for child in supervisor.children] == [0, 0]


@pytest.mark.slow
@pytest.mark.chaos
def test_killing_a_rank_mid_batch_produces_it_exactly_once(tmp_path, redis_server, tiny_model, monkeypatch):
    marker = tmp_path / "rank1-killed"
    monkeypatch.setenv("DIFFQ_FAULT_KILL_RANK", f"1:{marker}")  # rank 1 dies on its first batch, once
    prompts, out, supervisor = run_with_group(tmp_path, redis_server, tiny_model, 16)
    assert marker.exists(), "the fault fired"
    assert supervisor.deaths == 1 and supervisor.units[0].restarts == 1
    records_ = assert_run_complete(out, prompts, steps=2, model=tiny_model)  # each item exactly once
    assert len(records_) == 16
    for line in records(out):
        image = Image.open(io.BytesIO(open_storage(out).get_bytes(line["file_name"])))
        assert image.size == (128, 128)
        assert line["tp_ranks_agree"]


def test_fleet_manifests_run_one_group_per_pod():
    """A Trn2 pod of 8 cores with --tp 8: its container args are one 8-rank group."""
    from diffq.app import fleet

    options = fleet.FleetOptions(device="neuron", devices_per_pod=8, tp=8)
    (shape,) = fleet.shape_keys("black-forest-labs/FLUX.2-dev", [(1024, 1024)], batch_size=1,
                                max_sequence_length=512, guidance_scale=4.0, dtype="bfloat16")
    args = fleet.worker_args(shape, options)
    # The manifest says --cores auto: the Neuron device plugin's allocation decides.
    assert args[args.index("--cores") + 1] == "auto"
    result = CliRunner().invoke(app, ["worker", "--broker", "redis://127.0.0.1:1/0", *args, "--plan"],
                                env={"NEURON_RT_VISIBLE_CORES": "8-15"})
    assert result.exit_code == 0, result.output
    (group,) = json.loads(result.stdout)
    assert group["world_size"] == 8 and group["ranks"][0]["queues"] == [shape.queue]
    assert [r["env"]["NEURON_RT_VISIBLE_CORES"] for r in group["ranks"]] == [str(c) for c in range(8, 16)]
    with pytest.raises(ValueError, match="--tp 3 must divide"):
        fleet.worker_args(shape, fleet.FleetOptions(device="neuron", devices_per_pod=8, tp=3))
