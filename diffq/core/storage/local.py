"""Storage in a local directory (or a mounted network filesystem)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .base import (
    TMP_PREFIX,
    NotFound,
    Storage,
    StorageError,
    atomic_write,
    validate_key,
    validate_prefix,
)

# A key is missing when its path, or a directory on the way to it, is absent or
# is the wrong kind of file ('a' being a directory when reading key 'a').
_MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


class LocalStorage(Storage):
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        # A plain absolute path: open_storage accepts it back, and join_url
        # needs no percent-encoding as a file:// URL would.
        self.url = str(self.root)
        self._folders: dict[str, Path] = {}  # resolved directories of written keys

    def _write_path(self, key: str) -> Path:
        """`_path` for a write, with the directory resolved once per directory: a write
        never goes through a link in the last component (atomic_write renames or
        hard-links over it), so only the directories on the way could lead out, and
        every image of a run shares one. Resolving walks the path a syscall per part,
        each a GIL round trip that the sink's busy threads make slow."""
        validate_key(key)
        parent, _, name = key.rpartition("/")
        folder = self._folders.get(parent)
        if folder is None:
            folder = self._resolved(parent, key)
            if len(self._folders) >= 4096:
                self._folders.clear()
            self._folders[parent] = folder
        return folder / name

    def _path(self, key: str) -> Path:
        validate_key(key)
        return self._resolved(key, key)

    def _resolved(self, relative: str, key: str) -> Path:
        # Resolving follows symlinks, so a link inside the root cannot lead out.
        path = (self.root / relative).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"storage key {key!r} resolves outside {self.url}: {path}")
        return path

    @contextmanager
    def _errors(self, op: str, key: str):
        try:
            yield
        except _MISSING as e:
            raise NotFound(f"{op}: no object {self.key_url(key)}") from e
        except OSError as e:
            raise StorageError(f"{op} {self.key_url(key)} failed: {e}") from e

    def put_bytes(self, key, data, *, content_type=None, if_absent=False):
        path = self._write_path(key)
        try:
            return atomic_write(path, lambda f: f.write(data), exclusive=if_absent)
        except OSError as e:
            # e.g. key 'a/b' while 'a' is an object: a file cannot be a directory.
            raise StorageError(f"put {self.key_url(key)} failed: {e}") from e

    def get_bytes(self, key):
        path = self._path(key)
        with self._errors("get", key):
            return path.read_bytes()

    def get_range(self, key, start, length):
        path = self._path(key)
        with self._errors("get", key), path.open("rb") as f:
            f.seek(start)
            return f.read(length)

    def exists(self, key):
        return self._path(key).is_file()

    def get_many(self, keys, max_workers=16):
        # Local reads are a few syscalls each: read in order, in the caller's thread
        # (docs/BENCHMARKS.md, "Figures behind design choices", times both ways).
        keys = list(keys)
        for key in keys:  # every key is checked before anything is read
            validate_key(key)
        return ((key, self.get_bytes(key)) for key in keys)

    def list_with_sizes(self, prefix=""):
        validate_prefix(prefix)
        return self._walk(prefix)

    def _walk(self, prefix: str) -> Iterator[tuple[str, int]]:
        # Start in the deepest directory the prefix names, then prune directories
        # that cannot hold a matching key.
        top = (self.root / prefix.rpartition("/")[0]).resolve()
        if not top.is_relative_to(self.root):
            return
        for dirpath, dirnames, filenames in os.walk(top):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            rel = "" if rel == "." else rel + "/"
            dirnames[:] = [
                d for d in dirnames
                if (rel + d + "/").startswith(prefix) or prefix.startswith(rel + d + "/")
            ]
            for name in filenames:
                key = rel + name
                if name.startswith(TMP_PREFIX) or not key.startswith(prefix):
                    continue
                try:
                    size = os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:  # deleted while listing
                    continue
                yield key, size

    def delete(self, key):
        path = self._path(key)
        try:
            path.unlink()
        except _MISSING:
            pass
        except OSError as e:
            raise StorageError(f"delete {self.key_url(key)} failed: {e}") from e

    def download_file(self, key, local_path):
        path = self._path(key)
        with self._errors("download", key):
            src = path.open("rb")
        # Errors writing the destination are the caller's, not the storage's.
        with src:
            atomic_write(Path(local_path), lambda dst: shutil.copyfileobj(src, dst, 1 << 20))

    def upload_file(self, local_path, key, *, if_absent=False):
        path = self._write_path(key)
        with open(local_path, "rb") as src:
            try:
                return atomic_write(
                    path, lambda dst: shutil.copyfileobj(src, dst, 1 << 20), exclusive=if_absent
                )
            except OSError as e:
                raise StorageError(f"upload to {self.key_url(key)} failed: {e}") from e

    def local_path(self, key):
        return self._path(key)
