"""Dynamo behaviour that costs every compiling start, and what diffq does about it.

Each quirk names the torch source it answers. Applied once, before the first compile
(worker/device/pipeline_host.py), on every backend: they are dynamo's, not a device's.

- **Source names for log lines nobody reads.** For every FX call it records, dynamo
  builds a log header naming the function at that line
  (`torch/_dynamo/output_graph.py`, `SubgraphTracer.create_proxy` →
  `InstructionTranslatorBase.get_line_of_code_header`), eagerly, although it only
  feeds the `trace_call` / `trace_source` debug logs. The name comes from
  `torch/_dynamo/funcname_cache.py` `get_funcname`, which tokenizes each traced
  source file whole the first time it is asked (the transformer's module, torch's
  `nn` modules, ...): on a warm start, a fifth of dynamo's re-trace
  (docs/BENCHMARKS.md, "Warm start"). Unless one of those two logs is on, the name
  is left out, which is all that changes: the header is a log string.
"""

from __future__ import annotations

from collections.abc import Callable

# The debug logs that print the name (torch/_dynamo/symbolic_convert.py and
# output_graph.py: `getArtifactLogger(__name__, "trace_call" | "trace_source")`).
NAMED_IN = ("trace_call", "trace_source")

_installed: dict[str, Callable] = {}


def source_names_when_logged() -> None:
    """Dynamo asks for a traced line's function name only where a log will show it."""
    import torch._dynamo.symbolic_convert as symbolic_convert
    from torch._logging._internal import log_state

    if "get_funcname" in _installed:
        return
    original = symbolic_convert.get_funcname

    def get_funcname(filename: str, lineno: int) -> str | None:
        if any(log_state.is_artifact_enabled(name) for name in NAMED_IN):
            return original(filename, lineno)
        return None

    _installed["get_funcname"] = original
    symbolic_convert.get_funcname = get_funcname


def install() -> None:
    source_names_when_logged()
