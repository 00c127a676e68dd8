import os

import pytest
from filelock import FileLock

# Real servers on loopback (redis-server, moto, fake-gcs-server, a RabbitMQ node): diffq/testing/servers.py, as fixtures by tests/servers.py.
pytest_plugins = ["tests.servers"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A pytest-xdist worker starts with COLUMNS=80 in its environment (a plain pytest run has
# none): rich's consoles, made at import (diffq/app/options.py), would keep 80 for good and a
# CliRunner's env={"COLUMNS": ...} would change nothing. Without it they read the variable
# when they print, as on a terminal.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.pop("COLUMNS", None)


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


def pytest_collection_modifyitems(config, items):
    """Longest test files first (tests/durations.json, measured), each file's tests in
    their own order: `make test` deals whole files to its workers in collection order
    (--dist loadfile --no-loadscope-reorder), so a long file dealt last no longer runs
    alone at the end. A file not in the table counts as a median one."""
    import json
    from pathlib import Path

    table = json.loads((Path(__file__).parent / "durations.json").read_text())
    median = sorted(table.values())[len(table) // 2] if table else 0.0
    root = Path(config.rootpath)

    def weight(item):
        path = Path(str(item.path)).relative_to(root).as_posix()
        return (-table.get(path, median), path)

    items.sort(key=weight)  # stable: a file's tests keep their order
