"""Reading a run folder: its manifest and its image records.

Every layer above the base reads through these (status, resume, export, report);
nothing here asks the broker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from diffq.core import layout
from diffq.core.contract import FailureRecord, RunManifest
from diffq.core.storage import NotFound, Storage


class NotARun(RuntimeError):
    pass


def read_manifest(storage: Storage) -> RunManifest:
    try:
        return RunManifest.model_validate_json(storage.get_bytes(layout.MANIFEST))
    except NotFound:
        raise NotARun(f"{storage.url} holds no diffq run (no {layout.MANIFEST})") from None


def parse_records(body: bytes) -> Iterator[dict]:
    for line in body.decode().splitlines():
        if line:
            yield json.loads(line)


def iter_records(storage: Storage) -> Iterator[dict]:
    """Every image record, each item once (first record wins if a race wrote two)."""
    seen: set[str] = set()
    keys = [key for key in storage.list(layout.RECORDS_PREFIX) if key.endswith(".jsonl")]
    for _, body in storage.get_many(keys):
        for record in parse_records(body):
            if record["id"] not in seen:
                seen.add(record["id"])
                yield record


def read_cancel(storage: Storage) -> dict | None:
    """The run's cancel marker (`diffq cancel`), or None if it is not cancelled."""
    try:
        return json.loads(storage.get_bytes(layout.CANCEL))
    except NotFound:
        return None


class ProgressTracker:
    """Progress from every record and failure file, reading each one once.

    Record files never change after they are written (if_absent), so a watcher
    only needs to read the keys it has not seen.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self._read: set[str] = set()
        self.done_ids: set[str] = set()
        self.failed_ids: set[str] = set()
        self.done_per_queue: dict[str, int] = {}
        self.generate_s: list[float] = []
        self.batches: dict[str, tuple[str, list[str]]] = {}  # recorded batch -> (queue, item ids)

    def refresh(self) -> None:
        new = [key for prefix in (layout.RECORDS_PREFIX, layout.FAILURES_PREFIX)
               for key in self.storage.list(prefix) if key not in self._read]
        for key, body in self.storage.get_many(new):
            self._read.add(key)
            if key.startswith(layout.FAILURES_PREFIX):
                self.failed_ids.update(FailureRecord.model_validate_json(body).item_ids)
                continue
            records = list(parse_records(body))
            if records:
                self.generate_s.append(records[0].get("generate_s", 0.0))
                batch_id = key[len(layout.RECORDS_PREFIX):-len(".jsonl")]
                self.batches[batch_id] = (records[0].get("queue", ""), [record["id"] for record in records])
            for record in records:
                if record["id"] in self.done_ids:
                    continue
                self.done_ids.add(record["id"])
                queue = record.get("queue", "")
                self.done_per_queue[queue] = self.done_per_queue.get(queue, 0) + 1

    @property
    def done(self) -> int:
        return len(self.done_ids)

    @property
    def failed(self) -> int:
        return len(self.failed_ids - self.done_ids)
