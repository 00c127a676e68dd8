"""Nothing waits on a timeout: leases, a lost host, processes that die with their
parent, and the drain on SIGTERM. Real `diffq worker` processes on a private Redis,
on DEFAULT timeouts (a test may shorten the lease renewal period, never the
visibility timeout)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from diffq.core.settings import Settings
from diffq.producer.submit import submit
from diffq.results.status import status
from tests.helpers import assert_run_complete

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

LEASE = Settings().visibility_timeout  # the default: a test never shortens it


def write_prompts(path, n, **row):
    path.write_text("".join(json.dumps({"id": f"i{i:04d}", "prompt": f"prompt {i}", **row}) + "\n"
                            for i in range(n)))
    return path


class WorkerCLI:
    """`diffq worker` in its own process group (so a test can kill the whole tree), writing
    only under the test's folder (its runs' prefix: a network broker's worker needs one)."""

    def __init__(self, tmp_path, broker: str, queues, model: str, *args: str, env: dict | None = None):
        self.log = open(tmp_path / f"worker-{time.monotonic_ns()}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diffq", "worker", "--broker", broker, "--queues", ",".join(queues),
             "--model", model, "--out-prefix", str(tmp_path), "--loglevel", "ERROR", *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})})

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for pid in live_group(self.pgid):
            os.kill(pid, signal.SIGKILL)
        self.log.close()


def live_group(pgid: int) -> list[int]:
    """Processes of a process group that are still running (zombies count as gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def held(client: redis.Redis) -> int:
    """Deliveries kombu holds unacked (the `unacked` hash, kombu/transport/redis.py)."""
    return client.hlen("unacked")


# Enough that batches are still in hand well after the first 16 images: a worker
# takes a second batch while its calls are short (run-ahead), and the tiny pipeline's
# are ~0.1 s, so 40 prompts could all be done or held before a kill lands.
PROMPTS = 400


def started_run(tmp_path, server, tiny_model):
    """PROMPTS prompts submitted and a 2-process `diffq worker` on them, 16 images in."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=4, steps=4)
    first = WorkerCLI(tmp_path, server.url, result.queues, tiny_model, "--workers", "2")
    try:
        wait_for(lambda: status(out).done >= 16, 180, "16 images")
    except BaseException:
        first.stop()
        raise
    return prompts, out, result, first


def test_whole_host_loss_finishes_exactly_once_about_a_lease_after_the_new_worker(
        tmp_path, make_redis_server, tiny_model):
    server = make_redis_server()
    client = redis.Redis.from_url(server.url)
    prompts, out, result, first = started_run(tmp_path, server, tiny_model)
    try:
        assert len(live_group(first.pgid)) >= 5  # supervisor, 2 workers, their sink helpers
        killed = time.time()
        os.killpg(first.pgid, signal.SIGKILL)  # a spot reclaim: every process at once
        wait_for(lambda: not live_group(first.pgid), 10, "the whole tree to die")
        lost = client.hkeys("unacked")
        assert lost, "the kill should have caught batches in hand"
    finally:
        first.stop()
    started = time.monotonic()
    second = WorkerCLI(tmp_path, server.url, result.queues, tiny_model, "--workers", "2")

    def returned() -> bool:
        # Put back by a sweep (and maybe fetched again: a new delivery time) or done.
        scores = [client.zscore("unacked_index", tag) for tag in lost]
        return all(score is None or score > killed for score in scores)

    try:
        wait_for(returned, LEASE + 60, "the lost batches to return")
        returned_s = time.time() - killed
        wait_for(lambda: status(out).done >= PROMPTS, 240, "the run to finish")
        finished_s = time.monotonic() - started
    finally:
        second.stop()
    assert second.proc.returncode == 0
    st = status(out)
    assert (st.done, st.failed) == (PROMPTS, 0)
    assert_run_complete(out, prompts, steps=4, model=tiny_model)  # every item exactly once
    assert held(client) == 0
    # The held batches came back one lease (+ a 5 s sweep) after their last renewal,
    # on default settings; the new worker's start-up and the rest of the run on top.
    assert returned_s < LEASE + 30, returned_s  # the last renewal was up to a period before the kill
    assert finished_s < LEASE + 60, finished_s
    print(f"\nwhole-host loss: {len(lost)} held batches back {returned_s:.1f} s after the kill; "
          f"run finished {finished_s:.1f} s after the new worker started")


def test_kill_9_of_diffq_worker_leaves_no_process_and_hands_back_at_once(tmp_path, make_redis_server, tiny_model):
    server = make_redis_server()
    client = redis.Redis.from_url(server.url)
    prompts, out, result, first = started_run(tmp_path, server, tiny_model)
    try:
        wait_for(lambda: held(client) >= 1, 30, "a batch in hand")
        killed = time.monotonic()
        os.kill(first.proc.pid, signal.SIGKILL)  # the supervisor only
        wait_for(lambda: not live_group(first.pgid), 30, "its workers and sink helpers to end")
        gone_s = time.monotonic() - killed
        # What they held went back to the queue as they ended: no lease to wait out.
        assert held(client) == 0
    finally:
        first.stop()
    started = time.monotonic()
    second = WorkerCLI(tmp_path, server.url, result.queues, tiny_model, "--workers", "2")
    try:
        wait_for(lambda: status(out).done >= PROMPTS, 180, "the run to finish")
        finished_s = time.monotonic() - started
    finally:
        second.stop()
    st = status(out)
    assert (st.done, st.failed) == (PROMPTS, 0)
    assert_run_complete(out, prompts, steps=4, model=tiny_model)
    assert finished_s < LEASE, finished_s
    print(f"\nkill -9 of the supervisor: its tree ended {gone_s:.1f} s later; the run finished "
          f"{finished_s:.1f} s after a new worker started")


def test_kill_9_of_diffq_run_leaves_no_process(tmp_path, tiny_model):
    prompts = write_prompts(tmp_path / "p.jsonl", 400)
    out = tmp_path / "run"
    log = open(tmp_path / "run.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "diffq", "run", str(prompts), "--out", str(out),
                             "--model", tiny_model, "--workers", "2", "--steps", "4", "--no-progress"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (out / "records").is_dir() and any((out / "records").iterdir()), 180, "a first batch")
        assert len(live_group(proc.pid)) >= 3
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: not live_group(proc.pid), 30, "its workers and sink helpers to end")
    finally:
        for pid in live_group(proc.pid):
            os.kill(pid, signal.SIGKILL)
        log.close()


def slow_batch(tmp_path, server, tiny_model):
    """One item whose generation takes tens of seconds: many steps on a large shape."""
    prompts = write_prompts(tmp_path / "p.jsonl", 1, height=512, width=512)
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=1, steps=150,
                    height=512, width=512)
    return prompts, out, next(iter(result.queues))


def test_drain_hands_back_past_the_timeout_and_finishes_within_it(tmp_path, make_redis_server, tiny_model):
    server = make_redis_server()
    client = redis.Redis.from_url(server.url)
    prompts, out, queue = slow_batch(tmp_path, server, tiny_model)

    # Branch 1: the batch cannot finish within --drain-timeout: handed back at once.
    # The batch takes far longer than the timeout whatever the machine's speed (a
    # fault hold before generating, as a long first compile would).
    short = WorkerCLI(tmp_path, server.url, [queue], tiny_model, "--drain-timeout", "1",
                      env={"DIFFQ_FAULT_HOLD": ":600"})
    try:
        wait_for(lambda: held(client) == 1 and client.llen(queue) == 0, 120, "the batch in hand")
        signalled = time.monotonic()
        short.proc.send_signal(signal.SIGTERM)
        assert short.proc.wait(timeout=30) == 0
        exit_s = time.monotonic() - signalled
        wait_for(lambda: not live_group(short.pgid), 10, "the sink helper to end with its worker")
    finally:
        short.stop()
    assert (client.llen(queue), held(client)) == (1, 0)  # back in its queue, not waiting on a lease
    envelope = json.loads(client.lindex(queue, 0))
    assert envelope["headers"]["retries"] == 0  # not counted as a failed attempt
    assert envelope["properties"]["delivery_info"]["redelivered"] is True
    assert status(out).done == 0

    # Branch 2: it can: it finishes and is stored, then the process exits 0.
    long = WorkerCLI(tmp_path, server.url, [queue], tiny_model, "--drain-timeout", "300")
    try:
        wait_for(lambda: held(client) == 1 and client.llen(queue) == 0, 120, "the batch in hand again")
        time.sleep(1.0)
        long.proc.send_signal(signal.SIGTERM)
        assert long.proc.wait(timeout=300) == 0
    finally:
        long.stop()
    st = status(out)
    assert (st.done, st.failed) == (1, 0)
    assert (client.llen(queue), held(client)) == (0, 0)
    assert_run_complete(out, prompts, steps=150, model=tiny_model)  # done once, by the second worker
    print(f"\ndrain: handed back and exited {exit_s:.1f} s after SIGTERM (--drain-timeout 1)")


def test_a_batch_held_past_the_visibility_timeout_is_never_started_twice(tmp_path, make_redis_server, tiny_model):
    """A first compile longer than the visibility timeout: the holder renews its lease,
    and an idle second worker (whose loop sweeps for lapsed leases) never gets it."""
    server = make_redis_server()
    client = redis.Redis.from_url(server.url)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "slow", "prompt": "HOLD me"}) + "\n")
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=1, steps=2)
    env = {"DIFFQ_FAULT_HOLD": f"HOLD:{LEASE + 20}", "DIFFQ_LEASE_RENEW_S": "5"}
    workers = WorkerCLI(tmp_path, server.url, result.queues, tiny_model, "--workers", "2", env=env)
    try:
        wait_for(lambda: held(client) == 1, 120, "the batch in hand")
        fetched = time.monotonic()
        queue = next(iter(result.queues))
        scores, redelivered = set(), False
        while status(out).done < 1:
            # A lapsed lease puts the batch back (flagged redelivered) for the idle worker.
            redelivered |= client.llen(queue) > 0
            for raw in client.hvals("unacked"):
                redelivered |= bool(json.loads(raw)[0]["headers"].get("redelivered"))
            scores |= {score for _, score in client.zrange("unacked_index", 0, -1, withscores=True)}
            assert time.monotonic() - fetched < LEASE + 120, "the batch never finished"
            time.sleep(0.5)
        held_s = time.monotonic() - fetched
    finally:
        workers.stop()
    assert held_s > LEASE + 10  # held well past the visibility timeout
    assert not redelivered
    assert len(scores) >= 3  # its lease was renewed along the way
    assert_run_complete(out, prompts, steps=2, model=tiny_model)
