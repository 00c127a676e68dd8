"""Admission: what a worker checks of a delivery before it does anything with it.

Anyone who can publish to the broker can put a message on a shape queue: a
compromised producer, another team on a shared Redis, a mistyped URL. A worker
admits a batch only when, in this order:

1. signed   with a key set (DIFFQ_SIGNING_KEY), the batch's signature verifies for
            the queue it arrived on and its run (core/signing.py): an unsigned,
            altered or replayed batch goes no further;
2. a batch  it is a diffq batch (the message schema);
3. its queue's  its shape key names the queue it arrived on, as the broker or
            transport saw it (the broker object's `arrival`, core/brokers/): model, size, batch,
            sequence length, CFG and dtype are what the queue says;
4. its run's  with `--run OUT` (and in `diffq run`), its run folder is that run's and
            its run id that run's; otherwise its run folder lies under
            DIFFQ_ALLOWED_OUT_PREFIXES (resolved, on a path boundary: no '..', no
            '/data/runs-evil' beside '/data/runs');
5. a known model  its model is one this worker was told about: --model, --models,
            the --run manifest's, DIFFQ_ALLOWED_MODELS; told none, one its run's
            manifest names (checked in the task body, where the manifest is read:
            process/runtime.py `model_problem`);
6. allowed adapters  each LoRA adapter it names lies under DIFFQ_ALLOWED_ADAPTERS
            (core/adapters.py `allowed`; empty: any).

A batch that fails one is dead-lettered with the reason (worker/delivery/dead_letters.py) and
never generated, stored or retried; each check is a `Refused` row (worker/delivery/outcomes.py). Where a worker was told nothing (no run, no
prefixes) the check passes only where the worker was started with `--any-out` on a
network broker (app/cli.py refuses to start it otherwise), and says so loudly (`warnings`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, ValidationError

from diffq.core.adapters import allowed
from diffq.core.contract import BatchMessage
from diffq.core.signing import Keys
from diffq.core.storage import StorageError, open_storage
from diffq.core.validation import first_error
from diffq.worker.delivery.outcomes import Refused

log = logging.getLogger("diffq.worker")

MAX_URLS = 1024  # run folders whose spelling admission keeps


class RunScope(BaseModel):
    """One run a worker serves: its run folder (as `open_storage` spells it) and id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out: str
    run_id: str

    @classmethod
    def of(cls, out: str, run_id: str) -> RunScope:
        return cls(out=open_storage(out).url, run_id=run_id)


def schema_reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        where, message = first_error(exc)
        return f"not a diffq batch: {exc.error_count()} schema errors, first {where or 'message'}: {message}"
    return str(exc)


def under(url: str, prefix: str) -> bool:
    """`url` is `prefix` or inside it, on a path boundary."""
    prefix = prefix.rstrip("/")
    return url == prefix or url.startswith(prefix + "/")


@dataclass(frozen=True)
class Refusal:
    reason: str
    why: Refused  # its row (worker/delivery/outcomes.py): which decides how it is dead-lettered

    @property
    def malformed(self) -> bool:
        """Not a diffq batch at all (the schema): dead-lettered the broker's way, like any
        message the worker cannot read; the others always leave a letter with the reason."""
        return self.why is Refused.NOT_A_BATCH


@dataclass(frozen=True)
class Admission:
    runs: tuple[RunScope, ...] = ()
    out_prefixes: tuple[str, ...] = ()
    models: frozenset[str] = frozenset()
    keys: Keys | None = None
    adapters: tuple[str, ...] = ()  # DIFFQ_ALLOWED_ADAPTERS' prefixes
    # A run folder as a batch names it -> as `open_storage` spells it: every batch of a
    # run names the same folder, and resolving a local path is a syscall per part. As
    # lasting as the worker's own storage for that name (runtime.py `storage_for`).
    _urls: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, spec, settings) -> Admission:
        """A worker process's admission, from its spec and the DIFFQ_* settings."""
        prefixes = []
        given = getattr(spec, "allowed_out_prefixes", None)
        for prefix in settings.allowed_out_prefixes if given is None else given:
            try:  # spelled as open_storage spells run folders (resolved local paths)
                prefixes.append(open_storage(prefix).url)
            except StorageError as exc:
                raise ValueError(f"DIFFQ_ALLOWED_OUT_PREFIXES: {exc}") from None
        models = {*getattr(spec, "models", ()), *getattr(spec, "serve_models", ()), *settings.allowed_models}
        return cls(runs=tuple(getattr(spec, "runs", ())), out_prefixes=tuple(prefixes), models=frozenset(models),
                   keys=Keys.from_settings(settings), adapters=tuple(settings.allowed_adapters))

    def check(self, batch, queue: str | None, signature=None) -> tuple[BatchMessage | None, Refusal | None]:
        """(the batch, None) when admitted, else (the batch if it is one, why not)."""
        if self.keys is not None:
            named = str(batch.get("batch_id"))[:128] if isinstance(batch, dict) else "?"
            if queue is None:
                return None, Refusal(f"batch {named}: the queue it arrived on is unknown: "
                                     "its signature cannot be checked", Refused.UNSIGNED)
            if problem := self.keys.problem(queue, batch if isinstance(batch, dict) else {}, signature):
                return None, Refusal(f"batch {named}: {problem}", Refused.UNSIGNED)
        try:
            message = BatchMessage.from_json_payload(batch)
        except ValueError as exc:  # pydantic's ValidationError included
            return None, Refusal(schema_reason(exc), Refused.NOT_A_BATCH)
        if queue is not None and message.shape.queue != queue:
            return message, Refusal(f"batch {message.batch_id}: for queue {message.shape.queue} "
                                    f"but arrived on {queue}", Refused.WRONG_QUEUE)
        if reason := self.out_problem(message.out, message.run_id):
            return message, Refusal(f"batch {message.batch_id}: {reason}", Refused.NOT_ITS_SCOPE)
        if self.models and message.shape.model not in self.models:
            return message, Refusal(f"batch {message.batch_id}: names model {message.shape.model[:200]!r}, which "
                                    "this worker was not told to load (--model, --models, DIFFQ_ALLOWED_MODELS)",
                                    Refused.UNKNOWN_MODEL)
        if outside := next((ref.path for ref in message.params.adapters if not allowed(ref.path, self.adapters)), None):
            return message, Refusal(f"batch {message.batch_id}: names adapter {outside[:200]!r}, outside "
                                    f"DIFFQ_ALLOWED_ADAPTERS ({', '.join(self.adapters)})", Refused.UNKNOWN_ADAPTER)
        return message, None

    def out_problem(self, out: str, run_id: str | None = None) -> str | None:
        """Why a worker may not write to run folder `out` (for run `run_id`), or None."""
        url = self._urls.get(out)
        if url is None:
            try:
                url = open_storage(out).url
            except StorageError as exc:
                return str(exc)
            if len(self._urls) >= MAX_URLS:  # batches naming ever new folders: refused anyway
                self._urls.clear()
            self._urls[out] = url
        if self.runs:
            if not any(url == run.out for run in self.runs):
                return f"run folder {url} is not the run this worker serves ({', '.join(r.out for r in self.runs)})"
            if run_id is not None and not any(url == run.out and run_id == run.run_id for run in self.runs):
                return f"run id {run_id!r} is not the id of the run in {url}"
            return None
        if self.out_prefixes and not any(under(url, prefix) for prefix in self.out_prefixes):
            return f"run folder {url} is outside this worker's allowed prefixes ({', '.join(self.out_prefixes)})"
        return None

    def warnings(self) -> list[str]:
        """What a worker on a network broker says at start about what it lets through."""
        said = []
        if not self.runs and not self.out_prefixes:
            said.append("this worker writes wherever a batch's run folder says: anyone who can publish to the "
                        "broker chooses where it writes. Set DIFFQ_ALLOWED_OUT_PREFIXES (or serve one run with --run OUT)")
        if not self.models:
            said.append("this worker loads any model its batches' run manifests name: pass --model/--models or "
                        "set DIFFQ_ALLOWED_MODELS")
        if not self.adapters:
            said.append("this worker loads any LoRA adapter its batches name: set DIFFQ_ALLOWED_ADAPTERS")
        if self.keys is None:
            said.append("batches are not signature-checked: set DIFFQ_SIGNING_KEY on producers and workers")
        return said
