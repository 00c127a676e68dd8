"""`--lora-mode swap|fuse|compile` (worker/device/lora_modes.py, lora_apply.py) on the tiny
FLUX.1 pipeline, CPU Inductor, regional compile: the modes give swap's pixels, fuse
compiles nothing after the first batch, and the change check. The stand-in for a backend
that bakes weights into its graphs is Inductor's freezing under no grad (a pipeline call
runs under inference mode): torch/_inductor/compile_fx.py folds the parameters into the
compiled code when `config.freezing and not torch.is_grad_enabled()`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffq.core import adapters as A
from diffq.core.contract import AdapterRef, BatchItem, BatchParams, ShapeKey
from diffq.worker.device.adapters import AdapterCache, AdapterUnsupported
from diffq.worker.device.backends import get_backend
from diffq.worker.device.lora_apply import FusedWeights, LoraChangeUnseen
from diffq.worker.device.lora_modes import LORA_MODES, bakes_weights, refusal
from diffq.worker.device.pipeline_host import PipelineHost
from tests.test_lora import BATCH, SIDE, STEPS, _items, _pixels, _plain, flux, loras  # noqa: F401  (fixtures)

# Two levels: what the done-means allow between a mode's images and swap's (fuse adds the
# delta to the weight before the matmul, swap after: float sums in another order).
LEVELS = 2
# (name, the set as (rank, scale) pairs) in the order a host serves them: none, three sets
# (one stacked), back to none, a set again.
SETS = {"none": (), "r8": ((8, 1.0),), "r16": ((16, 0.5),), "stack": ((4, 0.8), (8, 0.5))}
SEQUENCE = ["none", "r8", "r16", "stack", "none", "r8"]


def _layout(loras) -> A.AdapterLayout:
    return A.layout((A.inspect(path) for path in loras.values()), slots=2)


def _shape(flux, loras) -> ShapeKey:
    return ShapeKey(model=flux, height=SIDE, width=SIDE, batch_size=BATCH, max_sequence_length=16, cfg=False,
                    dtype="float32", lora=_layout(loras).label)


def _refs(loras, name: str) -> tuple[AdapterRef, ...]:
    return tuple(AdapterRef(path=loras[rank], scale=scale) for rank, scale in SETS[name])


def _host(flux, loras, mode: str) -> PipelineHost:
    torch._dynamo.reset()  # each host compiles its own graphs, counted from its first batch
    host = PipelineHost(backend=get_backend("cpu"), compile_mode="regional", lora_mode=mode)
    host.use_adapters(flux, _layout(loras))
    return host


def _serve(host, flux, loras, names) -> list:
    return [host.generate(_shape(flux, loras), BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                                    adapters=_refs(loras, name)), _items()) for name in names]


@pytest.fixture(scope="module")
def served(flux, loras):
    """SEQUENCE under each mode: mode -> (host, the batches)."""
    out = {}
    for mode in LORA_MODES:
        host = _host(flux, loras, mode)
        out[mode] = host, _serve(host, flux, loras, SEQUENCE)
    return out


@pytest.mark.parametrize("mode", ["fuse", "compile"])
def test_fuse_and_compile_give_swaps_pixels(served, mode):
    _, swapped = served["swap"]
    _, batches = served[mode]
    for name, swap, this in zip(SEQUENCE, swapped, batches):
        assert np.abs(_pixels(this.images) - _pixels(swap.images)).max() <= LEVELS, name
    # The sets differ from each other and from none, far beyond that.
    pixels = {name: _pixels(batch.images) for name, batch in zip(SEQUENCE, batches)}
    for a, b in (("r8", "none"), ("r16", "none"), ("stack", "r8"), ("stack", "none")):
        assert np.abs(pixels[a] - pixels[b]).max() > 10 * LEVELS, (a, b)
    # Back to none: the pristine weights again, bit for bit (never a subtraction).
    assert np.array_equal(_pixels(batches[4].images), _pixels(batches[0].images))
    assert np.array_equal(_pixels(batches[5].images), _pixels(batches[1].images))


@pytest.mark.parametrize("mode", list(LORA_MODES))
def test_no_graph_after_the_first_batch_where_weights_are_graph_inputs(served, mode):
    host, batches = served[mode]
    assert batches[0].graphs > 0
    assert [batch.graphs for batch in batches[1:]] == [0] * (len(batches) - 1)
    assert host.recompiles == 0
    applier = next(iter(host.adapter_slots.values()))
    assert applier.mode == mode and applier.swaps == len(SEQUENCE) - 1
    assert all(batch.adapter_swap_s > 0 for batch in batches[1:])
    assert all(batch.record_extra["lora_mode"] == mode for batch in batches)
    # The first set change was checked on the probe, and it showed.
    assert host.change_check is not None and host.change_check.showed and host.lora_refused is None
    if mode == "compile":
        assert applier.bakes is False and applier.compiles == 0  # CPU Inductor reads weights as inputs


def test_fuse_has_no_lora_layer_and_keeps_pristine_copies(served, flux):
    host, _ = served["fuse"]
    pipe = host._pipelines[host.key(flux, "float32")]
    assert not getattr(pipe.transformer, "peft_config", None)  # no scaffold, no peft layer in the graph
    fused = next(iter(host.adapter_slots.values()))
    assert isinstance(fused, FusedWeights) and set(fused.pristine) == set(fused.layout.targets)
    assert all(t.device.type == "cpu" for t in fused.pristine.values())


def test_fuse_refuses_quantized_weights(flux, loras):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux, local_files_only=True)
    layout = A.layout([A.inspect(loras[8])])
    target = pipe.transformer.get_submodule(layout.targets[0])
    target.weight = torch.nn.Parameter(target.weight.data.to(torch.float8_e4m3fn), requires_grad=False)
    for mode in ("fuse", "compile"):
        with pytest.raises(AdapterUnsupported, match=r"over quantized weights .*float8_e4m3fn.*re-quantize"):
            LORA_MODES[mode].installer()(pipe, layout, AdapterCache(), backend=get_backend("cpu"),
                                         compile_mode="none")


def test_the_table_says_what_each_mode_needs():
    cpu, neuron = get_backend("cpu"), get_backend("neuron")
    assert refusal(cpu, "regional", "swap") is None and refusal(cpu, "regional", "fuse") is None
    # Neuron: nothing refused (a swap or fuse asked for is left to the change check), and
    # compile recompiles per set there, the weights not known to be graph inputs.
    assert refusal(neuron, "full", "fuse") is None and refusal(neuron, "full", "compile") is None
    assert bakes_weights(neuron, "full") and not bakes_weights(cpu, "regional") and not bakes_weights(cpu, "none")
    with torch._inductor.config.patch(freezing=True):
        assert bakes_weights(cpu, "regional") and not bakes_weights(cpu, "none")


# --- the stand-in: a backend that bakes weights ------------------------------------------


def _fused_plain(flux, stack) -> np.ndarray:
    """Plain diffusers: each adapter loaded the ordinary way at its scale, fused
    (`fuse_lora`) and unloaded, compiled as the host compiles, afresh (no graph of
    another pipeline reused: under freezing they hold other weights)."""
    torch._dynamo.reset()
    return _plain(flux, True, stack=stack, fused=True)


@pytest.fixture
def frozen():
    with torch._inductor.config.patch(freezing=True):
        yield
    torch._dynamo.reset()  # no frozen graph outlives the test


@pytest.mark.parametrize("mode", ["swap", "fuse"])
def test_under_the_stand_in_swap_and_fuse_fail_their_change_check_and_serve_no_adapter(frozen, flux, loras, mode):
    host = _host(flux, loras, mode)
    first, = _serve(host, flux, loras, ["none"])  # compiles, the weights as they are now baked in
    with pytest.raises(LoraChangeUnseen, match=rf"--lora-mode {mode}: the change from none to .* did not show"):
        _serve(host, flux, loras, ["r8"])
    assert host.change_check.moved == 0 and not host.change_check.showed
    with pytest.raises(AdapterUnsupported, match="serves no more LoRA adapters"):  # every later adapter batch
        _serve(host, flux, loras, ["stack"])
    again, = _serve(host, flux, loras, ["none"])  # no adapter: still served, the same pixels
    assert np.array_equal(_pixels(again.images), _pixels(first.images))


def test_under_the_stand_in_compile_matches_diffusers_fused_and_compiles_once_per_set(frozen, flux, loras):
    host = _host(flux, loras, "compile")
    names = ["none", "r8", "stack", "none", "r8", "stack"]
    batches = _serve(host, flux, loras, names)
    applier = next(iter(host.adapter_slots.values()))
    assert applier.bakes and applier.compiles == 2  # r8 and stack; none is the host's own compile
    graphs = [batch.graphs for batch in batches]
    assert graphs[0] > 0 and graphs[1] > 0 and graphs[2] > 0 and graphs[3:] == [0, 0, 0]
    assert host.change_check.showed
    for name, batch in zip(names[:3], batches[:3]):
        plain = _fused_plain(flux, tuple((loras[rank], scale) for rank, scale in SETS[name]))
        assert np.abs(_pixels(batch.images) - plain).max() <= LEVELS, name
    for early, late in zip(batches[:3], batches[3:]):
        assert np.array_equal(_pixels(early.images), _pixels(late.images))
