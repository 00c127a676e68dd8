"""The application layer (import path `diffq.app`): CLI, Python API, embedded runner, fleet.

The only layer that imports all the others.
"""
