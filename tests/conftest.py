import os

import pytest
from filelock import FileLock

# Real servers on loopback (redis-server, moto, fake-gcs-server, a RabbitMQ node): diffq/testing/servers.py, as fixtures by tests/servers.py.
pytest_plugins = ["tests.servers"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory):
    """Every tiny family, built once per run, offline.

    Under pytest-xdist the workers share one read-only copy (built by the first worker
    to ask, under a file lock, in the run's common temporary folder): the tests only
    load these folders, and each worker building its own cost as much as ten tests.
    """
    from diffq.app.tiny import FAMILIES, build_tiny_pipeline

    if "PYTEST_XDIST_WORKER" not in os.environ:
        root = tmp_path_factory.mktemp("tiny")
        return {family: str(build_tiny_pipeline(root / family, family=family)) for family in FAMILIES}
    root = tmp_path_factory.getbasetemp().parent / "tiny"
    with FileLock(str(root) + ".lock"):
        if not (root / "built").exists():
            for family in FAMILIES:
                build_tiny_pipeline(root / family, family=family)
            (root / "built").touch()
    return {family: str(root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_model(tiny_pipelines):
    return tiny_pipelines["flux2-klein"]
