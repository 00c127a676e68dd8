"""The loopback servers of diffq/testing/servers.py as pytest fixtures: a pytest
plugin module (conftest: ``pytest_plugins = ["tests.servers"]``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from diffq.testing.servers import GCSServer, RabbitMQServer, RedisServer, S3Server, make_tls_files, unique_bucket_name


@contextlib.contextmanager
def _session_env(**values: str | None) -> Iterator[None]:
    """Set (or, for None, unset) os.environ entries, so child processes inherit them."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in values.items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[str]:
    """redis://127.0.0.1:PORT/0 of a private, non-persistent redis-server."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def make_redis_server(tmp_path_factory):
    """Factory: make_redis_server(appendonly=True) -> a started RedisServer, stopped after the test."""
    servers: list[RedisServer] = []

    def make(*, appendonly: bool = False, password: str | None = None, tls: bool = False) -> RedisServer:
        workdir = tmp_path_factory.mktemp("redis")
        tls_files = make_tls_files(workdir / "tls") if tls else None
        server = RedisServer(workdir, appendonly=appendonly, password=password, tls=tls_files)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """A moto S3 server; for the session the standard AWS_* variables point at it."""
    workdir = tmp_path_factory.mktemp("moto")
    with S3Server(workdir) as server, _session_env(
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        # Keep a developer's own AWS setup out: a per-service endpoint would win
        # over AWS_ENDPOINT_URL, and profiles could bring credentials or settings.
        AWS_ENDPOINT_URL_S3=None,
        AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=None,
        AWS_PROFILE=None,
        AWS_SESSION_TOKEN=None,
        AWS_CONFIG_FILE=str(workdir / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(workdir / "no-aws-credentials"),
    ):
        yield server


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory) -> Iterator[GCSServer]:
    """A fake-gcs-server; for the session STORAGE_EMULATOR_HOST points at it."""
    with GCSServer(tmp_path_factory.mktemp("fake-gcs")) as server, _session_env(
        STORAGE_EMULATOR_HOST=server.endpoint
    ):
        yield server


@pytest.fixture(scope="session")
def rabbitmq_server(tmp_path_factory) -> Iterator[RabbitMQServer]:
    """A private RabbitMQ node with its management API: `.amqp_url`, `.api_url`."""
    with RabbitMQServer(tmp_path_factory.mktemp("rabbitmq")) as server:
        yield server


@pytest.fixture
def rabbitmq_vhost(rabbitmq_server) -> Iterator[str]:
    """amqp://guest:guest@127.0.0.1:PORT/<fresh vhost> on the private node, deleted after."""
    url = rabbitmq_server.make_vhost()
    yield url
    rabbitmq_server.api("DELETE", "vhosts/" + url.rsplit("/", 1)[1])


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """s3://<fresh bucket>/outputs/run-1"""
    return f"s3://{s3_server.make_bucket(unique_bucket_name())}/outputs/run-1"


@pytest.fixture
def gcs_bucket(gcs_server) -> str:
    """gs://<fresh bucket>/outputs/run-1"""
    return f"gs://{gcs_server.make_bucket(unique_bucket_name())}/outputs/run-1"
