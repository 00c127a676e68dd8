"""The read side (import path `diffq.results`): status, watch, fetch, export, report.

Readers of a run folder; they import only `diffq.core`, never the producer or worker.
"""
