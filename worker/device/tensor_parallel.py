"""Tensor-parallel groups at run time: N ranks that behave as one queue consumer.

Rank 0 is the group's only consumer (an ordinary Celery worker). For every batch it
broadcasts (shape, params, items) to the other ranks over a CPU control group (gloo),
every rank runs the pipeline with the same per-item seeds — with tensor parallelism
every rank's forward pass takes part in the collectives — and rank 0 gathers a digest
of every rank's images before it alone stores them. The other ranks loop in `follow`
until rank 0 says stop or its connection drops.

A rank that dies breaks the group: rank 0 hands the batch in hand back to the broker
(`GroupBroken` → reject with requeue), stops, and the supervisor restarts the whole
group. Idle ranks wait on the gloo control group, never on a device collective, so an
idle group holds no device kernel and trips no NCCL/Neuron watchdog.

Loading: on devices diffusers can shard (the backend table's `tensor_parallel`), the
transformer is read with `parallel_config=TensorParallelConfig(mesh=mesh)` so each
rank materialises only its shard, text encoders whose config declares a TP plan with
transformers' `DistributedConfig(tp_plan="auto")`, the rest replicated on the rank's
device. On CPU (gloo) every rank holds replicated weights: the group protocol is the
same, which is what the CPU tests exercise.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import timedelta

from diffq.core.contract import BatchItem, BatchParams, ShapeKey
from diffq.worker.device.backends import Backend

log = logging.getLogger(__name__)

# An idle rank waits on the control group until rank 0 has a batch: for as long
# as the queues stay empty. A dead peer is noticed at once (closed socket) anyway.
CONTROL_TIMEOUT = timedelta(days=30)
# Rendezvous and model loading: every rank must arrive within this.
INIT_TIMEOUT = timedelta(minutes=30)
# Exit code of a rank whose group broke: not fatal, the supervisor restarts the group.
EXIT_GROUP_BROKEN = 75


class GroupBroken(RuntimeError):
    """A rank left the group (died, or its connection dropped)."""


class RanksDiverged(RuntimeError):
    """Ranks produced different images for the same batch: none of them is stored."""


class RankMisplaced(RuntimeError):
    """diffusers would load a rank's shard onto a device other than the rank's own: no restart helps."""


def shard_device_index(rank: int, device_count: int) -> int:
    """The device diffusers puts rank's shard on: rank % torch.accelerator.device_count()
    (diffusers models/modeling_utils.py, ModelMixin._resolve_parallel_config)."""
    return rank % device_count if device_count > 0 else -1


def check_shard_device(rank: int, device_count: int, bound: int) -> None:
    """Refuse a group whose ranks' shards would not land on their own devices."""
    placed = shard_device_index(rank, device_count)
    if placed != bound:
        raise RankMisplaced(f"rank {rank} is bound to device {bound}, but diffusers would load its shard onto "
                            f"device {placed} (rank % the {device_count} devices this process sees)")


@dataclass(frozen=True)
class ShardingPlan:
    """What each rank passes when it loads a model; pure data, pinned by a contract test."""

    dist_backend: str
    mesh_device: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    # "tensor-parallel" (diffusers' TensorParallelConfig) or "replicated".
    transformer: str
    # "tp_plan=auto" (transformers' DistributedConfig) where the encoder declares a
    # TP plan, else "replicated".
    text_encoders: str


def sharding_plan(backend: Backend, world_size: int) -> ShardingPlan:
    sharded = backend.tensor_parallel and world_size > 1
    return ShardingPlan(
        dist_backend=backend.dist_backend,
        mesh_device=backend.torch_device,
        mesh_shape=(world_size,),
        mesh_dim_names=("tp",),
        transformer="tensor-parallel" if sharded else "replicated",
        text_encoders="tp_plan=auto" if sharded else "replicated",
    )


def image_digest(image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()[:16]


class Group:
    """One rank's membership: the batch hand-off and the agreement check."""

    def __init__(self, rank: int, world_size: int, backend: Backend, control=None):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.control = control
        self.mesh = None
        # The device this rank's weights go to (the backend's, or e.g. neuron:<index>).
        self.device = backend.torch_device

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _collective(self, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.control, **kwargs)
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError on a dead peer
            raise GroupBroken(f"rank {self.rank}/{self.world_size}: {type(exc).__name__}: {exc}") from exc

    def _broadcast(self, payload):
        import torch.distributed as dist

        box = [payload]
        self._collective(dist.broadcast_object_list, box, src=0)
        return box[0]

    # rank 0 ------------------------------------------------------------------
    def announce(self, shape: ShapeKey, params: BatchParams, items: list[BatchItem]) -> None:
        self._broadcast({"shape": shape.model_dump(mode="json"), "params": params.model_dump(mode="json"),
                         "items": [item.model_dump(mode="json") for item in items]})

    def agree(self, images: list | None) -> dict:
        """Gather every rank's image digests; they must all match rank 0's."""
        import torch.distributed as dist

        mine = [image_digest(image) for image in images] if images is not None else None
        gathered = [None] * self.world_size
        self._collective(dist.gather_object, mine, gathered, dst=0)
        if mine is None:
            return {}
        for rank, digests in enumerate(gathered):
            if digests is None:
                raise RanksDiverged(f"rank {rank} failed this batch (its log says why)")
            if digests != mine:
                raise RanksDiverged(f"rank {rank} produced images {digests}, rank 0 {mine}")
        return {"tp_world_size": self.world_size, "tp_ranks_agree": True}

    def stop(self) -> None:
        try:
            self._broadcast(None)
        except GroupBroken:
            pass  # the others are gone already
        self.leave()

    def leave(self) -> None:
        """Tear the process groups down before the interpreter exits: left to exit-time
        destructors, a gloo thread still running aborts the process (SIGABRT,
        "terminate called without an active exception") after a clean run."""
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # leaving anyway
            log.warning("rank %d: tearing down its process group: %r", self.rank, exc)

    # ranks > 0 ---------------------------------------------------------------
    def receive(self) -> tuple[ShapeKey, BatchParams, list[BatchItem]] | None:
        payload = self._broadcast(None)
        if payload is None:
            return None
        return (ShapeKey.model_validate(payload["shape"]), BatchParams.model_validate(payload["params"]),
                [BatchItem.model_validate(item) for item in payload["items"]])

    def report(self, images: list | None) -> None:
        import torch.distributed as dist

        digests = [image_digest(image) for image in images] if images is not None else None
        self._collective(dist.gather_object, digests, None, dst=0)


def join(rank: int, world_size: int, backend: Backend) -> Group:
    """Rendezvous (env://: MASTER_ADDR/MASTER_PORT set by the supervisor) and build the groups.

    Nothing touches the device before `init_process_group` unless the backend binds
    LOCAL_RANK first (cuda): torch-neuronx asserts its runtime is not yet initialised
    (torch_neuronx/distributed/backend.py); its device is known only after.
    """
    import torch
    import torch.distributed as dist

    from diffq.worker.device.backends import device_count, resolve

    if backend.bind_local_rank:
        # The rank sees every device of its group and binds the one at LOCAL_RANK.
        torch.accelerator.set_device_index(rank)
    try:
        dist.init_process_group(backend=backend.dist_backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=INIT_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    except Exception as exc:
        raise GroupBroken(f"rank {rank}/{world_size} could not join its group: {exc}") from exc
    group = Group(rank, world_size, backend, control)
    if backend.rank_device:
        # The rank's own device, named, so what it loads whole goes where its shard is:
        # a torch-neuronx rank's device id is its LOCAL_RANK after init_process_group
        # (distributed/backend.py, _set_local_device_start_index), a torch_tpu rank's is
        # 0, its only device. (DeviceMesh binds LOCAL_RANK itself only where the device
        # module says the runtime has not started, torch/distributed/device_mesh.py
        # _setup_world_group_and_device; init_process_group has started torch-neuronx's,
        # _neuron_runtime_setup.)
        index = int(resolve(backend.rank_device)())
        torch.accelerator.set_device_index(index)
        group.device = f"{backend.torch_device}:{index}"
    plan = sharding_plan(backend, world_size)
    if plan.transformer == "tensor-parallel":
        from torch.distributed.device_mesh import init_device_mesh

        # A tensor on the device starts its runtime. Before that torch_tpu counts the
        # host's chips, not the process's one (_internal/device/_device_module.py,
        # device_count), and diffusers places the shard by that count; and DeviceMesh
        # would bind LOCAL_RANK, an index torch_tpu's set_device refuses on rank > 0.
        torch.empty(0, device=group.device)
        check_shard_device(rank, device_count(backend), torch.accelerator.current_device_index())
        group.mesh = init_device_mesh(plan.mesh_device, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    log.info("rank %d/%d joined (%s, weights %s)", rank, world_size, backend.dist_backend, plan.transformer)
    return group


def sharded_components(source: str, dtype, group: Group, family=None) -> dict:
    """Components to pass to `DiffusionPipeline.from_pretrained`, each read as its shard.

    Only components that can be sharded are returned; the pipeline loads the others
    whole, and the caller moves only those to the device. Text encoders are sharded
    only where the family table lists them (`Family.tp_text_encoders`).
    """
    if group.mesh is None:
        return {}
    import importlib

    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(source)
    components = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
            continue
        library, class_name = entry
        if library not in ("diffusers", "transformers"):
            continue
        if library == "transformers" and family is not None and name not in family.tp_text_encoders:
            continue
        cls = getattr(importlib.import_module(library), class_name)
        kwargs = shard_load_kwargs(library, cls, source, name, group)
        if kwargs is not None:
            components[name] = cls.from_pretrained(source, subfolder=name, dtype=dtype, **kwargs)
    return components


def shard_load_kwargs(library: str, cls, source: str, subfolder: str, group: Group) -> dict | None:
    """The sharding kwargs of one component's `from_pretrained`, or None to load it whole."""
    if library == "diffusers":
        if not getattr(cls, "_tp_plan", None):
            return None
        from diffusers import TensorParallelConfig

        return {"parallel_config": TensorParallelConfig(mesh=group.mesh)}
    from transformers import DistributedConfig, PreTrainedModel

    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        return None  # a tokenizer or processor: nothing to shard
    config = cls.config_class.from_pretrained(source, subfolder=subfolder)
    # A composite model (Mistral3: Pixtral vision tower + Mistral text model) declares
    # its plan on the text model's config, not its own.
    if not (getattr(config, "base_model_tp_plan", None)
            or getattr(getattr(config, "text_config", None), "base_model_tp_plan", None)):
        return None
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def follow(group: Group, host, models: list[str], dtype: str) -> int:
    """Ranks > 0: generate what rank 0 announces until it says stop. Returns an exit code."""
    try:
        return _follow_batches(group, host, models, dtype)
    finally:
        group.leave()


def _follow_batches(group: Group, host, models: list[str], dtype: str) -> int:
    from diffq.worker.device import faults

    for model in models:  # the same loads in the same order as rank 0 (loading may be collective)
        host.pipeline(model, dtype)
    while True:
        try:
            batch = group.receive()
        except GroupBroken as exc:
            log.warning("%s; leaving", exc)
            return EXIT_GROUP_BROKEN
        if batch is None:
            return 0
        shape, params, items = batch
        faults.check_rank(group.rank, items)
        try:
            images = host.generate(shape, params, items).images
        except Exception as exc:  # rank 0 sees it as a failed batch and retries it
            log.error("rank %d failed batch: %s: %s", group.rank, type(exc).__name__, exc)
            images = None
        try:
            group.report(images)
        except GroupBroken as exc:
            log.warning("%s; leaving", exc)
            return EXIT_GROUP_BROKEN
