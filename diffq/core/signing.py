"""Batch signatures: an HMAC where diffq publishes, checked by the worker on receipt.

Anyone who can publish to the broker can put a message on a shape queue. With a key
set (`DIFFQ_SIGNING_KEY`), every batch diffq publishes (`submit`, `resume`,
`retry-failed`, the embedded runner, a worker's retry and split) carries a
signature in its message headers, and a worker with a key dead-letters a batch
whose signature is missing or does not verify (worker/delivery/admission.py).

What is signed: the queue the batch is meant for, its run id and the batch itself,
so a signed batch replayed into another queue or run does not verify. The batch is
taken in one canonical form, orjson with sorted keys, which every side derives from
the values alone: the producer writes its batches in that form, and a worker
re-derives it from the JSON it decoded (a JSON round trip keeps every string,
integer and float exactly). Celery's own message signing (`app.setup_security`)
was not used: it does not reach what `submit` publishes (producer/publish.py
writes kombu envelopes itself), needs X.509 certificates, refuses expired ones and
changes the content type away from JSON.

Rotation: a worker accepts the current key and `DIFFQ_SIGNING_KEY_PREVIOUS`; a
signature names its key by a short digest, so no key is tried blindly.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import orjson

# The message header the signature travels in (Celery protocol 2 keeps unknown
# headers on the message; kombu stores them in every transport's envelope).
HEADER = "diffq_signature"
VERSION = "v1"


def canonical(batch: dict) -> bytes:
    """The bytes a batch is signed as: compact JSON, keys sorted at every level."""
    return orjson.dumps(batch, option=orjson.OPT_SORT_KEYS)


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"diffq-key-id\n" + key).hexdigest()[:12]


def _mac(key: bytes, queue: str, run_id: str, data: bytes) -> str:
    message = b"diffq-batch-" + VERSION.encode() + b"\n" + queue.encode() + b"\n" + run_id.encode() + b"\n" + data
    return hmac.new(key, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Keys:
    """The signing key (signs and verifies) and the previous one (verifies only)."""

    current: bytes
    previous: bytes | None = None

    @classmethod
    def from_settings(cls, settings) -> Keys | None:
        """The keys `DIFFQ_SIGNING_KEY` / `_PREVIOUS` hold, or None where none is set."""
        current = settings.signing_key.get_secret_value() if settings.signing_key else ""
        previous = settings.signing_key_previous.get_secret_value() if settings.signing_key_previous else ""
        if not current:
            if previous:
                raise ValueError("DIFFQ_SIGNING_KEY_PREVIOUS is set without DIFFQ_SIGNING_KEY: "
                                 "set the new key as current and keep the old one as previous")
            return None
        return cls(current.encode(), previous.encode() or None)

    def sign(self, queue: str, run_id: str, data: bytes) -> str:
        """The header value for a batch given in its canonical bytes."""
        return f"{VERSION}:{key_id(self.current)}:{_mac(self.current, queue, run_id, data)}"

    def sign_batch(self, queue: str, batch: dict) -> str:
        return self.sign(queue, str(batch.get("run_id", "")), canonical(batch))

    def problem(self, queue: str, batch: dict, signature) -> str | None:
        """Why a batch that arrived on `queue` with this header does not verify, or None."""
        if not signature:
            return "unsigned batch (this worker checks signatures: DIFFQ_SIGNING_KEY is set)"
        parts = signature.split(":") if isinstance(signature, str) else []
        if len(parts) != 3 or parts[0] != VERSION:
            return f"malformed signature header {HEADER!r}"
        _, kid, mac = parts
        key = next((k for k in (self.current, self.previous) if k is not None and key_id(k) == kid), None)
        if key is None:
            return f"signed with a key this worker does not hold (key id {kid[:12]})"
        run_id = batch.get("run_id") if isinstance(batch, dict) else None
        if not isinstance(run_id, str):
            return "signed batch without a run id"
        if not hmac.compare_digest(mac, _mac(key, queue, run_id, canonical(batch))):
            return (f"signature does not verify for queue {queue} and run {run_id[:64]} "
                    "(altered, or replayed into another queue or run)")
        return None


def keys_from_settings() -> Keys | None:
    from diffq.core.settings import get_settings

    return Keys.from_settings(get_settings())
