"""The transport table: what diffq needs to know about each kind of broker, as data.

One row per broker kind, beside the backend table (worker/device/backends.py): the
facts (event loop, loss on SIGKILL, how queues are found, monitoring, KEDA's scaler,
the Secret keys pods read, where dead letters end) and a pointer to the broker's
object (diffq/core/brokers/: one class per broker, which does everything diffq does
beyond kombu's public API: leases, hand-back, arrivals, dead letters, the fast
publisher, depths, the consumer channel's fixes). Every place that used to branch on
the broker URL (the Celery app, the publisher, the queue report, compile-aware
routing, the held acks, the embedded runner, the lease keeper) looks its answer up
here instead. Adding a broker is one class in diffq/core/brokers/ and its row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diffq.core.brokers.base import Broker
from diffq.core.brokers.embedded import EmbeddedBroker, MemoryBroker
from diffq.core.brokers.rabbitmq import DEAD_LETTER_POLICY, NEEDS_RABBITMQ_API, RabbitMQBroker
from diffq.core.brokers.redis import RedisBroker
from diffq.core.brokers.sqs import SQS_MAX_RECEIVES, SQSBroker, sqs_entity_name


# --- KEDA: how a fleet scales on this broker's queues ---------------------------------
# Scaler types, metadata and TriggerAuthentication parameters as KEDA's scalers parse
# them (the `keda:"name=…, order=…"` field tags), read at KEDA_SOURCE: pkg/scalers/
# redis_scaler.go (redisMetadata, redisConnectionInfo), rabbitmq_scaler.go
# (rabbitMQMetadata), aws_sqs_queue_scaler.go, metrics_api_scaler.go; the trigger
# types from pkg/scaling/scalers_builder.go. tests/data/keda/ keeps those structs and
# tests/test_keda_scalers.py checks every rendered name against them. Every value is a
# string, as the CRD requires.
KEDA_SOURCE = "kedacore/keda@8b4f083ca8c8c2baf8477e322bd4d16ac4dfa09a"
# Schemes whose broker speaks TLS. KEDA's redis scalers dial in plain text unless
# `enableTLS` says otherwise (redis_scaler.go SetEnableTLS, defaultEnableTLS false):
# a rediss:// pool left without it never scales from zero. AMQP: amqp091-go turns
# TLS on for an amqps:// host by itself (rabbitmq/amqp091-go connection.go DialConfig).
KEDA_TLS_SCHEMES = frozenset({"rediss", "amqps"})
# The scheme of the `host` KEDA dials for a RabbitMQ broker: amqp091-go's ParseURI
# takes amqp:// and amqps:// only (uri.go errURIScheme), and rabbitmq_scaler.go's
# Validate maps only those to the AMQP protocol; kombu's pyamqp:// is plain AMQP.
KEDA_AMQP_SCHEMES = {"amqp": "amqp", "pyamqp": "amqp", "amqps": "amqps"}


@dataclass(frozen=True)
class KedaFacts:
    """What a rendered trigger needs besides the queue: the fleet's own settings and
    what its broker URL and transport options say (`keda_facts`)."""

    per_replica: int  # queued batches per replica before KEDA adds one
    redis_db: int = 0
    aws_region: str = "us-east-1"  # kombu's SQS default region too
    tls: bool = False  # the broker speaks TLS
    sentinel_master: str | None = None  # kombu's `master_name` transport option
    # The AMQP URL KEDA dials: the scheme KEDA parses, host, port and vhost, no
    # credentials (those come from the Secret through the TriggerAuthentication).
    amqp_host: str | None = None


def _redis_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # The Celery queue is one Redis list of exactly this name (priority_steps [0]).
    metadata = {"listName": queue, "listLength": str(facts.per_replica), "activationListLength": "0",
                "databaseIndex": str(facts.redis_db)}
    if facts.tls:
        metadata["enableTLS"] = "true"
    return metadata


def _redis_sentinel_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # `address` (the TriggerAuthentication's) lists the sentinels; they name the master.
    if not facts.sentinel_master:
        raise ValueError("a sentinel:// broker needs kombu's master_name transport option "
                         "(the master the sentinels name): pass --broker-option master_name=NAME")
    return {**_redis_trigger(queue, facts), "sentinelMaster": facts.sentinel_master}


def _sqs_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # Visible + in flight (scaleOnInFlight): a pool does not scale in under its batches.
    return {"queueURL": sqs_entity_name(queue), "queueLength": str(facts.per_replica),
            "activationQueueLength": "0", "awsRegion": facts.aws_region, "scaleOnInFlight": "true"}


def _rabbitmq_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # AMQP protocol: the ready messages of the queue (a passive declare), like LLEN.
    if not facts.amqp_host:
        raise ValueError("an AMQP fleet's --broker names its host (amqp://HOST:5672/VHOST): KEDA dials it")
    return {"protocol": "amqp", "host": facts.amqp_host, "queueName": queue, "mode": "QueueLength",
            "value": str(facts.per_replica), "activationValue": "0"}


@dataclass(frozen=True)
class KedaScaler:
    """KEDA's scaler for one queue of this broker and the credentials it reads."""

    type: str  # the trigger type (pkg/scaling/scalers_builder.go)
    metadata: Callable[[str, KedaFacts], dict[str, str]]
    # TriggerAuthentication secretTargetRef: (scaler parameter, key of the broker Secret).
    auth: tuple[tuple[str, str], ...]
    source: str = ""  # the scaler's file under KEDA_SOURCE


_REDIS_AUTH = (("address", "redis-address"), ("password", "redis-password"))
REDIS_SCALER = KedaScaler("redis", _redis_trigger, auth=_REDIS_AUTH, source="pkg/scalers/redis_scaler.go")
# `address` here is the sentinels' host:port list (comma-separated); `password` the
# master's, as kombu sends it (no sentinelPassword: kombu's sentinel_kwargs carry none).
REDIS_SENTINEL_SCALER = KedaScaler("redis-sentinel", _redis_sentinel_trigger, auth=_REDIS_AUTH,
                                   source="pkg/scalers/redis_scaler.go")
SQS_SCALER = KedaScaler("aws-sqs-queue", _sqs_trigger,
                        auth=(("awsAccessKeyID", "aws-access-key-id"), ("awsSecretAccessKey", "aws-secret-access-key")),
                        source="pkg/scalers/aws_sqs_queue_scaler.go")
# `host` is rendered (KedaFacts.amqp_host); KEDA puts these credentials into it.
RABBITMQ_SCALER = KedaScaler("rabbitmq", _rabbitmq_trigger,
                             auth=(("username", "rabbitmq-username"), ("password", "rabbitmq-password")),
                             source="pkg/scalers/rabbitmq_scaler.go")


def _scheme(broker_url: str) -> str:
    return broker_url.split("://", 1)[0].split("+", 1)[0].lower()


def keda_scaler(broker_url: str) -> KedaScaler | None:
    """KEDA's scaler for this broker URL's scheme; None: no fleet runs on it."""
    keda = transport_for(broker_url).keda
    return dict(keda).get(_scheme(broker_url)) if keda else None


def keda_facts(broker_url: str, transport_options: dict | None = None, *, per_replica: int, redis_db: int = 0,
               aws_region: str = "us-east-1") -> KedaFacts:
    """The facts a trigger reads from the broker: TLS (a TLS scheme, or kombu's `ssl`
    option), the sentinels' master (kombu's `master_name`), the AMQP host KEDA dials."""
    from urllib.parse import quote, unquote, urlsplit

    options = transport_options or {}
    scheme = _scheme(broker_url)
    tls = scheme in KEDA_TLS_SCHEMES or bool(options.get("ssl"))
    amqp_host = None
    if scheme in KEDA_AMQP_SCHEMES:
        url = urlsplit(broker_url)
        if url.hostname:
            host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
            port = f":{url.port}" if url.port else ""
            # kombu's vhost: the path after its first '/', '/' where there is none.
            vhost = unquote(url.path[1:]) or "/"
            amqp_host = f"{'amqps' if tls else KEDA_AMQP_SCHEMES[scheme]}://{host}{port}/{quote(vhost, safe='')}"
    return KedaFacts(per_replica=per_replica, redis_db=redis_db, aws_region=aws_region, tls=tls,
                     sentinel_master=options.get("master_name"), amqp_host=amqp_host)




@dataclass(frozen=True)
class Transport:
    name: str
    schemes: tuple[str, ...]
    # The broker's object (diffq/core/brokers/): what diffq does on it beyond kombu's API.
    broker: Broker
    # Celery drives the consumer from an event loop (hub): timers run while idle
    # (held-ack settling, routing, Redis's restore sweep), and the consumer can
    # switch queues at run time. Without one (synloop) there are no timers.
    event_loop: bool
    # A task in flight when its worker is SIGKILLed never comes back by itself.
    loses_inflight_on_kill: bool
    # Why listing queues needs an API URL, where it does (refused before anything starts).
    list_needs_api: str | None = None
    # The longest queue name the broker takes, where it has a limit (checked at submit,
    # before anything is written or enqueued).
    max_queue_name: int | None = None
    discovery: str = "none: name the queues (--queues or --run)"  # how workers find queues, in words
    # Celery's monitoring channels: task events (Flower, `celery events`: three
    # publishes per batch) and remote control (`celery inspect`, `diffq queues`' live
    # consumers: its pidbox queue is polled every cycle), both on the worker's main
    # thread between two device calls. Off where no monitor can attach (the embedded
    # run's folder, the in-process memory broker); DIFFQ_TASK_EVENTS overrides events.
    monitored: bool = True
    # KEDA's scaler per URL scheme of this broker; None: no fleet runs on it (embedded, memory).
    keda: tuple[tuple[str, KedaScaler], ...] | None = None
    # Env a worker pod (and the backlog service) reads from the broker Secret, besides
    # DIFFQ_BROKER_URL: (variable, Secret key). AMQP lists queues only over its HTTP API.
    secret_env: tuple[tuple[str, str], ...] = ()
    # Where refused messages end, in words (the docs and `diffq queues`).
    dead_letters: str = "the diffq.dead queue: the worker's JSON letters"


TRANSPORTS = (
    Transport("redis", ("redis", "rediss", "sentinel"), RedisBroker(), event_loop=True, loses_inflight_on_kill=False,
              discovery="SCAN for diffq.* lists (queues holding work)",
              dead_letters="the diffq.dead list: the worker's JSON letters (Redis has no mechanism)",
              keda=(("redis", REDIS_SCALER), ("rediss", REDIS_SCALER), ("sentinel", REDIS_SENTINEL_SCALER))),
    # The connection is the lease: the broker redelivers when it closes.
    Transport("amqp", ("amqp", "amqps", "pyamqp"), RabbitMQBroker(), event_loop=True, loses_inflight_on_kill=False,
              list_needs_api=NEEDS_RABBITMQ_API,
              discovery="management API only (--rabbitmq-api URL); AMQP itself cannot list queues",
              keda=(("amqp", RABBITMQ_SCALER), ("amqps", RABBITMQ_SCALER), ("pyamqp", RABBITMQ_SCALER)),
              secret_env=(("DIFFQ_RABBITMQ_API", "rabbitmq-api"),),
              dead_letters=f"policy {DEAD_LETTER_POLICY}: rejects routed to exchange and queue diffq.dead "
                           "(needs --rabbitmq-api; without it the worker's JSON letters, same queue)"),
    # SQS queue names: at most 80 characters (the CreateQueue API's QueueName; kombu's SQS
    # transport only swaps '.' for '-', kombu/transport/SQS/__init__.py `entity_name`).
    Transport("sqs", ("sqs",), SQSBroker(), event_loop=True, loses_inflight_on_kill=False, max_queue_name=80,
              discovery="ListQueues by name prefix", keda=(("sqs", SQS_SCALER),),
              secret_env=(("AWS_ACCESS_KEY_ID", "aws-access-key-id"), ("AWS_SECRET_ACCESS_KEY", "aws-secret-access-key")),
              dead_letters=f"queue diffq-dead: redrive policy target (maxReceiveCount {SQS_MAX_RECEIVES}) "
                           "and the worker's JSON letters"),
    # No lease: the embedded runner re-enqueues from the run folder.
    Transport("embedded", ("filesystem",), EmbeddedBroker(), event_loop=False, loses_inflight_on_kill=True,
              monitored=False),
    # kombu's in-process transport: only for plans and tests that start nothing.
    Transport("memory", ("memory",), MemoryBroker(), event_loop=False, loses_inflight_on_kill=True, monitored=False),
)
_BY_SCHEME = {scheme: row for row in TRANSPORTS for scheme in row.schemes}


class UnknownTransport(ValueError):
    pass


def transport_for(broker_url: str) -> Transport:
    scheme = _scheme(broker_url)
    try:
        return _BY_SCHEME[scheme]
    except KeyError:
        raise UnknownTransport(f"broker URL scheme '{scheme}://' is not one diffq supports "
                               f"({', '.join(sorted(_BY_SCHEME))})") from None
