"""One door to the broker (issues 41, 49).

- Only the broker classes (diffq/core/brokers/) and the Celery adapter
  (worker/delivery/celery_adapter.py) import celery or kombu or read a private
  (`_`-prefixed) name of theirs, in every layer and in bench/: everything else reaches
  the broker through a broker object, the deliveries port (worker/delivery/door.py) or
  public API.
- `decide` (worker/delivery/outcomes.py) is total, each outcome maps to one action, and each
  action is one call on the port (`carry_out`); every end of a delivery outside the
  task (a refusal on receipt, a malformed item, a drain, a lease past its bound, a
  lost connection, a lost worker) goes through it.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from types import SimpleNamespace

import celery
import kombu
import pytest

from diffq.worker.delivery import door
from diffq.worker.delivery.outcomes import DECISIONS, LETTERED, Action, Outcome, Refused, decide, refusal
from tests.test_dead_letter_brokers import StubMessage
from tests.test_layers import LAYER, MODULES, layer_of

# The only modules that may import celery or kombu or read their private attributes:
# one class per broker, and the engine (Celery's fetch loop, pool, bootsteps).
BROKER_CLASSES = {m for m in MODULES if m == "diffq.core.brokers" or m.startswith("diffq.core.brokers.")}
DOORS = BROKER_CLASSES | {"diffq.worker.delivery.celery_adapter"}
# Where Celery's task object (`Delivered`, worker/delivery/door.py) is read for a batch's life.
TASK_DOORS = DOORS | {"diffq.worker.delivery.door"}
BROKER_PACKAGES = ("celery", "kombu")
# Receivers whose private attributes are their own business: the module's own object.
OWN = {"self", "cls"}


def _private_names() -> frozenset[str]:
    """Every `_name` (not dunder) kombu and Celery define: functions, classes, and
    attributes or names they assign."""
    names: set[str] = set()
    for package in (kombu, celery):
        for path in Path(package.__file__).parent.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = node.name
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    name = node.attr
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    name = node.id
                else:
                    continue
                if name.startswith("_") and not name.startswith("__") and name != "_":
                    names.add(name)
    return frozenset(names)


PRIVATE = _private_names()


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def broker_reach(source: str, filename: str = "<test>") -> list[str]:
    """Where a module imports celery or kombu, or reads a kombu/Celery private
    attribute of an object other than its own or a (non-broker) module it imported."""
    tree = ast.parse(source, filename=filename)
    modules: set[str] = set()  # names bound to modules other than celery's and kombu's
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in BROKER_PACKAGES:
                    found.append(f"line {node.lineno}: import {alias.name}")
                else:
                    modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in BROKER_PACKAGES and not node.level:
                found.append(f"line {node.lineno}: from {node.module} import ...")
            else:
                modules.update(alias.asname or alias.name for alias in node.names)

    def foreign(receiver: ast.expr) -> bool:
        if isinstance(receiver, ast.Name) and receiver.id in OWN:
            return False
        if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super":
            return False
        root = _root(receiver)
        return not (isinstance(root, ast.Name) and root.id in modules)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE and foreign(node.value):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in PRIVATE and foreign(node.args[0])):
            found.append(f"line {node.lineno}: {node.func.id}(…, {node.args[1].value!r})")
    return found


GUARDED = sorted(m for m in MODULES if m not in DOORS)


def test_the_doors_exist_and_the_guarded_modules_are_read():
    assert DOORS <= set(MODULES)
    assert {"diffq.core.brokers.base", "diffq.core.brokers.redis", "diffq.core.brokers.rabbitmq",
            "diffq.core.brokers.sqs", "diffq.core.brokers.embedded"} <= BROKER_CLASSES
    assert {"diffq.worker.delivery.batches", "diffq.worker.delivery.lease", "diffq.worker.delivery.dead_letters",
            "diffq.worker.delivery.tasks", "diffq.worker.delivery.hooks", "diffq.worker.delivery.door",
            "diffq.app.commands.fleet", "diffq.core.transports", "diffq.core.settings", "diffq.producer.publish",
            "diffq.producer.messages", "diffq.producer.feed", "bench.producer", "bench.stamps", "bench.fleet"} <= set(GUARDED)
    assert {layer_of(m) for m in GUARDED} == set(LAYER)
    assert {"_delivered", "_dirty", "_quick_ack", "_brpop_start", "_active_tags"} <= PRIVATE


@pytest.mark.parametrize("module", GUARDED)
def test_only_the_door_reaches_into_celery_and_kombu(module):
    found = broker_reach(MODULES[module].read_text(), str(MODULES[module]))
    assert not found, f"{module} reaches past the broker door ({', '.join(DOORS)}): {found}"


# Celery's task API: a batch's life reaches it through the door's `Delivered`.
TASK_API = {"request", "send_task", "apply_async"}


def task_api_reads(source: str) -> list[str]:
    return [f"line {node.lineno}: .{node.attr}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in TASK_API]


@pytest.mark.parametrize("module", [m for m in GUARDED if layer_of(m) == "diffq.worker" and m not in TASK_DOORS])
def test_a_batchs_life_reaches_celerys_task_through_the_door(module):
    assert not (found := task_api_reads(MODULES[module].read_text())), f"{module}: {found}"


def test_the_check_can_fail():
    assert task_api_reads("def attempts(task):\n    return task.request.retries + 1\n")
    assert broker_reach("from celery.worker import state\n")
    assert broker_reach("def f():\n    import kombu\n")
    assert broker_reach("def f(consumer):\n    return consumer.task_consumer.channel.qos._delivered\n")
    assert broker_reach("def f(channel):\n    return getattr(channel, '_brpop_start')\n")
    assert broker_reach("class A:\n    def f(self):\n        return self.qos._dirty\n")
    assert broker_reach("def f(channel):\n    return channel._q_for_pri('q', 0)\n")  # the publisher's, before 49
    assert broker_reach("from celery import Celery\n")  # producer/messages.py's, before 49
    # Its own attributes, and a module's (os._exit, threading._shutdown), are not the broker's.
    assert not broker_reach("import threading\nclass A:\n    def f(self):\n        threading._shutdown()\n"
                            "        return self._delivered\n")


# -- the table ----------------------------------------------------------------------------


class Port:
    """A delivery that records each call on the port by the action it carries out."""

    def __init__(self):
        self.calls: list[str] = []

    def ack_now(self):
        self.calls.append(Action.ACK.value)

    def requeue(self):
        self.calls.append(Action.REQUEUE.value)

    def reject(self, requeue=False):
        self.calls.append(Action.REQUEUE.value if requeue else Action.REJECT.value)

    def let_lapse(self):
        self.calls.append(Action.LET_LAPSE.value)


def test_the_table_is_total_and_every_action_is_used():
    assert set(DECISIONS) == set(Outcome)
    assert all(isinstance(DECISIONS[o], Action) for o in Outcome)
    assert {decide(o) for o in Outcome} == set(Action)


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_is_one_call_on_the_port(outcome):
    port = Port()
    if decide(outcome) is Action.ACK_WHEN_STORED:  # held by the batch line until its store is done
        with pytest.raises(ValueError, match="holding the ack"):
            door.end(outcome, port)
        assert port.calls == []
    else:
        door.end(outcome, port)
        assert port.calls == [decide(outcome).value]


def test_the_ends_outside_the_task_are_rows():
    assert decide(Outcome.MALFORMED) is Action.ACK  # its letter is written; the read removed it
    assert decide(Outcome.DRAINED) is Action.REQUEUE
    assert decide(Outcome.HAND_BACK) is Action.REQUEUE  # a tensor-parallel rank, or Celery's lost worker
    assert decide(Outcome.LEASE_LAPSED) is Action.LET_LAPSE
    assert decide(Outcome.CONNECTION_LOST) is Action.LET_LAPSE


@pytest.mark.parametrize("why", list(Refused))
@pytest.mark.parametrize("by_broker", [True, False])
def test_every_refusal_is_one_outcome_of_the_table(why, by_broker):
    outcome = refusal(why, by_broker)
    assert outcome in (Outcome.REFUSED, Outcome.DEAD_LETTER)
    # A trust refusal always leaves a letter with its reason; the others go the broker's way.
    assert (outcome is Outcome.DEAD_LETTER) == (why in LETTERED or not by_broker)


# -- each end, carried out through the door --------------------------------------------------


@pytest.mark.parametrize("why", list(Refused))
@pytest.mark.parametrize("by_broker", [True, False])
def test_a_refusal_on_receipt_is_carried_out_as_decided(why, by_broker):
    from diffq.core.brokers.app import make_celery
    from diffq.worker.delivery.dead_letters import DeadLetters

    message = StubMessage()
    DeadLetters(make_celery("memory://"), "w@h", by_broker=by_broker).reject(message, "why", why=why)
    assert message.calls == [{Action.ACK: "ack", Action.REJECT: "reject"}[decide(refusal(why, by_broker))]]


def test_a_malformed_item_is_lettered_and_its_pop_was_its_removal():
    from diffq.core.brokers.app import make_celery
    from diffq.core.brokers.base import DEAD_QUEUE
    from diffq.worker.delivery.dead_letters import DeadLetters

    app = make_celery("memory://")
    DeadLetters(app, "w@h").malformed("diffq.malformed", b"not json", "not JSON (not a kombu message envelope)")
    letters = []
    with app.connection_for_read() as connection:  # the memory broker is the process's: earlier letters too
        while (letter := DEAD_QUEUE(connection.default_channel).get(no_ack=True)) is not None:
            letters.append(letter.payload)
    assert [(m["reason"], m["body"]) for m in letters if m["queue"] == "diffq.malformed"] == [
        ("not JSON (not a kombu message envelope)", "not json")]
    with pytest.raises(ValueError):  # an item kombu cannot read is never put back
        door.Taken().requeue()


def test_a_drain_hands_back_everything_held_through_the_lease():
    lease = SimpleNamespace(handed=0)
    lease.hand_back = lambda: setattr(lease, "handed", lease.handed + 1) or 3
    assert door.end(Outcome.DRAINED, door.AllHeld(lease)) == 3 and lease.handed == 1
    assert door.end(Outcome.DRAINED, door.AllHeld(None)) == 0  # no lease keeper: nothing held


def test_a_delivery_past_its_bound_is_left_to_lapse(caplog):
    from diffq.worker.delivery.lease import LeaseKeeper

    renewed: list[list[str]] = []
    transport = SimpleNamespace(renew=lambda channel, messages: renewed.append([m.delivery_tag for m in messages])
                                or len(messages), hand_back=None)
    held = [SimpleNamespace(delivery_tag="a"), SimpleNamespace(delivery_tag="b")]
    keeper = LeaseKeeper(transport, lambda: SimpleNamespace(default_channel=None), lambda: held,
                         period=1.0, max_hold_s=3600)
    assert keeper.renew_once() == 2 and renewed == [["a", "b"]]
    keeper.max_hold_s = 0  # both held past the bound now
    with caplog.at_level(logging.WARNING, logger="diffq.worker"):
        assert keeper.renew_once() == 0
        assert keeper.renew_once() == 0
    assert renewed == [["a", "b"]]
    assert sum("past DIFFQ_MAX_HOLD_S" in r.getMessage() for r in caplog.records) == 2  # once per delivery


class _Answered:
    """A task's delivery as the door sees it: its ack or requeue runs on the consumer
    channel (later, on Celery's loop), which answers what it met."""

    def __init__(self, consumer, tag: str):
        self.consumer, self.tag, self.runs = consumer, tag, []

    def answer(self):
        return self.consumer.answer(self.tag)

    def ack_now(self) -> None:
        self.runs.append(lambda: self.consumer.ack(self.tag))

    def requeue(self) -> None:
        self.runs.append(lambda: self.consumer.reject(self.tag, requeue=True))


def test_a_lost_connection_settles_here_and_leaves_the_rest_to_the_lease(caplog):
    """A decided ack or requeue the broker can no longer be told about: the consumer
    channel answers `ConnectionLost` where the call runs, and the door ends it
    `connection lost` (let lapse), a row of the table like every other."""
    from diffq.core.brokers.base import ConnectionLost
    from diffq.core.brokers.redis import ConsumerChannel

    settled: list[str] = []
    qos = SimpleNamespace(append=None, ack=None, reject=None, restore_unacked=None, _quick_ack=settled.append)
    channel = SimpleNamespace(qos=qos, _brpop_start=None, connection=None)  # the transport let go of it
    installed = ConsumerChannel(channel)
    acked, requeued = _Answered(installed, "t1"), _Answered(installed, "t2")
    door.carry_out(Action.ACK, acked)
    door.carry_out(Action.REQUEUE, requeued)
    assert settled == []  # nothing runs before Celery's loop runs the calls
    with caplog.at_level(logging.WARNING, logger="diffq.worker"):
        for run in acked.runs + requeued.runs:
            run()
    assert settled == ["t1", "t2"] and installed.left_held == 2
    assert sum("connection is gone" in r.getMessage() for r in caplog.records) == 2
    assert decide(Outcome.CONNECTION_LOST) is Action.LET_LAPSE
    # An ack no one asked the answer of (kombu's own use) is settled here too.
    installed.ack("t3")
    assert settled == ["t1", "t2", "t3"] and installed.left_held == 3
    # A live channel answers None: acked, no end of its own.
    told: list[str] = []
    live = ConsumerChannel(SimpleNamespace(qos=SimpleNamespace(append=None, ack=told.append, reject=None,
                                                               restore_unacked=None),
                                           _brpop_start=None, connection=SimpleNamespace(client=object())))
    answer = live.answer("t4")
    live.ack("t4")
    assert told == ["t4"] and answer.result() is None and live.left_held == 0
    assert not isinstance(answer.result(), ConnectionLost)


def test_a_lost_worker_hands_the_batch_back_through_the_table(monkeypatch):
    from celery.worker.request import Request

    from diffq.worker.delivery.celery_adapter import BatchRequest

    calls: list[bool] = []
    monkeypatch.setattr(Request, "reject", lambda self, requeue=False: calls.append(requeue))
    request = BatchRequest.__new__(BatchRequest)
    request.failing = True  # inside Celery's on_failure: its requeue is task_reject_on_worker_lost's
    request.reject(requeue=True)
    request.failing = False
    request.reject(requeue=False)  # a REJECT carried out for the task's own outcome
    assert calls == [decide(Outcome.HAND_BACK) is Action.REQUEUE, False]


def test_every_admission_check_is_a_refused_row(tmp_path):
    """Each of admission's checks (worker/delivery/admission.py) ends as its own `Refused` row."""
    from diffq.core.signing import Keys
    from diffq.worker.delivery.admission import Admission, RunScope
    from tests.test_admission import SHAPE, a_batch

    out = str(tmp_path / "runs" / "r1")
    keys = Keys(b"k" * 32)
    admission = Admission(runs=(RunScope.of(out, "r1"),), models=frozenset({SHAPE.model}), keys=keys)

    def why(batch, queue=SHAPE.queue, signature="sign"):
        signature = keys.sign_batch(queue, batch) if signature == "sign" else signature
        _, refused = admission.check(batch, queue, signature)
        return refused.why if refused else None

    other = SHAPE.model_copy(update={"model": "/models/other"})
    assert why(a_batch(out)) is None
    assert why(a_batch(out), signature=None) is Refused.UNSIGNED
    assert why(a_batch(out), queue=None, signature=None) is Refused.UNSIGNED
    assert Admission().check({"not": "a batch"}, SHAPE.queue)[1].why is Refused.NOT_A_BATCH
    assert why(a_batch(out), queue=other.queue) is Refused.WRONG_QUEUE
    assert why(a_batch(str(tmp_path / "elsewhere"))) is Refused.NOT_ITS_SCOPE
    assert why(a_batch(out, shape=other), queue=other.queue) is Refused.UNKNOWN_MODEL
    # The schema's refusal goes the broker's way; every trust refusal leaves a letter.
    assert {Refused.UNSIGNED, Refused.WRONG_QUEUE, Refused.NOT_ITS_SCOPE, Refused.UNKNOWN_MODEL} <= LETTERED
    # The task body's trust refusals leave their reason too, on every broker.
    assert {Refused.NOT_ITS_RUN, Refused.OUT_NOT_ALLOWED} <= LETTERED
    assert refusal(Refused.OUT_NOT_ALLOWED, by_broker=True) is Outcome.DEAD_LETTER
    assert Refused.NOT_A_BATCH not in LETTERED


# -- the ends that used to happen outside `decide` (issue 49) -----------------------------------


def test_what_a_redis_channel_holds_as_it_closes_goes_back_through_the_table():
    """kombu gives back what a Redis channel still holds when it closes
    (QoS.restore_unacked): the worker's consumer channel does it one delivery at a time
    through `channel closed`, whose action is a requeue."""
    import contextlib

    from diffq.core.brokers.redis import ConsumerChannel

    restored: list[str] = []
    qos = SimpleNamespace(append=None, ack=None, reject=None, restore_unacked=None,
                          _delivered={"t1": object(), "t2": object()},
                          restore_by_tag=lambda tag, client=None: restored.append(tag))
    channel = SimpleNamespace(qos=qos, _brpop_start=None, connection=SimpleNamespace(client=object()),
                              conn_or_acquire=lambda client=None: contextlib.nullcontext(client))
    installed = ConsumerChannel(channel, closed=door.channel_closed)
    installed.restore_unacked()
    assert decide(Outcome.CHANNEL_CLOSED) is Action.REQUEUE
    assert restored == ["t1", "t2"] and qos._delivered == {}


def test_what_a_redis_channel_holds_as_it_closes_without_its_connection_is_left_to_its_lease():
    """The close of a channel whose connection is already gone: each delivery it holds
    is reported `ConnectionLost`, and the door ends it `connection lost` (let lapse)."""
    from diffq.core.brokers.redis import ConsumerChannel

    settled: list[str] = []
    qos = SimpleNamespace(append=None, ack=None, reject=None, restore_unacked=None,
                          _delivered={"t1": object(), "t2": object()}, _quick_ack=settled.append)
    channel = SimpleNamespace(qos=qos, _brpop_start=None, connection=None)
    installed = ConsumerChannel(channel, closed=door.channel_closed)
    installed.restore_unacked()
    assert settled == ["t1", "t2"] and installed.left_held == 2 and qos._delivered == {}


def test_a_peeked_dead_letter_goes_back_through_the_table():
    message = StubMessage()
    door.peeked(message)
    assert message.calls == ["requeue"] and decide(Outcome.PEEKED) is Action.REQUEUE


def test_a_batch_lost_with_its_embedded_worker_is_published_again_through_the_table():
    published: list[int] = []
    door.end(Outcome.LOST_WITH_WORKER, door.Republished(lambda: published.append(1)))
    assert published == [1] and decide(Outcome.LOST_WITH_WORKER) is Action.REQUEUE


def test_celerys_own_reject_on_failure_is_a_row(monkeypatch):
    from celery.worker.request import Request

    from diffq.worker.delivery.celery_adapter import BatchRequest

    calls: list[bool] = []
    monkeypatch.setattr(Request, "reject", lambda self, requeue=False: calls.append(requeue))
    request = BatchRequest.__new__(BatchRequest)
    request.failing = True  # Celery's failure handler, dropping it (a Reject, or acks_on_failure off)
    request.reject(requeue=False)
    assert calls == [False] and decide(Outcome.ENGINE_REJECTED) is Action.REJECT
