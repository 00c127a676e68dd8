"""Leases on held batches: the holder keeps them alive, not a long timeout.

While a worker process holds deliveries (the batch generating, compiling or being
stored, and one prefetched), a thread renews their lease every `lease_renew_s`
the way its broker object does (diffq/core/brokers/; Redis: the `unacked_index`
score; SQS: ChangeMessageVisibility). The broker then hands a batch back only when nobody
renewed it for a visibility timeout: its holder (process or host) died. A batch
held past `max_hold_s` is no longer renewed: its `lease lapsed` end (worker/delivery/outcomes.py),
the outer bound for a hung holder.

The thread has its own broker connection (kombu channels are not thread-safe);
it only reads which deliveries the consumer holds (the broker's `held`).
`hand_back` gives them all back at once, for a drain that ran out of time or a
parent that died (the door's `AllHeld`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from diffq.core.brokers.base import Broker
from diffq.worker.delivery.outcomes import Outcome
from diffq.worker.delivery.door import Overdue, end
from diffq.worker.observe import metrics

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, broker: Broker, connect: Callable, held: Callable[[], list],
                 period: float, max_hold_s: float):
        self.broker = broker  # renew / hand_back, or None where the broker needs none
        self.connect = connect  # -> a new kombu Connection (the app's connection_for_write)
        self.held = held
        self.period = period
        self.max_hold_s = max_hold_s
        self.renewals = 0
        self._first_seen: dict[str, float] = {}
        self._handed: set[str] = set()  # delivery tags given back: never renewed or handed again
        self._lapsing: set[str] = set()  # held past max_hold_s: left to lapse (`lease lapsed`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one user of the connection at a time
        self._connection = None

    @property
    def renews(self) -> bool:
        return self.broker.renew is not None

    def start(self) -> None:
        if self.renews and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="diffq-lease", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period + 5)
            self._thread = None
        with self._lock:
            self._release()

    def channel(self):
        """The keeper's own channel (its connection opened on first use)."""
        if self._connection is None:
            self._connection = self.connect()
        return self._connection.default_channel

    def _release(self) -> None:
        if self._connection is not None:
            try:
                self._connection.release()
            except Exception:
                pass
            self._connection = None

    def renew_once(self) -> int:
        now = time.monotonic()
        messages = self.held()
        tags = {message.delivery_tag for message in messages}
        for tag in list(self._first_seen):
            if tag not in tags:
                del self._first_seen[tag]
        self._lapsing &= tags
        for message in messages:
            tag = message.delivery_tag
            held_s = now - self._first_seen.setdefault(tag, now)
            if held_s >= self.max_hold_s and tag not in self._lapsing and tag not in self._handed:
                metrics.observe_lease_lapse()
                end(Outcome.LEASE_LAPSED, Overdue(tag, held_s, self._lapsing.add))
        fresh = [m for m in messages if m.delivery_tag not in self._handed and m.delivery_tag not in self._lapsing]
        if not fresh:
            return 0
        with self._lock:
            try:
                renewed = self.broker.renew(self.channel(), fresh)
            except Exception:
                self._release()  # a broken connection: a new one next period
                raise
        self.renewals += 1
        return renewed

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.renew_once()
            except Exception as exc:  # the broker is away: the next period tries again
                log.warning("renewing the lease of held batches failed: %r", exc)

    def hand_back(self) -> int:
        """Give every held delivery back to its queue now; how many went back."""
        if self.broker.hand_back is None:
            return 0
        messages = [m for m in self.held() if m.delivery_tag not in self._handed]
        if not messages:
            return 0
        with self._lock:
            handed = self.broker.hand_back(self.channel(), messages)
        self._handed.update(m.delivery_tag for m in messages)
        return handed
