"""The worker (folder `worker/`, installed as `diffq.worker`): batches in, images stored.

Imports only `diffq.core`; never the producer or the read side.
"""
