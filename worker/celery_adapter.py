"""The Celery adapter: all of the glue between diffq's worker and Celery, in one module.

The worker's own logic is Celery-free where it can be: a batch's life from receipt
to outcome and its hooks (tasks.py, hooks.py), the held ack (batches.py), queue
choice (routing.py). Here:

- the ack policy, stated once (`ACK_POLICY`, `WORKER_ARGS`);
- `BatchRequest`: Celery's request, whose ack goes through the batch line, so it
  is held until the sink has stored the batch;
- `BatchTask`: the task class; it carries the process's runtime (`task.runtime`);
- `WorkerStep`: the consumer bootstep that widens the prefetch window while an ack
  is held, runs the event-loop timers (settle held acks, re-route), keeps the
  leases of held batches (worker/lease.py), and waits for the held acks at shutdown;
- the drain: on SIGTERM the batch in hand may finish within the spec's drain
  timeout; past it (or at once, when the parent is gone) everything held is handed
  back, not as a failed attempt, what was generated is stored, and the process
  exits 0;
- `build_app` / `serve`: the app a worker process runs, and its two-thread worker.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from celery import Celery, Task, bootsteps, signals
from celery.worker.request import Request

from diffq.core.broker import TASK_NAME, make_celery, wake_consumer
from diffq.core.settings import get_settings
from diffq.core.transports import transport_for
from diffq.worker.lease import LeaseKeeper, held_deliveries
from diffq.worker.lifeline import parent_gone
from diffq.worker.dead_letters import DeadLetterStep
from diffq.worker.delivery import Action, Outcome, decide
from diffq.worker.spec import ChildSpec, hostname
from diffq.worker.runtime import Runtime
from diffq.worker.tasks import generate_batch

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
    """The ack is the batch line's decision (worker/delivery.py): at once, held until the
    sink is done, or a requeue."""

    def acknowledge(self):
        if self.acknowledged:
            return super().acknowledge()
        self.task.runtime.line.ack(self)

    def ack_now(self) -> None:
        Request.acknowledge(self)

    def requeue(self) -> None:
        self.reject(requeue=True)


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
        settings = get_settings()
        rt.lease = LeaseKeeper(transport, consumer.app.connection_for_write, lambda: held_deliveries(consumer),
                               period=settings.lease_renew_s, max_hold_s=settings.max_hold_s)
        rt.lease.start()
        if transport.consumer_channel is not None and consumer.task_consumer is not None:
            transport.consumer_channel(consumer.task_consumer.channel)
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
        # What is still held is `drained`: a requeue (worker/delivery.py), carried out
        # from this thread by the lease keeper's hand-back (the transport table's).
        assert decide(Outcome.DRAINED) is Action.REQUEUE
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
        return rt.lease.hand_back() if rt.lease is not None else 0
    except Exception as exc:  # its lease lapses instead
        log.warning("handing back held batches failed: %r", exc)
        return 0


def build_app(rt: Runtime) -> Celery:
    app = make_celery(rt.spec.broker_url, rt.spec.transport_options)
    app.conf.update(ACK_POLICY, worker_timer_precision=TIMER_PRECISION_S)
    arguments = transport_for(rt.spec.broker_url).consumer_arguments(get_settings())
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
    app.diffq_drains = drains  # for `serve`, once Celery has returned
    return app


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
