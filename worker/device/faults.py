"""Fault injection for chaos tests and drills; inert unless its variable is set.

DIFFQ_FAULT_POISON=<text>: any batch holding a prompt that contains <text> raises in
generation, as a prompt that crashes a real pipeline would.

DIFFQ_FAULT_HOLD=<text>:<seconds>: a batch holding a prompt that contains <text>
takes <seconds> longer before generating, as a first compile would (the lease tests).

DIFFQ_FAULT_KILL_RANK=<rank>:<marker file>: the tensor-parallel rank <rank> SIGKILLs
itself on receiving a batch, once per marker file (the restarted group runs on).

DIFFQ_FAULT_NAN=<text>, DIFFQ_FAULT_FLAT=<text>: the pipeline's output for an item
whose prompt contains <text> is NaN everywhere (as from an fp16 VAE overflowing) or
one flat grey (a collapsed sampler), the rest of its batch untouched.

DIFFQ_FAULT_FETCH_KILL_AFTER=<files>: a model fetch (worker/device/model_fetch.py) SIGKILLs
its process once that many files are verified and in place (the resume tests);
DIFFQ_FAULT_FETCH_KILL_AFTER_PIECES=<pieces>: once that many pieces (byte ranges) are
recorded, wherever they fall (resuming inside a file).
"""

from __future__ import annotations

import os
import signal
import time

from diffq.core.contract import BatchItem


class PoisonedPrompt(RuntimeError):
    pass


def check(items: list[BatchItem]) -> None:
    poison = os.environ.get("DIFFQ_FAULT_POISON")
    if poison and any(poison in item.prompt for item in items):
        raise PoisonedPrompt(f"prompt containing {poison!r} makes generation fail")
    hold = os.environ.get("DIFFQ_FAULT_HOLD")
    if hold:
        text, _, seconds = hold.rpartition(":")
        if any(text in item.prompt for item in items):
            time.sleep(float(seconds))


# variable -> the value every pixel of a matching item's output is set to
DEGRADED = {"DIFFQ_FAULT_NAN": float("nan"), "DIFFQ_FAULT_FLAT": 0.5}


def degrade(images, items: list[BatchItem]):
    """The pipeline's output tensor (B×3×H×W floats) with DIFFQ_FAULT_NAN / _FLAT applied, in place."""
    for variable, value in DEGRADED.items():
        text = os.environ.get(variable)
        if text:
            for index, item in enumerate(items):
                if text in item.prompt:
                    images[index] = value
    return images


def check_rank(rank: int, items: list[BatchItem]) -> None:
    spec = os.environ.get("DIFFQ_FAULT_KILL_RANK")
    if not spec:
        return
    target, _, marker = spec.partition(":")
    if int(target) != rank:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def fetch_progress(files_done: int) -> None:
    after = os.environ.get("DIFFQ_FAULT_FETCH_KILL_AFTER")
    if after and files_done >= int(after):
        os.kill(os.getpid(), signal.SIGKILL)


def fetch_piece(pieces_done: int) -> None:
    after = os.environ.get("DIFFQ_FAULT_FETCH_KILL_AFTER_PIECES")
    if after and pieces_done >= int(after):
        os.kill(os.getpid(), signal.SIGKILL)
