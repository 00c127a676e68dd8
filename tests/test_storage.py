"""diffq.core.storage against a local directory, moto's S3 server and fake-gcs-server."""

from __future__ import annotations

import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from diffq.core.storage import (
    GCSStorage,
    LocalStorage,
    NotFound,
    S3Storage,
    StorageError,
    join_url,
    open_storage,
    validate_key,
)
from diffq.core.storage.base import TMP_PREFIX

BIG = 9 * 1024 * 1024  # over the 8 MiB multipart (S3) / resumable (GCS) threshold

BAD_KEYS = {
    "parent": "../x",
    "absolute": "/abs",
    "escape": "a/../../b",
    "backslash": "a\\b",
    "nul": "a\x00b",
    "escape-char": "\x1b",
    "long-segment": "a/" + "x" * 300,
    "empty": "",
    "dot": "a/./b",
    "empty-segment": "a//b",
}


@pytest.fixture(params=["local", "s3", "gcs"])
def root_url(request, tmp_path) -> str:
    """The same shape everywhere: <container>/outputs/run-1."""
    if request.param == "local":
        return str(tmp_path / "outputs" / "run-1")
    return request.getfixturevalue(f"{request.param}_bucket")


@pytest.fixture(params=["s3", "gcs"])
def remote_url(request) -> str:
    return request.getfixturevalue(f"{request.param}_bucket")


@pytest.fixture
def store(root_url):
    return open_storage(root_url)


def parent_of(url: str):
    """The storage one level above `url` (…/outputs), to see what leaked outside."""
    return open_storage(url.rsplit("/", 1)[0])


def test_round_trip(store):
    assert store.put_bytes("a.txt", b"hello") is True
    assert store.get_bytes("a.txt") == b"hello"
    data = bytes(range(256)) * 10
    assert store.put_bytes("deep/er/x.bin", data, content_type="image/png") is True
    assert store.get_bytes("deep/er/x.bin") == data
    assert store.put_bytes("a.txt", b"replaced") is True
    assert store.get_bytes("a.txt") == b"replaced"
    assert store.put_bytes("empty", b"") is True
    assert store.get_bytes("empty") == b""
    assert store.put_bytes("ünï cødé @+=.txt", b"u") is True
    assert store.get_bytes("ünï cødé @+=.txt") == b"u"


def test_content_type(remote_url):
    store = open_storage(remote_url)
    store.put_bytes("img.png", b"\x89PNG", content_type="image/png")
    if isinstance(store, S3Storage):
        head = store._get_client().head_object(
            Bucket=store.bucket_name, Key=store.prefix + "img.png"
        )
        assert head["ContentType"] == "image/png"
    else:
        blob = store._get_client().bucket(store.bucket_name).get_blob(store.prefix + "img.png")
        assert blob.content_type == "image/png"


def test_missing_key(store, tmp_path):
    with pytest.raises(NotFound) as info:
        store.get_bytes("no/such.png")
    assert isinstance(info.value, KeyError)
    assert "no/such.png" in str(info.value)
    assert store.url in str(info.value)
    assert store.exists("no/such.png") is False
    store.delete("no/such.png")  # fine
    dest = tmp_path / "dl" / "missing.png"
    with pytest.raises(NotFound):
        store.download_file("no/such.png", dest)
    assert not dest.exists()
    assert not (dest.parent.exists() and any(dest.parent.iterdir()))  # no temp file left


def test_exists_and_delete(store):
    store.put_bytes("d/x", b"1")
    assert store.exists("d/x")
    assert not store.exists("d")  # a "directory" is not an object
    store.delete("d/x")
    assert not store.exists("d/x")
    assert list(store.list()) == []


def test_list_is_recursive_relative_and_paginated(store, root_url):
    store.page_size = 3  # 11 keys -> 4 pages on S3 and GCS
    keys = {f"img/{i:02d}.png": i + 1 for i in range(8)}
    keys |= {"meta/a/b/c.json": 20, "top.txt": 3, "img2/x": 1}
    for key, size in keys.items():
        store.put_bytes(key, b"x" * size)
    parent = parent_of(root_url)
    # Neighbours that share the root's name as a string prefix must not leak in.
    parent.put_bytes("run-1x/not-mine", b"n")
    parent.put_bytes("other/not-mine", b"n")

    if isinstance(store, S3Storage):
        calls = []
        store._get_client().meta.events.register(
            "before-call.s3.ListObjectsV2", lambda **kw: calls.append(1)
        )
    assert sorted(store.list()) == sorted(keys)
    if isinstance(store, S3Storage):
        assert len(calls) == 4  # really paginated
    assert dict(store.list_with_sizes()) == keys
    assert sorted(store.list("img/")) == [f"img/{i:02d}.png" for i in range(8)]
    assert sorted(store.list("img")) == sorted(k for k in keys if k.startswith("img"))
    assert list(store.list("meta/a/")) == ["meta/a/b/c.json"]
    assert list(store.list("nothing/")) == []
    assert sorted(parent.list("run-1")) == sorted(
        ["run-1x/not-mine"] + [f"run-1/{k}" for k in keys]
    )


def test_bucket_root_storage(remote_url):
    bucket_url = "/".join(remote_url.split("/")[:3])
    assert bucket_url.count("/") == 2
    bucket = open_storage(bucket_url)
    assert bucket.url == bucket_url
    bucket.put_bytes("outputs/run-1/k", b"v")
    assert open_storage(remote_url).get_bytes("k") == b"v"
    assert list(bucket.list()) == ["outputs/run-1/k"]


def test_if_absent(store, tmp_path):
    assert store.put_bytes("once", b"first", if_absent=True) is True
    assert store.put_bytes("once", b"second", if_absent=True) is False
    assert store.get_bytes("once") == b"first"
    src = tmp_path / "src.txt"
    src.write_bytes(b"from file")
    assert store.upload_file(src, "once", if_absent=True) is False
    assert store.get_bytes("once") == b"first"
    assert store.upload_file(src, "file-once", if_absent=True) is True
    assert store.get_bytes("file-once") == b"from file"


def test_if_absent_race(store):
    writers = 8
    for round_ in range(3):
        key = f"race/{round_}"
        barrier = threading.Barrier(writers)

        def write(i: int) -> bool:
            barrier.wait()
            return store.put_bytes(key, f"writer {i}".encode(), if_absent=True)

        with ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(write, range(writers)))
        assert results.count(True) == 1, results
        assert store.get_bytes(key) == f"writer {results.index(True)}".encode()


def test_download_file(store, tmp_path):
    data = os.urandom(1024 * 1024 + 7)
    store.put_bytes("blob.bin", data)
    dest = tmp_path / "dl" / "nested" / "blob.bin"
    store.download_file("blob.bin", dest)
    assert dest.read_bytes() == data
    store.put_bytes("blob.bin", b"v2")
    store.download_file("blob.bin", str(dest))  # replaces
    assert dest.read_bytes() == b"v2"
    assert [p.name for p in dest.parent.iterdir()] == ["blob.bin"]  # no temp files left


def test_upload_file(store, tmp_path):
    small = tmp_path / "small.bin"
    small.write_bytes(b"small")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(BIG))
    assert store.upload_file(small, "up/small.bin") is True
    assert store.upload_file(str(big), "up/big.bin") is True
    assert store.get_bytes("up/small.bin") == b"small"
    assert store.get_bytes("up/big.bin") == big.read_bytes()
    assert dict(store.list_with_sizes("up/")) == {"up/small.bin": 5, "up/big.bin": BIG}
    assert store.upload_file(big, "up/big-once.bin", if_absent=True) is True
    assert store.upload_file(big, "up/big-once.bin", if_absent=True) is False
    assert store.get_bytes("up/big-once.bin") == big.read_bytes()
    if isinstance(store, S3Storage):
        client = store._get_client()
        for key in ("up/big.bin", "up/big-once.bin"):
            etag = client.head_object(Bucket=store.bucket_name, Key=store.prefix + key)["ETag"]
            assert etag.strip('"').endswith("-2"), etag  # two 8 MiB-or-less parts


def test_s3_conditional_multipart_completion(s3_bucket, tmp_path):
    """The If-None-Match on CompleteMultipartUpload settles a race the exists() check missed."""
    store = open_storage(s3_bucket)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(BIG))
    store.put_bytes("taken", b"winner")
    assert store._upload_multipart_if_absent(big, store._name("taken"), BIG) is False
    assert store.get_bytes("taken") == b"winner"
    uploads = store._get_client().list_multipart_uploads(Bucket=store.bucket_name)
    assert uploads.get("Uploads", []) == []  # the refused upload was aborted


def test_get_range(store):
    """A ranged read returns only the bytes asked for (a safetensors header: core/adapters.py)."""
    store.put_bytes("r/blob.bin", bytes(range(256)) * 4)
    assert store.get_range("r/blob.bin", 0, 8) == bytes(range(8))
    assert store.get_range("r/blob.bin", 1020, 16) == bytes(range(252, 256))  # fewer at the end
    assert store.get_range("r/blob.bin", 300, 0) == b""
    with pytest.raises(NotFound):
        store.get_range("r/missing.bin", 0, 8)


def test_get_many(store):
    records = {f"rec/{i:04d}.json": f'{{"i": {i}}}'.encode() for i in range(200)}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: store.put_bytes(*kv), records.items()))
    got = dict(store.get_many(iter(records), max_workers=16))
    assert got == records
    assert list(store.get_many([])) == []
    with pytest.raises(NotFound):
        dict(store.get_many(["rec/0001.json", "rec/missing.json"]))


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_bad_keys_rejected(store, root_url, key, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    dest = tmp_path / "dl" / "out.bin"
    calls = {
        "put_bytes": lambda: store.put_bytes(key, b"x"),
        "put_bytes if_absent": lambda: store.put_bytes(key, b"x", if_absent=True),
        "get_bytes": lambda: store.get_bytes(key),
        "exists": lambda: store.exists(key),
        "delete": lambda: store.delete(key),
        "download_file": lambda: store.download_file(key, dest),
        "upload_file": lambda: store.upload_file(src, key),
        "get_many": lambda: list(store.get_many(["ok", key])),
        "local_path": lambda: store.local_path(key),
    }
    if key:  # '' is the valid "everything" prefix
        calls["list"] = lambda: store.list(key)
        calls["list_with_sizes"] = lambda: store.list_with_sizes(key)
    for name, call in calls.items():
        with pytest.raises(ValueError, match="storage key"):
            call()
            pytest.fail(f"{name} accepted {key!r}")
    assert list(parent_of(root_url).list()) == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [src]


def test_validate_key_allows_ordinary_names():
    for key in [".hidden", "..x/x..", "a b/ünï @+=,;~.png", "x" * 255, "é" * 127]:
        assert validate_key(key) == key
    for key in ["a\x7fb", "a\x85b", "é" * 128, "a/"]:
        with pytest.raises(ValueError, match="storage key"):
            validate_key(key)


def test_open_storage_dispatch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = open_storage("rel/dir")
    assert isinstance(rel, LocalStorage) and rel.url == str(tmp_path.resolve() / "rel" / "dir")
    assert open_storage(str(tmp_path) + "/abs/").url == str(tmp_path.resolve() / "abs")
    assert open_storage(tmp_path / "p").url == str(tmp_path.resolve() / "p")
    f = open_storage(f"file://{tmp_path}/f%20x")
    assert isinstance(f, LocalStorage) and f.url == str(tmp_path.resolve() / "f x")
    assert open_storage(rel.url).url == rel.url  # url round-trips

    for url, cls, normal in [
        ("s3://bucket", S3Storage, "s3://bucket"),
        ("s3://bucket/", S3Storage, "s3://bucket"),
        ("s3://bucket/a/b/", S3Storage, "s3://bucket/a/b"),
        ("gs://my_bucket.x/p", GCSStorage, "gs://my_bucket.x/p"),
    ]:
        s = open_storage(url)
        assert type(s) is cls and s.url == normal
        assert s._client is None  # nothing contacted yet
        assert open_storage(s.url).url == s.url

    for bad in ["ftp://x", "", "s3://", "gs://", "s3:bucket", "S4://b/p", "s3://Bad!/p",
                "s3://b/../x", "file://host/x"]:
        with pytest.raises(StorageError) as info:
            open_storage(bad)
        assert bad in str(info.value)


def test_no_credentials_in_urls(store):
    assert "testing" not in store.url and "testing" not in repr(store)
    assert "@" not in store.url
    for url, secrets in [
        ("s3://AKIAEXAMPLE:s3cr3t@bucket/p", ["AKIAEXAMPLE", "s3cr3t"]),
        ("gs://user:s3cr3t@bucket", ["user", "s3cr3t"]),
        ("s3://AKIAEXAMPLE:sec/r3t@bucket/p", ["AKIAEXAMPLE", "sec", "r3t"]),
    ]:
        with pytest.raises(StorageError) as info:
            open_storage(url)
        for secret in secrets:
            assert secret not in str(info.value)


def test_join_url():
    assert join_url("s3://b/p", "a", "b/c") == "s3://b/p/a/b/c"
    assert join_url("s3://b/p/", "/a/", "", "x") == "s3://b/p/a/x"
    assert join_url("/data/out", "img.png") == "/data/out/img.png"
    assert join_url("gs://b") == "gs://b"
    # Surrounding slashes and empty parts are forgiven; nothing can climb out.
    for bad in ["..", "a/../..", "a\\b", "a\x00b", "x" * 300]:
        with pytest.raises(ValueError, match="storage key"):
            join_url("s3://b/p", "a", bad)


def test_s3_client_config_from_environment(s3_server, s3_bucket, monkeypatch):
    # AWS_ENDPOINT_URL (set by s3_server) is honoured by boto3 itself...
    store = open_storage(s3_bucket)
    client = store._get_client()
    assert client.meta.endpoint_url == s3_server.endpoint
    assert client.meta.config.retries["total_max_attempts"] == 15
    assert client.meta.config.retries["mode"] == "standard"
    store.put_bytes("k", b"v")
    # ...and the S3-specific variable wins over it.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    store = open_storage(s3_bucket)
    assert store.get_bytes("k") == b"v"
    assert store._get_client().meta.config.retries["total_max_attempts"] == 4
    assert S3Storage("b", max_attempts=7)._get_client().meta.config.retries[
        "total_max_attempts"
    ] == 7


def test_storage_pickles_without_client(root_url):
    store = open_storage(root_url)
    store.put_bytes("k", b"v")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url
    assert clone.get_bytes("k") == b"v"


def test_local_symlink_cannot_escape(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside)
    store = open_storage(str(root))
    with pytest.raises(ValueError, match="outside"):
        store.put_bytes("link/x", b"x")
    with pytest.raises(ValueError, match="outside"):
        store.get_bytes("link/x")
    assert list(outside.iterdir()) == []
    assert list(store.list("link/")) == []


def test_local_write_never_goes_through_a_link_in_the_last_part(tmp_path):
    """Writes resolve only the directory (once per directory): a link planted where an
    object will go is replaced or, with if_absent, counts as there; the file it points
    to is never written."""
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"theirs")
    root = tmp_path / "root"
    (root / "images").mkdir(parents=True)
    (root / "images" / "a.png").symlink_to(outside)
    (root / "images" / "b.png").symlink_to(outside)
    store = open_storage(str(root))
    assert store.put_bytes("images/a.png", b"ours", if_absent=True) is False
    store.put_bytes("images/b.png", b"ours")
    assert outside.read_bytes() == b"theirs"
    assert not (root / "images" / "b.png").is_symlink() and store.get_bytes("images/b.png") == b"ours"


def test_local_writes_are_atomic_files(tmp_path):
    store = open_storage(str(tmp_path / "root"))
    store.put_bytes("a/b.png", b"x")
    store.put_bytes("a/b.png", b"y", if_absent=True)
    (tmp_path / "root" / "a" / f"{TMP_PREFIX}inflight").write_bytes(b"partial")
    assert list(store.list()) == ["a/b.png"]  # an in-flight temp file is not listed
    assert sorted(p.name for p in (tmp_path / "root" / "a").iterdir()) == [
        f"{TMP_PREFIX}inflight", "b.png"
    ]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "root" / "a" / "b.png").stat().st_mode & 0o777 == 0o666 & ~umask
    assert store.local_path("a/b.png") == (tmp_path / "root" / "a" / "b.png").resolve()
    with pytest.raises(StorageError, match="a/b.png/c"):
        store.put_bytes("a/b.png/c", b"a file is not a directory")


def test_local_path_only_for_local_storage(root_url):
    path = open_storage(root_url).local_path("k")
    if "://" in root_url:
        assert path is None
    else:
        assert path == Path(root_url).resolve() / "k"
