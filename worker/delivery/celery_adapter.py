"""The Celery adapter: all of the glue between diffq's worker and Celery, in one module.

Celery is the engine: its fetch loop, its threads pool and its bootsteps. The
worker's own logic is Celery-free where it can be: a batch's life from receipt
to outcome and its hooks (tasks.py, hooks.py), the held ack (batches.py), the
decision (outcomes.py) and the door that carries it out (door.py), queue choice
(routing.py). Beside the broker classes (diffq/core/brokers/), the only module that
imports celery or kombu or reads their private attributes (tests/test_broker_door.py).
Here:

- the ack policy, stated once (`ACK_POLICY`, `WORKER_ARGS`);
- `BatchRequest`: Celery's request, whose ack goes through the batch line, so it
  is held until the sink has stored the batch; the broker door's delivery for a
  task (ack, requeue, reject); a lost worker's batch is handed back by `decide`;
- `BatchTask`: the task class; it carries the process's runtime (`task.runtime`);
- `WorkerStep`: the consumer bootstep that widens the prefetch window while an ack
  is held, runs the event-loop timers (settle held acks, re-route), keeps the
  leases of held batches (worker/delivery/lease.py), and waits for the held acks at shutdown;
- `DeadLetterStep` and `checked_on_receipt`: what is refused before it becomes a
  task (worker/delivery/dead_letters.py, each with its `Refused` reason);
- the drain: on SIGTERM the batch in hand may finish within the spec's drain
  timeout; past it (or at once, when the parent is gone) everything held is handed
  back (`drained`), not as a failed attempt, what was generated is stored, and
  the process exits 0;
- `build_app` / `serve`: the app a worker process runs, and its two-thread worker;
- driven by hand, for the fleet benchmark's simulated workers (bench/fleet.py): the
  queue Celery's consumer makes (`task_queue`), its queue switching on a kombu
  Consumer (`HandConsumer`) and Celery's worker heartbeat (`heart`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from celery import Celery, Task, bootsteps, signals
from celery.worker.heartbeat import Heart
from celery.worker.request import Request
from kombu import Consumer, Exchange, Queue

from diffq.core.brokers.app import make_celery
from diffq.core.brokers.base import TASK_NAME
from diffq.core.brokers.embedded import wake_consumer
from diffq.core.contract import MAX_MESSAGE_BYTES
from diffq.core.settings import get_settings
from diffq.core.signing import HEADER as SIGNATURE
from diffq.core.transports import transport_for
from diffq.worker.delivery import door
from diffq.worker.delivery.lease import LeaseKeeper
from diffq.worker.observe.lifeline import parent_gone
from diffq.worker.delivery.dead_letters import DeadLetters, declare_dead_letters
from diffq.worker.delivery.outcomes import Outcome, Refused
from diffq.worker.delivery.spec import ChildSpec, hostname
from diffq.worker.delivery.runtime import Runtime
from diffq.worker.delivery.tasks import generate_batch

log = logging.getLogger("diffq.worker")

# The ack policy. A batch is acknowledged only once its images, record and progress
# credit are stored (late acks, held by the batch line), and a worker that dies
# mid-batch hands it back instead of dropping it. One batch in hand per process:
# a long accelerator batch must not sit in a busy worker's buffer while another
# device idles (the window widens by one only while an ack is held). Compiled
# pipelines live for the process: never recycle it.
ACK_POLICY = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "worker_max_tasks_per_child": None,
}
# Two task threads in the process that holds the device and the compiled graphs
# (Celery's threads pool): while one batch's call runs, the next batch is received,
# validated and its call prepared, and it waits on the device lock (PipelineHost),
# so the device goes from one call to the next without the host's per-batch work in
# between. The second batch is taken only while calls are short (`BatchLine.paced`,
# DIFFQ_RUN_AHEAD_S): otherwise one batch in hand, as before. Acks from the task
# threads go through Celery's own `call_soon_ack` (the consumer's loop where it has
# one). Plain SIGTERM is a warm shutdown (the batches in hand finish); it is never
# remapped (../shared/CELERY.md).
WORKER_ARGS = ["--pool=threads", "--concurrency=2", "--without-mingle", "--without-gossip"]
# Celery's timer thread (a transport without an event loop, the embedded one) sleeps
# up to this between looks, and a warm shutdown waits for it (celery/utils/timer2.py,
# Timer.stop): Celery's default of 1 s was a second at the end of every `diffq run`.
TIMER_PRECISION_S = 0.1


class BatchRequest(Request):
    """The ack is the batch line's decision (worker/delivery/outcomes.py): at once, held until the
    sink is done, or a requeue."""

    def acknowledge(self):
        if self.acknowledged:
            return super().acknowledge()
        self.task.runtime.line.ack(self)

    def ack_now(self) -> None:
        Request.acknowledge(self)

    def requeue(self) -> None:
        Request.reject(self, requeue=True)

    def answer(self):
        """What the broker will answer to the ack or reject the door is about to ask for
        (Celery runs it later, on the consumer's loop): a future, or None where the
        broker's acks answer nothing beyond kombu's, or this delivery is settled already."""
        message = getattr(self, "message", None)
        if message is None or self.acknowledged:
            return None
        broker = transport_for(self.app.conf.broker_url).broker
        return broker.answer(message) if broker.answer is not None else None

    failing = False  # inside Celery's on_failure

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        self.failing = True
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            self.failing = False

    def reject(self, requeue=False):
        # Inside Celery's failure handler its reject is an end of its own, a row of the
        # table: a requeue only for a lost worker (task_reject_on_worker_lost; diffq sets
        # no time limits and raises no Reject), a drop otherwise. Outside it, the reject
        # is the door's (carry_out's REJECT).
        if self.failing:
            self.failing = False  # the door's call below is Celery's own reject
            return door.end(Outcome.HAND_BACK if requeue else Outcome.ENGINE_REJECTED, self)
        return super().reject(requeue=requeue)


class BatchTask(Task):
    Request = BatchRequest
    typing = False
    runtime: Runtime | None = None  # bound per app by build_app


def run_batch(task: BatchTask, batch: dict) -> dict:
    return generate_batch(task, batch)


class PrefetchWindow:
    """The consumer's QoS: one more delivery may come in while an ack is held."""

    def __init__(self, qos):
        self.qos = qos

    def widen(self) -> None:
        self.qos.increment_eventually()

    def narrow(self) -> None:
        self.qos.decrement_eventually()


class WorkerStep(bootsteps.StartStopStep):
    """Consumer bootstep around the batch line (bound to a runtime by build_app)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    runtime: Runtime | None = None
    settle_interval = 0.05

    def start(self, consumer):
        rt = self.runtime
        line = rt.line
        # Celery's window starts at the pool's two threads; the line widens it to two
        # once it has seen a short call.
        line.attach(PrefetchWindow(consumer.qos), wake=wake_consumer)
        transport = transport_for(rt.spec.broker_url)
        broker = transport.broker
        settings = get_settings()
        rt.lease = LeaseKeeper(broker, consumer.app.connection_for_write, lambda: broker.held(consumer),
                               period=settings.lease_renew_s, max_hold_s=settings.max_hold_s)
        rt.lease.start()
        if broker.consumer_channel is not None and consumer.task_consumer is not None:
            broker.consumer_channel(consumer.task_consumer.channel, closed=door.channel_closed)
        if not transport.event_loop:
            return  # synloop: acks settle from the task body and at shutdown
        consumer.hub.call_repeatedly(self.settle_interval, line.settle)
        router = line.router
        if router is not None and router.applies:
            router.attach(consumer)
            consumer.hub.call_repeatedly(router.interval, router.update)

    def stop(self, consumer):
        """Consuming has stopped (the task threads may still be finishing their batches):
        ack what was stored; a drain waiting on it may go on."""
        rt = self.runtime
        if rt.line.router is not None:
            rt.line.router.detach()
        rt.line.close()
        rt.line.settle(wait=True)  # leases still renewed meanwhile
        rt.consuming_stopped.set()

    def shutdown(self, consumer):
        """The task threads are done (Celery stops its pool first): the last acks, then
        the leases, before the channel closes."""
        rt = self.runtime
        rt.line.close()
        rt.line.settle(wait=True)
        if rt.lease is not None:
            rt.lease.stop()
        rt.consuming_stopped.set()


# How long a drain that has handed back waits for the consumer's own shutdown.
DRAIN_SETTLE_S = 5.0


class Drain:
    """Started by a warm shutdown (SIGTERM): if the process is still here after the
    drain timeout, store what was generated, hand back everything held, exit 0."""

    def __init__(self, rt: Runtime, timeout: float):
        self.rt = rt
        self.timeout = timeout
        self.due = time.monotonic() + timeout
        self.thread = threading.Thread(target=self._run, name="diffq-drain", daemon=True)

    def finish(self) -> None:
        """The consumer has shut down. A drain still sleeping out its timeout is moot
        (the batch in hand finished first); one whose timeout has passed (at once when
        the parent is gone) is handing back: the process must not end before it has
        (it ends the process itself)."""
        if self.thread.is_alive() and time.monotonic() >= self.due:
            self.thread.join(DRAIN_SETTLE_S + 30)

    def _run(self) -> None:
        time.sleep(self.timeout)  # a batch that finishes first ends the process before this
        rt = self.rt
        try:
            rt.sink.flush()
        except Exception as exc:  # not stored: the handed-back copy stores it again
            log.warning("drain: storing what was generated failed: %r", exc)
        # What is still held is `drained` (worker/delivery/outcomes.py), carried out from this
        # thread for everything held at once: the lease keeper's hand-back (the
        # transport table's).
        handed = _hand_back(rt)
        # An idle consumer may have a fetch in flight: let its shutdown stop fetching,
        # then hand back what came in meanwhile. A busy one fetches nothing meanwhile.
        rt.consuming_stopped.wait(DRAIN_SETTLE_S)
        handed += _hand_back(rt)
        log.warning("%s: drain timeout (%.0f s) passed; handed back %d held batch(es), exiting",
                    rt.spec.name, self.timeout, handed)
        if rt.consuming_stopped.is_set() and not rt.line.running:
            # The consumer is shutting down the usual way: its channel's close (and
            # kombu's exit hook) gives back anything delivered after the hand-back.
            # os._exit here would skip both.
            return
        # Still generating a batch just handed back (a long compile, a hold): the
        # pool's shutdown would wait for its task thread; nothing it makes is needed.
        os._exit(0)


def _hand_back(rt: Runtime) -> int:
    try:
        return door.end(Outcome.DRAINED, door.AllHeld(rt.lease)) or 0
    except Exception as exc:  # its lease lapses instead
        log.warning("handing back held batches failed: %r", exc)
        return 0


def build_app(rt: Runtime) -> Celery:
    app = make_celery(rt.spec.broker_url, rt.spec.transport_options)
    app.conf.update(ACK_POLICY, worker_timer_precision=TIMER_PRECISION_S)
    arguments = transport_for(rt.spec.broker_url).broker.consumer_arguments(get_settings())
    if arguments:
        for queue in rt.spec.queues:
            app.amqp.queues[queue].consumer_arguments = arguments
    app.steps["consumer"].add(type("BoundWorkerStep", (WorkerStep,), {"runtime": rt}))
    app.steps["consumer"].add(type("BoundDeadLetterStep", (DeadLetterStep,), {"worker": rt.worker}))
    app.task(name=TASK_NAME, base=BatchTask, bind=True, runtime=rt)(run_batch)
    drains: list[Drain] = []

    def on_shutdown(**_):
        # Warm shutdown: the batch in hand finishes within the drain timeout (at once
        # handed back if the parent is gone), then its images must be stored.
        if not drains:
            drains.append(Drain(rt, 0.0 if parent_gone() else rt.spec.drain_timeout_s))
            drains[0].thread.start()
        rt.sink.flush()

    signals.worker_shutting_down.connect(on_shutdown, weak=False)
    if get_settings().log_json:
        # Celery configures logging itself unless a setup_logging receiver exists:
        # the JSON lines (worker/observe/logs.py) stay.
        signals.setup_logging.connect(_keep_logging, weak=False)
    app.diffq_drains = drains  # for `serve`, once Celery has returned
    return app


def _is_batch_call(call) -> bool:
    """Celery protocol 2's body: [args, kwargs, embed] (celery/app/amqp.py as_task_v2)."""
    return (isinstance(call, (list, tuple)) and len(call) == 3 and call[0] == [] and isinstance(call[1], dict)
            and set(call[1]) == {"batch"} and isinstance(call[1]["batch"], dict))


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class DeadLetterStep(bootsteps.StartStopStep):
    """Consumer bootstep: Celery's handlers for undeliverable messages, replaced.

    Celery's own (celery/worker/consumer/consumer.py: `on_decode_error`,
    `on_invalid_task`, `on_unknown_message`, `on_unknown_task`) log a traceback and
    drop or reject the message; these dead-letter it (worker/delivery/dead_letters.py) with
    its `Refused` reason. The step also declares the broker's dead letters for the
    consumer's queues and puts the receipt checks (size, call shape, admission) in
    front of the batch task's strategy."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    worker = "diffq"  # bound per app

    def start(self, consumer):
        queues = [queue.name for queue in (consumer.task_consumer.queues if consumer.task_consumer else [])]
        dead = DeadLetters(consumer.app, self.worker, declare_dead_letters(consumer.app, queues, _api(consumer.app)))
        consumer.app.diffq_dead_letters = dead

        def on_decode_error(message, exc):
            dead.reject(message, f"body not decodable as {message.content_type}: {_reason(exc)}",
                        why=Refused.UNDECODABLE)

        def on_invalid_task(body, message, exc):
            dead.reject(message, f"refused ({message.content_type}): {_reason(exc)}", why=Refused.INVALID_TASK)

        def on_unknown_message(body, message):
            dead.reject(message, "not a Celery task message", why=Refused.NOT_A_TASK)

        def on_unknown_task(body, message, exc):
            dead.reject(message, f"unknown task {(message.headers or {}).get('task')!r}", why=Refused.UNKNOWN_TASK)

        consumer.on_decode_error = on_decode_error
        consumer.on_invalid_task = on_invalid_task
        consumer.on_unknown_message = on_unknown_message
        consumer.on_unknown_task = on_unknown_task
        if consumer.task_consumer is not None:
            consumer.task_consumer.on_decode_error = on_decode_error
        broker = transport_for(consumer.app.conf.broker_url).broker
        if broker.guard_deliveries is not None and consumer.task_consumer is not None:
            broker.guard_deliveries(consumer.task_consumer.channel, lambda queue, item, reason:
                                    dead.malformed(queue, item, reason))
        if broker.stamp_arrivals is not None and consumer.task_consumer is not None:
            broker.stamp_arrivals(consumer.task_consumer)
        runtime = getattr(consumer.app.tasks.get(TASK_NAME), "runtime", None)
        strategy = consumer.strategies.get(TASK_NAME)
        if strategy is not None and not getattr(strategy, "checked_on_receipt", False):
            consumer.strategies[TASK_NAME] = checked_on_receipt(
                strategy, dead, getattr(runtime, "admission", None),
                lambda message: broker.arrival(message, consumer.task_consumer))


def _api(app) -> str | None:
    """The worker's RabbitMQ management API URL (its spec's, else DIFFQ_RABBITMQ_API)."""
    task = app.tasks.get(TASK_NAME)
    spec = getattr(getattr(task, "runtime", None), "spec", None)
    return getattr(spec, "rabbitmq_api", None) or get_settings().rabbitmq_api


def checked_on_receipt(strategy, dead: DeadLetters, admission=None, arrival=None):
    """The batch task's strategy behind the checks on receipt: the raw size, the call's
    shape (no positional args, one `batch` object, which would otherwise fail inside
    Celery's tracer as a TypeError), then the worker's admission (worker/delivery/admission.py:
    signature, schema, queue, run, model) of the batch on the queue it arrived on."""

    def checked(message, *args, **kwargs):
        size = len(message.body or b"")
        if size > MAX_MESSAGE_BYTES:
            return dead.reject(message, f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}",
                               why=Refused.TOO_LARGE)
        try:
            call = message.decode()
        except Exception:
            return strategy(message, *args, **kwargs)  # Celery's own handlers say why
        if not _is_batch_call(call):
            return dead.reject(message, "not a diffq batch call (expected no args and one 'batch' object)",
                               why=Refused.NOT_A_CALL)
        if admission is not None:
            queue = arrival(message) if arrival is not None else None
            _, refusal = admission.check(call[1]["batch"], queue, (message.headers or {}).get(SIGNATURE))
            if refusal is not None:
                return dead.reject(message, refusal.reason if refusal.malformed else f"refused: {refusal.reason}",
                                   queue=queue, why=refusal.why)
        return strategy(message, *args, **kwargs)

    checked.checked_on_receipt = True
    return checked


def _keep_logging(**_) -> None:
    pass


# The task thread waiting with the next prepared call gets the GIL only when the
# one whose call just ended (now handing its images on, in Python) drops it: at worst
# after the switch interval, 5 ms by default, which would sit between two calls.
SWITCH_INTERVAL_S = 0.0005


def serve(app: Celery, spec: ChildSpec) -> None:
    """Consume the spec's queues until a warm shutdown."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app.worker_main(["--quiet", "worker", *WORKER_ARGS, f"--queues={','.join(spec.queues)}",
                     f"--hostname={spec.name}@{hostname()}", f"--loglevel={spec.loglevel}"])
    for drain in getattr(app, "diffq_drains", ()):
        drain.finish()


# -- driven by hand ---------------------------------------------------------------------------
# bench/fleet.py runs a fleet's workers as objects, many on one loop per process: the
# pieces of Celery's consumer it drives by hand, so that nothing outside the door
# imports Celery or kombu.


def task_queue(name: str) -> Queue:
    """The kombu Queue Celery's consumer makes for a queue name it is told to add."""
    return Queue(name, Exchange(name), routing_key=name)


class HandConsumer:
    """What the router and the broker's `held` read of Celery's consumer: its connection,
    the task consumer (a kombu Consumer on the connection's default channel) and queue
    switching as Celery's add_task_queue / cancel_task_queue do it
    (celery/worker/consumer/consumer.py). The starting queues are declared by the caller."""

    def __init__(self, connection, queues: list[str], on_message=None, prefetch: int = 1):
        self.connection = connection
        channel = connection.default_channel
        channel.basic_qos(0, prefetch, False)
        self.task_consumer = Consumer(channel, [task_queue(q) for q in queues], on_message=on_message,
                                      accept=["json"], auto_declare=False)
        self.task_consumer.consume()

    def add_task_queue(self, queue: str) -> None:
        if not self.task_consumer.consuming_from(queue):
            task_queue(queue)(self.task_consumer.channel).declare()  # Celery's consumer auto-declares
            self.task_consumer.add_queue(task_queue(queue))
            self.task_consumer.consume()

    def cancel_task_queue(self, queue: str) -> None:
        self.task_consumer.cancel_by_queue(queue)

    def consuming(self) -> set[str]:
        return {q.name for q in self.task_consumer.queues if self.task_consumer.consuming_from(q.name)}


def heart(dispatcher, timer, interval: float) -> Heart:
    """Celery's worker heartbeat (a `worker-heartbeat` event every `interval` through the
    event `dispatcher`) on `timer` (call_repeatedly / cancel); `start()` begins it."""
    return Heart(timer, dispatcher, interval=interval)
