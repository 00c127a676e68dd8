"""Compile-aware routing and queue discovery: which queues a worker consumes from now.

A worker serving several shape queues keeps consuming the shapes it has already
compiled while they have a backlog, and takes on one new shape at a time only
when they are empty (chosen at random, weighted by backlog, so idle workers of a
fleet spread over new shapes instead of all compiling the same ones); with nothing
queued anywhere it listens on the shapes it has compiled. Celery's own consumer API
switches queues: `add_task_queue` / `cancel_task_queue`.
Queue names parse back to shapes with `diffq.core.contract.shape_from_queue`.

A worker given --queues (a per-shape pool: Neuron, TPU) discovers, where the broker can
list, those queues' LoRA runs: the same shape with a layout label (`Q.r16-…`).

A worker started without --queues discovers them: every few seconds it lists the
broker's diffq shape queues (the broker object's `list_queues`), keeps those of
its models (--models; the queue name carries a model slug), and adds them to what
it serves, so the queues of a run submitted later are served within seconds.

Where the transport has a listing the fleet shares (`shared_depths`: Redis), a tick
costs the same whatever the number of queues: one read of the shared listing (at
most one interval old, retaken by one worker of the fleet per interval), which names
new queues and weighs new shapes, and, only while another shape has work, the
compiled shapes' own depths, which decide whether to keep draining them.
bench/fleet.py measures what that saves (docs/fleet.md).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from diffq.core.contract import is_shape_queue, without_layout
from diffq.core.brokers.base import PREFIX, CannotList
from diffq.core.transports import Transport, transport_for

log = logging.getLogger(__name__)


def choose_queues(served: list[str], compiled: set[str], depths: dict[str, int], rng: random.Random) -> set[str]:
    """The queues to consume from now."""
    backlog = {queue for queue in served if depths.get(queue, 0) > 0}
    hot = backlog & compiled
    if hot:
        return hot
    fresh = sorted(backlog - compiled)
    if fresh:
        pick = rng.choices(fresh, weights=[depths[queue] for queue in fresh])[0]
        return {pick} | (compiled & set(served))
    # Nothing queued anywhere: listen where this worker has compiled (work for those
    # starts at once; work for a new shape is seen by the next tick), everywhere if it
    # has compiled nothing yet. Blocking on every queue costs the broker per queue and
    # idle worker (bench/fleet.py); one queue at least keeps kombu's restore sweep on.
    return (compiled & set(served)) or set(served)


class Discovery:
    """The shape queues of `models` (empty: every model) that the broker lists now."""

    interval = 2.0

    def __init__(self, transport: Transport, models: list[str] | None = None, api: str | None = None,
                 prefix: str = PREFIX, dtypes: tuple[str, ...] | None = None, variants_of: list[str] | None = None,
                 layouts: bool = True):
        if transport.broker.list_queues is None:
            raise CannotList(f"no queues: a {transport.name} broker cannot list its queues; "
                             "name them with --queues or --run")
        if transport.list_needs_api and not api:
            raise CannotList(transport.list_needs_api)
        self.transport = transport
        self.models = list(models or [])
        self.api = api
        self.prefix = prefix
        # The shape-key dtypes this worker's backend serves (auto and the ones it runs).
        self.dtypes = dtypes
        # A worker given --queues (a per-shape pool's) keeps only those queues' LoRA runs:
        # the same shape with a layout label (`Q.r16-…`), compiled as Q.
        self.variants_of = set(variants_of) if variants_of else None
        # False: a worker that takes no adapters (a --tp group, lora_modes.TP_REFUSAL) leaves
        # LoRA runs' queues (their names end in the layout label) to the others.
        self.layouts = layouts

    def find(self, connection) -> list[str]:
        return self.keep(self.transport.broker.list_queues(connection, self.prefix, self.api))

    def keep(self, names) -> list[str]:
        """The shape queues among `names` that this worker serves."""
        return [queue for queue in names if is_shape_queue(queue, self.models, self.dtypes)
                and (self.variants_of is None or without_layout(queue) in self.variants_of)
                and (self.layouts or without_layout(queue) == queue)]


def startup_queues(broker_url: str, models: list[str] | None = None, api: str | None = None, *,
                   transport_options: dict | None = None, dtypes: tuple[str, ...] | None = None,
                   variants_of: list[str] | None = None, layouts: bool = True) -> list[str]:
    """The queues a worker without --queues starts on: one listing now. Raises
    CannotList (saying what to pass instead) where the broker cannot list, before
    anything starts; [] while the broker is not up yet (the workers connect with
    Celery's retries and list it then)."""
    from diffq.core.brokers.app import make_celery

    discovery = Discovery(transport_for(broker_url), models, api, dtypes=dtypes, variants_of=variants_of,
                          layouts=layouts)
    try:
        with make_celery(broker_url, transport_options).connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)
            return discovery.find(connection)
    except CannotList:
        raise
    except Exception as exc:
        log.warning("broker not reachable yet (%s): the workers will list its queues once it is", exc)
        return []


class Router:
    """Re-chooses the consumer's queues: on a 1 s timer and right after each batch.

    Needs the consumer's event loop (the transport table's `event_loop`); without one
    (the embedded filesystem broker) the worker keeps Celery's round-robin.
    """

    interval = 1.0

    def __init__(self, served: list[str], compiled: Callable[[], set[str]], transport: Transport,
                 rng: random.Random | None = None, discovery: Discovery | None = None,
                 compile_aware: bool = True):
        self.served = list(served)
        self.compiled = compiled  # the queues whose shapes this process has compiled
        self.transport = transport
        self.rng = rng or random.Random()
        self.discovery = discovery
        self.compile_aware = compile_aware
        self.consumer = None
        self._next_discovery = 0.0
        self._listing_failed = False
        self._judged: set[str] = set()  # listed names already kept or passed over
        self.on_serve: Callable[[list[str]], None] | None = None  # told of each queue served from now on

    @property
    def applies(self) -> bool:
        """A choice among several queues, or queues to discover, and an event loop to run it."""
        return self.transport.event_loop and (self.discovery is not None or len(self.served) >= 2)

    def attach(self, consumer) -> None:
        self.consumer = consumer

    def detach(self) -> None:
        self.consumer = None

    def discover(self, connection) -> list[str]:
        """Add the queues the broker lists now (at most every `Discovery.interval`)."""
        now = time.monotonic()
        if self.discovery is None or now < self._next_discovery:
            return []
        self._next_discovery = now + self.discovery.interval
        try:
            found = self.discovery.find(connection)
        except Exception as exc:  # a failed listing keeps what is served; said once until it works
            if not self._listing_failed:
                log.warning("listing the broker's queues failed, serving the %d known: %s", len(self.served), exc)
            self._listing_failed = True
            return []
        self._listing_failed = False
        return self._serve(found)

    def _serve(self, found) -> list[str]:
        new = [queue for queue in found if queue not in self.served]
        if new:
            # Queues stay served once found: an emptied Redis queue has no key to list.
            self.served += new
            log.info("serving %d more queues: %s", len(new), ", ".join(new))
            if self.on_serve is not None:
                self.on_serve(new)
        return new

    def shared(self, connection, compiled: set[str]) -> dict[str, int]:
        """This tick's depths from the fleet's shared listing (at most `interval` old),
        which also names the queues to discover."""
        prefix = self.discovery.prefix if self.discovery is not None else PREFIX
        try:
            depths = self.transport.broker.shared_depths(connection, prefix, self.interval)
        except Exception as exc:  # as a failed listing: the known queues, said once until it works
            if not self._listing_failed:
                log.warning("reading the broker's queue listing failed, serving the %d known: %s",
                            len(self.served), exc)
            self._listing_failed = True
            depths = {}
        else:
            self._listing_failed = False
        if self.discovery is not None:
            # Judge each listed name once: the listing comes every tick, new names rarely.
            unjudged = sorted(set(depths) - self._judged)
            self._judged.update(unjudged)
            self._serve(self.discovery.keep(unjudged))
        if self.compile_aware:
            # Read now what a stale listing would get wrong: whether the compiled shapes
            # still have work while another shape has some (leaving them early costs a
            # compile, late an idle tick); and queues outside the listing.
            elsewhere = any(depths.get(q, 0) > 0 for q in self.served if q not in compiled)
            exact = [q for q in self.served if (elsewhere and q in compiled) or not q.startswith(prefix)]
            if exact:
                depths.update(self.transport.broker.queue_depths(connection, exact))
        return depths

    def update_soon(self) -> None:
        """From a task thread, right after a batch: the update runs on the consumer's
        loop, the only thread that may use its connection (kombu's are not thread-safe)."""
        consumer = self.consumer
        if consumer is not None:
            consumer.call_soon(self.update)

    def update(self) -> None:
        consumer = self.consumer
        if consumer is None or consumer.task_consumer is None:
            return
        compiled = self.compiled() if self.compile_aware else set()
        if self.transport.broker.shared_depths is not None:
            depths = self.shared(consumer.connection, compiled)
        else:
            self.discover(consumer.connection)
            depths = None
        if not self.served:
            return
        if self.compile_aware:
            if depths is None:
                depths = self.transport.broker.queue_depths(consumer.connection, self.served)
            want = choose_queues(self.served, compiled, depths, self.rng)
        else:
            want = set(self.served)
        task_consumer = consumer.task_consumer
        current = {queue.name for queue in task_consumer.queues if task_consumer.consuming_from(queue.name)}
        for queue in sorted(want - current):
            consumer.add_task_queue(queue)
        # A discovering worker starts on Celery's default queue when none is listed yet.
        drop = (current - want) if self.discovery is not None else (current & set(self.served)) - want
        for queue in sorted(drop):
            consumer.cancel_task_queue(queue)
