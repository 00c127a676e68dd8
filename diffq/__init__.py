"""diffq: shape-bucketed diffusers image generation over Celery queues.

Importing diffq never imports torch: producers and the worker supervisor stay light,
and device pinning happens in spawned children before torch is loaded.
"""

__version__ = "0.1.0"
