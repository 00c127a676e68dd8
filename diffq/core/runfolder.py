"""Reading a run folder: its manifest, its image records and its failure records, and
the one rule each for counting them: an item recorded twice counts once (first_records),
a failed item counts unless done since (failed_items).

Every layer above the base reads through these (status, resume, export, report);
nothing here asks the broker. The schemas are in records.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Iterable, Iterator

from diffq.core import layout
from diffq.core.records import CancelMarker, FailureRecord, ImageRecord, RunManifest, parse_record
from diffq.core.storage import NotFound, Storage


class NotARun(RuntimeError):
    pass


def read_manifest(storage: Storage) -> RunManifest:
    try:
        return RunManifest.model_validate_json(storage.get_bytes(layout.MANIFEST))
    except NotFound:
        raise NotARun(f"{storage.url} holds no diffq run (no {layout.MANIFEST})") from None


def record_keys(storage: Storage) -> list[str]:
    """Every batch record's key, sorted (a stable order for exports)."""
    return sorted(key for key in storage.list(layout.RECORDS_PREFIX) if key.endswith(".jsonl"))


def read_records(storage: Storage, keys: Iterable[str]) -> Iterator[tuple[str, list[ImageRecord]]]:
    """(batch id, its image records) for each record key, in completion order."""
    for key, body in storage.get_many(keys):
        yield layout.batch_of_record(key), parse_record(body)


class ItemSet:
    """Item ids, each kept as a 16-byte digest: a run's ids cost the same whatever their
    length. Two ids sharing one would count as one; at 2^-128 a pair, even a run of
    10^9 items has a chance below 10^-20 of holding such a pair."""

    __slots__ = ("_digests",)

    def __init__(self, item_ids: Iterable[str] = ()):
        self._digests = {_digest(item_id) for item_id in item_ids}

    def add(self, item_id: str) -> bool:
        """Add an id; whether it was new."""
        digest = _digest(item_id)
        if digest in self._digests:
            return False
        self._digests.add(digest)
        return True

    def __contains__(self, item_id: object) -> bool:
        return isinstance(item_id, str) and _digest(item_id) in self._digests

    def __len__(self) -> int:
        return len(self._digests)


def _digest(item_id: str) -> bytes:
    return hashlib.blake2b(item_id.encode(), digest_size=16).digest()


def first_records(batches: Iterable[list[ImageRecord]], seen: ItemSet | None = None
                  ) -> Iterator[list[ImageRecord]]:
    """Each batch's records of items no earlier batch had (and not in `seen`, which
    gains them), skipping a batch left with none: the one rule for an item recorded
    twice (a redelivery, a copy of a batch, a re-done batch overlapping its original):
    the first record wins."""
    seen = ItemSet() if seen is None else seen
    for records in batches:
        new = [record for record in records if seen.add(record.id)]
        if new:
            yield new


def failed_items(failures: Iterable[tuple[str, Iterable[str]]], done: Callable[[str], Container[str]]
                 ) -> set[str]:
    """The items failed: named by a failure record, given as (batch id, item ids), and
    not done since (a retry, a resume or a copy of the batch may have done them);
    `done(batch id)` holds the items shown done among that batch's. The one rule that
    status, report and retry-failed count by."""
    failed: set[str] = set()
    for batch_id, item_ids in failures:
        done_here = done(batch_id)
        failed.update(item for item in item_ids if item not in done_here)
    return failed


def iter_records(storage: Storage) -> Iterator[ImageRecord]:
    """Every image record, each item once (first_records)."""
    for records in first_records(records for _, records in read_records(storage, record_keys(storage))):
        yield from records


def recorded_batches(storage: Storage) -> dict[str, tuple[str, list[str]]]:
    """Every recorded batch: batch id -> (queue, item ids). A record means done."""
    return {batch_id: (records[0].queue, [record.id for record in records])
            for batch_id, records in read_records(storage, record_keys(storage)) if records}


def read_cancel(storage: Storage) -> CancelMarker | None:
    """The run's cancel marker (`diffq cancel`), or None if it is not cancelled."""
    try:
        return CancelMarker.model_validate_json(storage.get_bytes(layout.CANCEL))
    except NotFound:
        return None


def read_failures(storage: Storage) -> Iterator[FailureRecord]:
    """Every failure record (items that failed after every retry)."""
    for _, body in storage.get_many(sorted(storage.list(layout.FAILURES_PREFIX))):
        yield FailureRecord.model_validate_json(body)
