"""The Python API, mirroring the CLI: one import for dataset pipelines.

    from diffq import api

    api.submit("prompts.jsonl", "s3://bucket/r1", model=..., broker_url="redis://host:6379/0")
    api.status("s3://bucket/r1").to_json()
    api.export("s3://bucket/r1", "s3://bucket/datasets/r1", format="webdataset", shard_size=1000)

Names resolve on first use: the embedded runner pulls in Celery and the worker
supervisor, which a script that only exports should not pay for.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "submit": "diffq.producer.submit",   # diffq submit
    "plan": "diffq.producer.submit",     # diffq plan (validates, counts shapes; writes nothing)
    "run": "diffq.app.runner",           # diffq run (embedded broker, no servers)
    "resume": "diffq.app.runner",        # diffq resume OUT without a broker: finish a run here
    "status": "diffq.results.status",    # diffq status
    "fetch": "diffq.results.fetch",      # diffq fetch
    "iter_records": "diffq.core.runfolder",
    "watch": "diffq.results.watch",      # diffq status --watch
    "snapshots": "diffq.results.watch",
    "export": "diffq.results.export",    # diffq export
    "report": "diffq.results.report",    # diffq report
    "build_report": "diffq.results.report",
    "render_text": "diffq.results.report",
    "open_storage": "diffq.core.storage",
    "qualify": "diffq.app.qualify",         # diffq qualify
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
