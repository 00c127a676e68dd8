"""The worker (folder `worker/`, installed as `diffq.worker`): batches in, images stored.

Imports only `diffq.core`; never the producer or the read side. Its packages import in
one direction, observe < device < sink < delivery < process; the app uses it through
`diffq.worker.api` alone.
"""
