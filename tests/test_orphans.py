"""The fleet supervisor is PID 1 of a worker container: when a worker is killed, its
sink helper (and any Inductor compile worker) is orphaned and adopted by the
supervisor, which must reap it, while its own workers' exit codes stay for
multiprocessing to read. Run in a separate interpreter: a subreaper is per process."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import os, subprocess, sys, time
from diffq.worker.process.supervisor import become_subreaper, reap_orphans

def state(pid):
    try:
        fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    except FileNotFoundError:
        return None, None
    return fields[0], int(fields[1])  # state, parent pid

def until(condition):
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)

assert become_subreaper()
# A worker that starts a helper and dies: the helper is adopted by us.
worker = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
    " stdin=subprocess.PIPE).pid, flush=True)"], stdout=subprocess.PIPE, text=True)
helper = int(worker.stdout.readline())
assert worker.wait() == 0
until(lambda: state(helper)[1] == os.getpid())  # adopted (its stdin closed with the worker: it exits)
until(lambda: state(helper)[0] == "Z")
own = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
until(lambda: state(own.pid)[0] == "Z")
reaped = reap_orphans({own.pid})
# WNOWAIT shows one exited child at a time: ours may come first and end the round.
if helper not in reaped:
    assert own.wait() == 3  # subprocess / multiprocessing still read our worker's code
    reaped += reap_orphans({own.pid})
assert helper in reaped, reaped
assert state(helper) == (None, None), state(helper)
assert own.wait() == 3
print("reaped", reaped)
"""


def test_supervisor_reaps_adopted_orphans_and_leaves_its_workers_exit_codes():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("reaped [")


LIFELINE = r"""
import multiprocessing, os, signal, sys, time

def child(signum):
    from diffq.worker.observe.lifeline import die_with_parent
    if signum == signal.SIGTERM:
        signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").write("handed back"), os._exit(0)))
    assert die_with_parent(signum)
    with open(sys.argv[1] + ".armed.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[1] + ".armed.tmp", sys.argv[1] + ".armed")
    time.sleep(120)

def parent(signum):
    p = multiprocessing.get_context("spawn").Process(target=child, args=(signum,))
    p.start()
    time.sleep(120)

if __name__ == "__main__":
    signum = int(sys.argv[2])
    p = multiprocessing.get_context("spawn").Process(target=parent, args=(signum,))
    p.start()
    print(p.pid, flush=True)
    p.join()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_child_ends_when_its_parent_is_killed(tmp_path):
    """PR_SET_PDEATHSIG (worker/observe/lifeline.py): SIGTERM for a consumer, which hands back
    what it holds first; SIGKILL for a tensor-parallel follower, which holds nothing."""
    import os
    import signal
    import time

    script = tmp_path / "lifeline.py"
    script.write_text(LIFELINE)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        marker = tmp_path / f"handed-{signum}"
        top = subprocess.Popen([sys.executable, str(script), str(marker), str(int(signum))],
                               stdout=subprocess.PIPE, text=True)
        try:
            parent = int(top.stdout.readline())
            armed = tmp_path / f"handed-{signum}.armed"
            deadline = time.monotonic() + 60
            while not armed.exists():  # the child has armed its lifeline
                assert time.monotonic() < deadline
                time.sleep(0.05)
            child = int(armed.read_text())
            os.kill(parent, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _alive(child) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(child)
            assert marker.exists() == (signum == signal.SIGTERM)
        finally:
            top.kill()
            top.wait()
