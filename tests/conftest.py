import os

import pytest

# Real servers on loopback (redis-server, moto, fake-gcs-server, a RabbitMQ node): diffq/testing/servers.py, as fixtures by tests/servers.py.
pytest_plugins = ["tests.servers"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory):
    """Both tiny families, built once per session, offline."""
    from diffq.app.tiny import FAMILIES, build_tiny_pipeline

    root = tmp_path_factory.mktemp("tiny")
    return {family: str(build_tiny_pipeline(root / family, family=family)) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_model(tiny_pipelines):
    return tiny_pipelines["flux2-klein"]
