"""What the app layer may use of the worker: each name, the module it lives in.

`diffq.app` imports the worker only from here (tests/test_layers.py holds it to that),
so the worker's packages can move inside without the app following. Names resolve
when first asked for, each from its module as it is then (a test's monkeypatch of the
module is seen): the CLI's light commands keep torch and Celery unimported.
"""

from __future__ import annotations

import importlib

# name -> (module under diffq.worker, attribute; None: the module itself)
SURFACE: dict[str, tuple[str, str | None]] = {
    # The backend table
    "backends": ("device.backends", None),
    "Backend": ("device.backends", "Backend"),
    "BACKENDS": ("device.backends", "BACKENDS"),
    "COMPILING_MODES": ("device.backends", "COMPILING_MODES"),
    "K8sPod": ("device.backends", "K8sPod"),
    "REFERENCE": ("device.backends", "REFERENCE"),
    "RunConfig": ("device.backends", "RunConfig"),
    "get_backend": ("device.backends", "get_backend"),
    # Models, speed-ups, tensor-parallel groups
    "ModelUnavailable": ("device.models", "ModelUnavailable"),
    "resolve_model": ("device.models", "resolve_model"),
    "DEFAULT_ATTENTION": ("device.speedups", "DEFAULT_ATTENTION"),
    "local_refusal": ("device.speedups", "local_refusal"),
    "speedup_refusal": ("device.speedups", "refusal"),
    # The LoRA mode table (torch-free)
    "lora_modes": ("device.lora_modes", None),
    "sharding_plan": ("device.tensor_parallel", "sharding_plan"),
    # A worker process's plan and what it takes
    "DEFAULT_DEGENERATE_POLICY": ("delivery.spec", "DEFAULT_DEGENERATE_POLICY"),
    "DEGENERATE_POLICIES": ("delivery.spec", "DEGENERATE_POLICIES"),
    "DRAIN_MARGIN_S": ("delivery.spec", "DRAIN_MARGIN_S"),
    "DRAIN_TIMEOUT_S": ("delivery.spec", "DRAIN_TIMEOUT_S"),
    "Admission": ("delivery.admission", "Admission"),
    "RunScope": ("delivery.admission", "RunScope"),
    "startup_queues": ("delivery.routing", "startup_queues"),
    # The embedded runner ends a killed worker's batch through the door (a row of decide)
    "Outcome": ("delivery.outcomes", "Outcome"),
    "Republished": ("delivery.door", "Republished"),
    "end": ("delivery.door", "end"),
    # `diffq queues --dead` ends each letter it peeked through the door
    "peeked": ("delivery.door", "peeked"),
    # The processes: the supervisor, and qualify's child
    "Supervisor": ("process.supervisor", "Supervisor"),
    "plan_children": ("process.supervisor", "plan_children"),
    "QualifySpec": ("process.qualify", "QualifySpec"),
    "image_path": ("process.qualify", "image_path"),
    "speedup_image_path": ("process.qualify", "speedup_image_path"),
}
# The module qualify's child runs (`python -m`).
QUALIFY_MAIN = "diffq.worker.process.qualify"

__all__ = [*SURFACE, "QUALIFY_MAIN"]


def __getattr__(name: str):
    try:
        module, attribute = SURFACE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    found = importlib.import_module(f"diffq.worker.{module}")
    return found if attribute is None else getattr(found, attribute)
