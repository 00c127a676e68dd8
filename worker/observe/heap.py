"""The cyclic garbage collector and a worker's long-lived objects.

Most of a worker's heap lives as long as the process: the modules of torch,
diffusers, dynamo and Inductor, the loaded pipeline, its compiled graphs. CPython
3.11 runs a full collection whenever the objects promoted since the last one number a
quarter of those it found then (`Modules/gcmodule.c`, `collect_generations`:
`long_lived_pending < long_lived_total / 4`), and a full collection walks every
tracked object. While a worker imports, loads and traces, that is a walk of 50k, then
100k, ... 500k objects every second or so, each finding almost nothing; once it
serves, a full collection of the sink helper or the worker is a pause of tens to
hundreds of milliseconds between two device calls (figures: docs/BENCHMARKS.md,
"Warm start" and "Device feed").

A worker process therefore starts with automatic collection off (`pause()`): its
imports, its model's load and its warm-up's tracing run without a walk. At the end of
each stage whose objects stay (imports, the load), `keep()` moves what exists into
the permanent generation (`gc.freeze`), which no collection walks again; `settle()`
does so at the end of the start and resumes automatic collection over what comes
after. Dynamo's own collection after each compiled frame (`run_gc_after_compile`,
`torch/_dynamo/convert_frame.py`, a young-generation collection) then walks that
frame's objects only, and frees the tracer's garbage as before. A new shape's compile
settles again; the sink helper settles once it is set up.

The cost: garbage cycles made before a freeze are never freed (a start leaves ~9,000
such objects, about what one full collection at its end would find; that collection
would walk every object the start made, ~0.5 s of a warm start).
"""

from __future__ import annotations

import gc


def pause() -> None:
    """No automatic collection until `settle()`: what a start makes mostly stays."""
    gc.disable()


def keep() -> None:
    """What exists now stays for the process's life: no collection walks it again."""
    gc.freeze()


def settle() -> None:
    """`keep()`, then collect automatically again, over what comes after."""
    gc.freeze()
    gc.enable()


def report() -> dict:
    """For a warm report: whether collection is on, how many objects are kept out of its
    walks, and the full collections so far (a paused start makes none)."""
    return {"collecting": gc.isenabled(), "kept": gc.get_freeze_count(),
            "full_collections": gc.get_stats()[2]["collections"]}
