"""`DIFFQ_*` settings (pydantic-settings): environment first, CLI options override."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DIFFQ_", extra="ignore")

    broker_url: str | None = None
    # RabbitMQ's management API (http://USER:PASS@HOST:15672), where workers without
    # --queues list an AMQP broker's queues; --rabbitmq-api overrides it.
    rabbitmq_api: str | None = None
    # kombu transport options a broker URL cannot carry (JSON): Sentinel's
    # `master_name`, `ssl`; `fleet manifests --broker-option` renders them for pods.
    broker_transport_options: dict = Field(default_factory=dict)
    # The lease on a held batch: a broker hands a batch back once its holder has not
    # renewed it for this long (Redis's visibility timeout, SQS's message visibility).
    # Live holders renew every `lease_renew_s`, so a batch that compiles for an hour
    # is never started twice, and one whose holder died is back within about a minute.
    visibility_timeout: int = Field(default=60, gt=0)
    lease_renew_s: float = Field(default=15.0, gt=0)
    # The outer bound: a batch held longer than this (a hung holder that still
    # renews) stops being renewed; also RabbitMQ's per-consumer ack timeout.
    max_hold_s: int = Field(default=4 * 3600, gt=0)
    # A worker only writes into run folders under these prefixes (empty = any, said
    # loudly at start on a network broker; `worker --run OUT` narrows it to that run).
    allowed_out_prefixes: list[str] = Field(default_factory=list)
    # The models a worker may load besides those it is told (--model, --models, a
    # --run manifest's); a batch naming another is refused unread (worker/delivery/admission.py).
    allowed_models: list[str] = Field(default_factory=list)
    # The LoRA adapters a run may name and a worker may load: prefixes (s3://bucket/loras,
    # /data/loras, a Hub org), not names, as a run's adapters are many. Their own list, not
    # DIFFQ_ALLOWED_MODELS: an adapter is weights only, often from another place than the
    # base models. Empty: any adapter (said at a network worker's start).
    allowed_adapters: list[str] = Field(default_factory=list)
    # Where `submit` registers a run whose plan is not all in the broker, and the
    # fleet's feeder (`diffq fleet backlog --feeds`) finds the runs it feeds: a
    # folder (local, s3://, gs://) holding one small file per such run.
    feeds: str | None = None
    # HMAC keys batches are signed with where diffq publishes and checked with by
    # workers (worker/delivery/admission.py): with a key set, an unsigned or wrongly signed batch
    # is dead-lettered. `signing_key_previous` is still accepted, so keys rotate
    # without a stop: add the new key as current, the old as previous, then drop it.
    signing_key: SecretStr | None = None
    signing_key_previous: SecretStr | None = None
    # Where a worker's sink also notes that storing keeps failing, beside the run
    # folder (which may be what is failing): `diffq run` sets it to its broker folder
    # and shows the notes on its progress bar (core/progress.py TroubleNote).
    trouble_dir: str | None = None
    compile_cache: str | None = None
    metrics_port: int | None = None
    # The address a worker process's /metrics listens on: every interface by default
    # (Prometheus scrapes the pod's IP); 127.0.0.1 keeps it on the host.
    metrics_addr: str = "0.0.0.0"
    log_json: bool = False
    task_max_retries: int = Field(default=3, ge=0)
    # Celery retry countdown: base * 2**attempt seconds, capped at 30 s.
    retry_backoff_s: float = Field(default=2.0, ge=0)
    # Run-ahead: while a worker's device calls take less than this, it holds a second
    # batch, received and prepared while the call runs (worker/delivery/batches.py). Longer
    # calls: one batch in hand, none waiting that another device could take. 0: never.
    run_ahead_s: float = Field(default=2.0, ge=0)
    # Celery task events for Flower / `celery events`; unset: the transport's own
    # default (core/transports.py: on, except where no monitor can attach).
    task_events: bool | None = None
    # Where a worker encodes and stores images: a helper process (the generating
    # process keeps the GIL; worker/sink/helper.py) or threads beside generation.
    sink: Literal["process", "thread"] = "process"
    # Threads that encode and upload one batch's images side by side (the encoders
    # and storage clients release the GIL): the cores a worker's sink may use. Raise
    # it where a worker has more spare cores and the sink is the limit (docs/BENCHMARKS.md).
    sink_threads: int = Field(default=4, ge=1)
    # CPUs the sink runs on ('8-11', '2,3'; Linux), unset: wherever the scheduler puts
    # it. Keeps encoding off the cores that drive the devices on a busy host.
    sink_cpus: str | None = None
    # Models in object storage (`--model s3://bucket/prefix`, `gs://...`) are fetched
    # into this node-local folder and loaded from there (worker/device/model_fetch.py): one
    # entry per model URL and revision. Pods mount a node-local volume here (docs/fleet.md).
    model_cache: str = Field(default_factory=lambda: _user_cache("models"))
    # The cache's size cap: least recently used entries not in use by any process are
    # evicted to fit a new one. Unset: no cap (the volume's own limit).
    model_cache_max_gb: float | None = Field(default=None, gt=0)
    # Streams of one model fetch at most (ranged GETs side by side, threads): each file,
    # and each piece of a big file, is one.
    model_fetch_threads: int = Field(default=16, ge=1)
    # How long a model fetch waits out a store that moves no byte (connections dropped
    # or refused, timeouts, 5xx, S3 SlowDown, GCS 429) before the worker gives up, in
    # seconds. Ten minutes: a node lives hours and a failed start costs a pod restart
    # and a fetch from scratch elsewhere; store incidents and throttling mostly pass
    # within minutes (docs/fleet.md, "When the network drops").
    model_fetch_patience_s: float = Field(default=600.0, gt=0)
    # The model bucket's own credentials, where they differ from the run folders':
    # an S3 endpoint URL and a named AWS profile (from AWS_SHARED_CREDENTIALS_FILE, a
    # mounted Secret), or a GCS service-account JSON file. Unset: the standard chain.
    model_store_endpoint: str | None = None
    model_store_profile: str | None = None
    model_store_credentials: str | None = None


def _user_cache(name: str) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "diffq", name)


def get_settings() -> Settings:
    return Settings()
