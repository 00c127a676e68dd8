"""A stand-in `torch_neuronx` for `diffq qualify` tests (put this folder on PYTHONPATH).

The real package is the Neuron backend (../shared/BACKENDS.md, Trainium rows):
importing it makes the "neuron" device and the "neuron" torch.compile backend
available, and `torch_neuronx.get_fallback_ops()` lists the ops that ran on CPU
("CPU fallback" row). Here, imported as the backend table's `extension` after
`import torch` in the qualify child, it:

- keeps the table's neuron row but computes on the host CPU (there is no device);
- registers a "neuron" compile backend that counts each graph (one line per graph
  in $STANDIN_NEURON_GRAPHS), warns on every call like a backend downcasting
  float64, and with $STANDIN_NEURON_PERTURB scales the graph's outputs: a device
  that computes wrongly; with $STANDIN_NEURON_RUNTIME_FAIL every compiled call fails
  on the device and is handled as torch-neuronx's execution_wrapper handles it
  (neuron_dynamo_backend/backend.py here: raise, or re-run uncompiled and log);
- answers get_fallback_ops() with a fixed list;
- writes the pinning it saw at import to $STANDIN_NEURON_ENV.
"""

import json
import os
import warnings

import torch
import torch._dynamo
from torch.utils._pytree import tree_map

from diffq.worker.device import backends
from torch_neuronx.neuron_dynamo_backend.backend import execution_wrapper, on_device

FALLBACK_OPS = ["aten::_fft_r2c", "aten::linalg_eigh"]
WARNING = "float64 is not supported on this device; running as float32"

# Tensors stay on the CPU, which has no device index to carry to a task thread.
backends.BACKENDS["neuron"] = __import__("dataclasses").replace(backends.BACKENDS["neuron"], torch_device="cpu",
                                                                thread_device=False)

if os.environ.get("STANDIN_NEURON_ENV"):
    with open(os.environ["STANDIN_NEURON_ENV"], "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k.startswith(("NEURON_", "TORCH_NEURONX_", "OMP_"))}, f)


def _perturb(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return -value  # a sign error: the kind of wrong a broken lowering produces
    return value


def _compiler(gm, example_inputs):
    if os.environ.get("STANDIN_NEURON_GRAPHS"):
        with open(os.environ["STANDIN_NEURON_GRAPHS"], "a") as f:
            f.write(f"{len(example_inputs)}\n")
    perturb = bool(os.environ.get("STANDIN_NEURON_PERTURB"))

    def run(*args):
        warnings.warn(WARNING, UserWarning)
        out = gm(*args)
        return tree_map(_perturb, out) if perturb else out

    return execution_wrapper(on_device(run), gm.forward)


if "neuron" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(_compiler, name="neuron")


def get_fallback_ops():
    return list(FALLBACK_OPS)
