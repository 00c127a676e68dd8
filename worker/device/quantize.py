"""A batch's quantization scheme (`quant:SCHEME`, core/speedups.py SCHEMES) on the transformer.

Applied once, when the pipeline loads (worker/device/pipeline_host.py `_load`): after
it is on its device, before a LoRA scaffold goes in and before anything compiles, so
every graph is traced over the quantized weights. A pipeline per (model, dtype,
scheme): a worker serving full precision and a scheme holds both.

torchao's `quantize_` with its default filter swaps each nn.Linear's weight for a
torchao tensor subclass (Int8Tensor, Float8Tensor): the transformer's linear layers
only (core/speedups.py QUANTIZED_MODULES says why); `set_inductor_config=False`:
True (torchao's default) calls `recommended_inductor_config_setter`
(torchao/quantization/utils.py), which changes process-wide Inductor settings
(`coordinate_descent_tuning`, `force_fuse_int_mm_with_mul`, `fx_graph_cache`) for every
graph this process compiles, full precision included: compiles would differ by which
batch came first, and `fx_graph_cache` is the compile cache's to decide
(worker/device/compile_cache.py).
"""

from __future__ import annotations

from diffq.core.speedups import PER_TENSOR, SCHEMES


def refusal(scheme: str, backend, compile_mode: str, dtype: str | None = None) -> str | None:
    """Why `backend` cannot run `scheme` (the table's column for it; a backend it does not
    name is unknown), or None. Torch-free: `run` and `qualify` ask before anything starts."""
    from diffq.core.speedups import UNKNOWN_ON_DEVICE

    row = SCHEMES[scheme]
    if backend.name not in row.devices:
        kind = row.weights.split(",")[0]
        return f"quant:{scheme} on --device {backend.name}: " + UNKNOWN_ON_DEVICE.format(
            device=backend.name, kind=kind, tensor=row.tensor, ops=row.ops)
    if reason := row.devices[backend.name]:
        return f"quant:{scheme} on --device {backend.name}: {reason}"
    if dtype is not None and row.dtypes and dtype not in row.dtypes:
        return (f"quant:{scheme} quantizes from {', '.join(row.dtypes)} weights only ({row.config}); this batch runs "
                f"at {dtype}")
    return None


def capability_refusal(scheme: str, backend, capability: tuple[int, int] | None) -> str | None:
    """Why this device is too old for `scheme` (its compute capability, read at the
    worker's start), or None."""
    least = SCHEMES[scheme].capability.get(backend.name)
    if least is None or capability is None or tuple(capability) >= least:
        return None
    return (f"quant:{scheme} needs compute capability {least[0]}.{least[1]} or newer on {backend.name}; this device "
            f"has {capability[0]}.{capability[1]}")


def device_capability(backend) -> tuple[int, int] | None:
    """The device's compute capability where a scheme asks for one on this backend."""
    if not any(backend.name in row.capability for row in SCHEMES.values()):
        return None
    import torch

    return tuple(torch.cuda.get_device_capability())


def torchao_config(scheme: str):
    """The torchao config object of a scheme."""
    from torchao import quantization

    row = SCHEMES[scheme]
    granularity = quantization.PerTensor() if row.activations == PER_TENSOR else quantization.PerRow()
    return getattr(quantization, row.config)(granularity=granularity, set_inductor_config=False)


def quantize(transformer, scheme: str) -> None:
    """The transformer's linear layers quantized in place (torchao's quantize_)."""
    from torchao.quantization import quantize_

    quantize_(transformer, torchao_config(scheme))


def tensor_bytes(tensor) -> int:
    """The bytes a tensor holds: a torchao subclass's inner tensors (int8 data, scales),
    through the traceable-subclass protocol `__tensor_flatten__` (torch/utils/
    _python_dispatch.py documents it); a plain tensor's elements."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(module) -> int:
    """The bytes of a module's parameters and buffers, as stored (quantized where it is)."""
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))
