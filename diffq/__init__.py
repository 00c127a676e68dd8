"""diffq: shape-bucketed diffusers image generation over Celery queues.

Layers, bottom up (tests/test_layers.py enforces them):

- `diffq.core`     the base: message and run-folder schemas, layout, storage,
                   settings, the Celery app factory and the transport table.
- `diffq.producer` (folder `producer/`) reads prompts and publishes batches.
- `diffq.worker`   (folder `worker/`) generates and stores them.
- `diffq.results`  the read side of a run folder: status, watch, fetch, export, report.
- `diffq.app`      composes them: the CLI, the Python API, the embedded runner, fleet.

Importing diffq never imports torch: producers and the worker supervisor stay light,
and device pinning happens in spawned children before torch is loaded.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from diffq import api` (the documented entry point) without importing the
    # application layer for every `import diffq`.
    if name == "api":
        from diffq.app import api

        return api
    raise AttributeError(f"module 'diffq' has no attribute {name!r}")
