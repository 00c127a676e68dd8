"""The loopback-server helpers themselves: `diffq.testing.servers` (bench uses them
too; their fixtures are the `tests.servers` plugin), and a missing server fails its
tests under CI=true instead of skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(folder: Path, **env: str) -> subprocess.CompletedProcess:
    """A tiny suite that needs redis-server, run with a PATH that has none."""
    (folder / "pytest.ini").write_text("[pytest]\naddopts = -p tests.servers -p no:cacheprovider\n")
    (folder / "test_needs_redis.py").write_text("def test_needs_redis(redis_server):\n    assert redis_server\n")
    (folder / "empty-bin").mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    environ |= {"PATH": str(folder / "empty-bin"), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", str(folder)], cwd=folder, env=environ,
                          capture_output=True, text=True, timeout=120)


def test_a_missing_server_skips_locally_and_fails_under_ci(tmp_path):
    local = run_pytest(tmp_path)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout + local.stderr
    assert "redis-server is not installed" in local.stdout
    ci = run_pytest(tmp_path, CI="true")
    assert ci.returncode == 1 and "1 error" in ci.stdout, ci.stdout + ci.stderr
    assert "CI=true: a test server missing in CI is a failure" in ci.stdout


def test_bench_imports_the_servers_without_path_edits():
    """bench runs as `python -m bench` from the root and takes its servers from diffq.testing."""
    code = ("import sys; before = list(sys.path); import bench, bench.routing; "
            "from diffq.testing.servers import RedisServer; "
            "assert sys.path == before, set(sys.path) ^ set(before); "
            "assert bench.redis_server.__wrapped__ and RedisServer.name == 'redis'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
