"""Tensor-parallel worker groups: N ranks that behave as one queue consumer.

The group protocol runs for real on CPU with gloo and 2 ranks over the tiny pipeline
(replicated weights: diffusers shards on cuda / neuron / tpu only). The sharded path
is pinned by contract tests of what each rank passes, citing ../shared/BACKENDS.md.
"""

from __future__ import annotations

import io
import json
import socket

import pytest
from PIL import Image
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.producer.submit import submit
from diffq.core.storage import open_storage
from diffq.worker.backends import get_backend
from diffq.worker.supervisor import Supervisor, plan_children
from diffq.worker.tensor_parallel import Group, shard_load_kwargs, sharded_components, sharding_plan
from tests.helpers import assert_run_complete, wait_until


def plan(*args: str) -> list[dict]:
    result = CliRunner().invoke(app, ["worker", "--broker", "redis://127.0.0.1:1/0", "--queues", "q",
                                      "--plan", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


# --- planning: groups, ranks, environment -------------------------------------------


def test_cores_0_7_tp8_is_one_group_of_eight_ranks():
    groups = plan("--device", "neuron", "--cores", "0-7", "--tp", "8")
    assert len(groups) == 1
    group = groups[0]
    assert (group["world_size"], group["devices"], group["master"]) == (8, list(range(8)), "127.0.0.1:29500")
    assert [r["rank"] for r in group["ranks"]] == list(range(8))
    assert [r["consumes"] for r in group["ranks"]] == [True] + [False] * 7
    for rank in group["ranks"]:
        env = rank["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank["rank"]),) * 2 + ("8",)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
        # BACKENDS.md Trainium "pin a process to a core": NEURON_RT_VISIBLE_CORES takes an
        # inclusive range; every rank sees its group's cores and binds LOCAL_RANK (torchrun's
        # layout, "distributed": one process per core).
        assert env["NEURON_RT_VISIBLE_CORES"] == "0-7"


def test_cores_0_7_tp4_is_two_groups_on_their_own_ports():
    groups = plan("--device", "neuron", "--cores", "0-7", "--tp", "4")
    assert [g["devices"] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g["master"] for g in groups] == ["127.0.0.1:29500", "127.0.0.1:29501"]
    assert [r["env"]["NEURON_RT_VISIBLE_CORES"] for r in groups[1]["ranks"]] == ["4-7"] * 4
    assert [r["env"]["RANK"] for r in groups[1]["ranks"]] == ["0", "1", "2", "3"]
    assert len({r["name"] for g in groups for r in g["ranks"]}) == 8


def test_tpu_group_environment():
    # BACKENDS.md TPU "pin a process to a chip": TPU_VISIBLE_DEVICES per process, 1,1,1
    # chips per process, a distinct TPU_PROCESS_PORT; "distributed": tpu_dist. A group of
    # one-chip processes also learns the process bounds, every peer's address and its task id.
    (group,) = plan("--device", "tpu", "--chips", "0-3", "--tp", "4")
    envs = [r["env"] for r in group["ranks"]]
    assert [e["TPU_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["TPU_PROCESS_PORT"] for e in envs] == ["8476", "8477", "8478", "8479"]
    assert [e["CLOUD_TPU_TASK_ID"] for e in envs] == ["0", "1", "2", "3"]
    for env in envs:
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert env["TPU_PROCESS_BOUNDS"] == "2,2,1"
        assert env["TPU_PROCESS_ADDRESSES"] == "localhost:8476,localhost:8477,localhost:8478,localhost:8479"
        assert env["WORLD_SIZE"] == "4"
    assert group["sharding"]["dist_backend"] == "tpu_dist"


def test_cuda_group_sees_its_gpus():
    groups = plan("--device", "cuda", "--gpus", "0-3", "--tp", "2")
    assert [[r["env"]["CUDA_VISIBLE_DEVICES"] for r in g["ranks"]] for g in groups] == [["0,1", "0,1"], ["2,3", "2,3"]]
    assert groups[0]["sharding"]["dist_backend"] == "nccl"


@pytest.mark.parametrize("args, message", [
    (["--device", "neuron", "--cores", "0-7", "--tp", "3"], "--tp 3 must divide the 8 devices"),
    (["--device", "neuron", "--cores", "0,2,4,6", "--tp", "2"], "consecutive cores"),
    (["--device", "tpu", "--chips", "0-2", "--tp", "3"], "no 2-D process layout"),
    (["--device", "cuda", "--gpus", "0,1", "--tp", "2", "--offload", "model"], "--offload cannot be combined"),
])
def test_impossible_groups_fail_before_starting(args, message):
    result = CliRunner().invoke(app, ["worker", "--broker", "redis://127.0.0.1:1/0", "--queues", "q",
                                      "--plan", *args])
    assert result.exit_code != 0
    assert message in result.output


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
    result = CliRunner().invoke(app, ["worker", "--broker", "redis://127.0.0.1:1/0", *args, "--plan"])
    assert result.exit_code == 0, result.output
    (group,) = json.loads(result.output)
    assert group["world_size"] == 8 and group["ranks"][0]["queues"] == [shape.queue]
    with pytest.raises(ValueError, match="--tp 3 must divide"):
        fleet.worker_args(shape, fleet.FleetOptions(device="neuron", devices_per_pod=8, tp=3))
