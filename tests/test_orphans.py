"""The fleet supervisor is PID 1 of a worker container: when a worker is killed, its
sink helper (and any Inductor compile worker) is orphaned and adopted by the
supervisor, which must reap it, while its own workers' exit codes stay for
multiprocessing to read. Run in a separate interpreter: a subreaper is per process."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import os, subprocess, sys, time
from diffq.worker.supervisor import become_subreaper, reap_orphans

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
