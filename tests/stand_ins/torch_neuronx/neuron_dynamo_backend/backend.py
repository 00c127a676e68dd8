"""Stand-in for torch-neuronx `neuron_dynamo_backend/backend.py`: what a compiled graph
does when the device fails it at run time (the real `execution_wrapper`).

The real wrapper runs the compiled executable; on an exception it raises when
TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION is true (default false), else it logs
"Execution failed: ..." (error) and "Falling back to original GraphModule execution"
(warning) on this module's logger and returns the original graph's result. Here the
"device" fails every call while $STANDIN_NEURON_RUNTIME_FAIL is set.

Plain stdlib, so a test can load this file by path without importing the stand-in
package (which rewrites the backend table's neuron row).
"""

import logging
import os

# The real module's logger name: diffq counts fallbacks by it (backends.py, GraphFallback).
logger = logging.getLogger("torch_neuronx.neuron_dynamo_backend.backend")


def _flag(name: str) -> bool:
    # As neuron_dynamo_backend/settings.py reads booleans.
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def on_device(compiled):
    """The compiled graph as the device runs it: it fails while $STANDIN_NEURON_RUNTIME_FAIL is set."""

    def execute(*inputs):
        if os.environ.get("STANDIN_NEURON_RUNTIME_FAIL"):
            raise RuntimeError("stand-in NEFF execution failed on the device")
        return compiled(*inputs)

    return execute


def execution_wrapper(execute, original):
    """Run on the device; on failure raise, or re-run `original` op by op when fallback is allowed."""

    def run(*inputs):
        try:
            return execute(*inputs)
        except Exception as exc:
            if _flag("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"):
                raise
            logger.error("Execution failed: %s", exc)
            logger.warning("Falling back to original GraphModule execution")
            return original(*inputs)

    return run
