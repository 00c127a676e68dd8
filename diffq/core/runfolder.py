"""Reading a run folder: its manifest, its image records and its failure records.

Every layer above the base reads through these (status, resume, export, report);
nothing here asks the broker. The schemas are in records.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

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


def iter_records(storage: Storage) -> Iterator[ImageRecord]:
    """Every image record, each item once (first record wins if a race wrote two)."""
    seen: set[str] = set()
    for _, records in read_records(storage, record_keys(storage)):
        for record in records:
            if record.id not in seen:
                seen.add(record.id)
                yield record


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
