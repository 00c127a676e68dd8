"""The producer (folder `producer/`, installed as `diffq.producer`): prompts in, batches published.

Imports only `diffq.core`; never the worker or the read side.
"""
