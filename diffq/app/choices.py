"""CLI choices read from the tables: devices, compile modes, dtypes, pipeline families, device generations.

The backend table (worker/device/backends.py, torch-free) owns them, so a new backend or mode
needs no edit in the command line.
"""

from __future__ import annotations

from enum import Enum

from diffq.core import families
from diffq.worker.api import backends, lora_modes

Device = Enum("Device", {name: name for name in backends.DEVICES}, type=str)
CompileMode = Enum("CompileMode", {mode.replace("-", "_"): mode for mode in backends.COMPILE_MODES}, type=str)
Dtype = Enum("Dtype", {name: name for name in backends.DTYPE_CHOICES}, type=str)
# The LoRA mode table (worker/device/lora_modes.py): a mode, auto, or (run, worker, fleet
# manifests) a `qualify --lora --profile` FILE.json, auto resolved through it.
LORA_MODE_HELP = ("How a batch's LoRA adapter set goes into the pipeline: "
                  + "; ".join(f"{mode.name}: {mode.graph}" for mode in lora_modes.LORA_MODES.values())
                  + "; auto: the backend table's mode for the device and compile mode (swap on cpu/cuda, compile "
                  "on neuron/tpu); FILE.json: auto, unless that `qualify --lora --profile` file, measured on this "
                  f"device, proved a cheaper mode (default {lora_modes.DEFAULT_LORA_MODE}; docs/devices.md)")
DEFAULT_LORA_MODE = lora_modes.DEFAULT_LORA_MODE
# The family table's names (diffq/core/families.py); each has a tiny builder.
Family = Enum("Family", {name.replace("-", "_"): name for name in families.BY_NAME}, type=str)
# Every backend row's `generations` (a device without a detectable one names it here).
DeviceGeneration = Enum("DeviceGeneration", {name: name for backend in backends.BACKENDS.values()
                                             for name in backend.generations}, type=str)
TpuGeneration = DeviceGeneration  # its name while TPU was the only row with generations
GENERATION_HELP = ("Device generation where none is attached (--plan, manifests): "
                   + "; ".join(f"--device {backend.name}: {'|'.join(backend.generations)}"
                               for backend in backends.BACKENDS.values() if backend.generations)
                   + "; default: detected on the host. --tpu-generation: the same option")
