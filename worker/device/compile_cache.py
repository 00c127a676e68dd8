"""The compile cache: where the backend keeps compiled graphs, and syncing it across a fleet.

`--compile-cache DIR` points the backend's cache variable (from the backend table)
at DIR/<namespace>, a shared filesystem (EFS, FSx, Filestore, NFS) every worker
reads and writes in place. `--compile-cache s3://…|gs://…|file://…` mirrors a local
directory instead: pull before warmup, push new entries after each compile. Pushes
are `if_absent` object writes, so no partial file is ever visible remotely and two
workers pushing the same entry is safe (the first wins; entries are
content-addressed by the backends). A backend whose cache speaks a scheme itself
(TPU tier 3 reads gs:// directly) is pointed at the URL with no sync.

The namespace holds torch, diffusers, torchao and backend package versions: an upgrade gets
a fresh, empty namespace instead of stale artefacts.

Torch-free: the supervisor computes a child's environment from it before spawning.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from diffq.core.storage import Storage, open_storage
from diffq.core.storage.base import TMP_PREFIX
from diffq.worker.device.backends import Backend

log = logging.getLogger(__name__)

LOCK_NAME = ".diffq-sync.lock"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def namespace(backend: Backend) -> str:
    """'inductor/torch-2.13.0-cpu_diffusers-0.42.1_torchao-0.18.0': one folder per compiler and versions."""
    # torchao: a `quant:` scheme's graphs are traced through its tensor subclasses
    # (worker/device/quantize.py), whose code an upgrade changes.
    packages = ("torch", "diffusers", "torchao", *backend.cache_packages)
    versions = "_".join(f"{package}-{_version(package)}" for package in packages)
    return f"{backend.compile_backend}/{re.sub(r'[^A-Za-z0-9._-]', '-', versions)}"


def is_url(location: str) -> bool:
    return "://" in location


@dataclass(frozen=True)
class CachePlan:
    """Where one worker's backend cache lives, and what (if anything) it syncs with."""

    env: dict[str, str] = field(default_factory=dict)
    local_dir: str | None = None
    remote: str | None = None  # the namespaced URL to pull from and push to


def plan_cache(location: str | None, backend: Backend, local_root: str | None = None) -> CachePlan:
    plan = _plan_cache(location, backend, local_root)
    if plan.env and backend.cache_companion_env:
        return CachePlan(env={**plan.env, **backend.cache_companion_env}, local_dir=plan.local_dir,
                         remote=plan.remote)
    return plan


def _plan_cache(location: str | None, backend: Backend, local_root: str | None) -> CachePlan:
    if not location:
        # The vendor default (Neuron's /tmp/neff_cache), documented rather than implied.
        if backend.default_cache:
            return CachePlan(env={name: backend.default_cache for name in backend.cache_envs()},
                             local_dir=backend.default_cache)
        return CachePlan()
    ns = namespace(backend)
    if not is_url(location):
        local = str(Path(location, ns))
        return CachePlan(env={name: local for name in backend.cache_envs()}, local_dir=local)
    remote = f"{location.rstrip('/')}/{ns}"
    if location.partition("://")[0].lower() in backend.native_cache_schemes:
        return CachePlan(env={name: remote for name in backend.cache_envs()})
    # Workers on one host share the mirror: one pull serves them all.
    root = local_root or str(Path(tempfile.gettempdir(), "diffq-compile-cache",
                                  hashlib.sha1(location.encode()).hexdigest()[:12]))
    local = str(Path(root, ns))
    return CachePlan(env={name: local for name in backend.cache_envs()}, local_dir=local, remote=remote)


def _is_entry(key: str) -> bool:
    """Finished cache files only: not in-flight temporaries (Inductor writes
    `.<pid>.<tid>.tmp` then renames) nor lock files."""
    name = key.rsplit("/", 1)[-1]
    return not (name.startswith((".", TMP_PREFIX)) or name.endswith((".tmp", ".lock"))
                or key.startswith("locks/"))


@contextmanager
def _host_lock(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_NAME, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class CacheSync:
    """Mirror between a local cache directory and a storage URL.

    `mirrored(plan)` is how a process uses it (worker warm start, qualify): the one
    place that pulls, pushes and says what a failed sync costs."""

    def __init__(self, remote: str, local_dir: str | Path, storage: Storage | None = None):
        self.remote = remote
        self.local = Path(local_dir)
        self.storage = storage or open_storage(remote)
        self.known: set[str] = set()  # keys present on both sides
        self.pulled = 0
        self.pushed = 0
        self._lock = threading.Lock()

    def pull(self) -> int:
        """Download remote entries missing here; one worker per host at a time."""
        count = 0
        with self._lock, _host_lock(self.local):
            for key, size in self.storage.list_with_sizes():
                if not _is_entry(key):
                    continue
                path = self.local / key
                if not (path.is_file() and path.stat().st_size == size):
                    self.storage.download_file(key, path)  # atomic: temp file + rename
                    count += 1
                self.known.add(key)
        self.pulled += count
        return count

    def local_entries(self) -> list[tuple[str, Path]]:
        if not self.local.is_dir():
            return []
        files = ((path.relative_to(self.local).as_posix(), path)
                 for path in self.local.rglob("*") if path.is_file())
        return sorted((key, path) for key, path in files if _is_entry(key))

    def push(self) -> int:
        """Upload local entries the remote lacks; returns how many this call wrote."""
        count = 0
        with self._lock:
            for key, path in self.local_entries():
                if key in self.known:
                    continue
                if self.storage.upload_file(path, key, if_absent=True):
                    count += 1
                self.known.add(key)
        self.pushed += count
        return count

    def push_in_background(self) -> threading.Thread:
        """After a compile while serving: do not hold the next batch for the upload."""
        def push() -> None:
            try:
                self.push()
            except Exception:  # a failed push only costs another worker a compile
                log.exception("compile cache push to %s failed", self.remote)

        thread = threading.Thread(target=push, name="diffq-cache-push", daemon=True)
        thread.start()
        return thread


@contextmanager
def mirrored(plan: CachePlan) -> Iterator[CacheSync | None]:
    """Pull before the body (the compiles), push what it added after; None without a remote.

    A failed pull or push is a warning, never an error: a missing cache costs compile
    time, and another worker compiles what was not pushed. A body that fails pushes
    nothing (its entries may be half a shape)."""
    sync = CacheSync(plan.remote, plan.local_dir) if plan.remote else None
    if sync:
        try:
            sync.pull()
        except Exception as exc:
            log.warning("compile cache pull from %s failed: %s", plan.remote, exc)
    yield sync
    if sync:
        try:
            sync.push()
        except Exception as exc:
            log.warning("compile cache push to %s failed: %s", plan.remote, exc)


def report(plan: CachePlan, sync: CacheSync | None) -> dict:
    """The cache part of a warm-start or qualify report."""
    return {"dir": plan.local_dir, "remote": plan.remote,
            "pulled": sync.pulled if sync else 0, "pushed": sync.pushed if sync else 0}
