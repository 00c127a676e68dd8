"""Models in object storage: fetched into the node-local model_cache, verified, once per node,
resumable, pinned to a revision; a run from s3:// / gs:// makes the local folder's images."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from boto3.s3.transfer import TransferConfig

from diffq.core.model_store import list_model
from diffq.core.settings import Settings
from diffq.core.storage import open_storage
from tests.helpers import diffq
from tests.proxy import CorruptingProxy
from diffq.testing.servers import unique_bucket_name
from diffq.worker.device import model_fetch
from diffq.worker.device.model_fetch import COMPLETE, FetchRefused, fetch

# A padding shard bigger than one part: uploaded in 5 MiB parts, so its ETag is a
# multipart one (the MD5 of the parts' MD5s).
PADDING = "transformer/padding.safetensors"
PADDING_BYTES = 11 * 2**20 + 12345


def _files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_folder(tiny_model, tmp_path_factory) -> Path:
    """The tiny pipeline plus a padding shard of random bytes (a safetensors header)."""
    folder = tmp_path_factory.mktemp("model") / "tiny"
    import shutil

    shutil.copytree(tiny_model, folder)
    header = json.dumps({"__metadata__": {"padding": "yes"}}).encode()
    header += b" " * (-len(header) % 8)
    body = os.urandom(PADDING_BYTES - 8 - len(header))
    (folder / PADDING).write_bytes(len(header).to_bytes(8, "little") + header + body)
    return folder


def upload_s3(s3_server, folder: Path) -> str:
    bucket = s3_server.make_bucket(unique_bucket_name())
    config = TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    for key, path in _files(folder).items():
        s3_server.client.upload_file(str(path), bucket, f"models/tiny/{key}", Config=config)
    return f"s3://{bucket}/models/tiny"


def upload_gcs(gcs_server, folder: Path) -> str:
    bucket = gcs_server.make_bucket(unique_bucket_name())
    storage = open_storage(f"gs://{bucket}/models/tiny")
    for key, path in _files(folder).items():
        storage.upload_file(path, key)
    return f"gs://{bucket}/models/tiny"


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "model-cache"
    monkeypatch.setenv("DIFFQ_MODEL_CACHE", str(folder))
    return folder


def _same_files(fetched: Path, folder: Path) -> None:
    got = {key: p for key, p in _files(fetched).items() if key != COMPLETE}
    assert sorted(got) == sorted(_files(folder))
    for key, path in _files(folder).items():
        assert hashlib.sha256(got[key].read_bytes()).digest() == hashlib.sha256(path.read_bytes()).digest(), key


@pytest.mark.parametrize("store", ["s3", "gs"])
@pytest.mark.parametrize("parts", [False, True], ids=["whole-files", "big-files-in-parts"])
def test_fetch_verifies_caches_and_hits(store, parts, model_cache, model_folder, request, monkeypatch):
    if parts:  # the padding shard fetched in ranged pieces, runs of them side by side
        monkeypatch.setattr(model_fetch, "PART_BYTES", 2 * 2**20)
        monkeypatch.setattr(model_fetch, "RUN_BYTES", 4 * 2**20)
    url = (upload_s3(request.getfixturevalue("s3_server"), model_folder) if store == "s3"
           else upload_gcs(request.getfixturevalue("gcs_server"), model_folder))
    first = fetch(url)
    assert not first.hit and first.bytes == sum(p.stat().st_size for p in _files(model_folder).values())
    assert Path(first.path).parent == model_cache and (Path(first.path) / COMPLETE).is_file()
    _same_files(Path(first.path), model_folder)
    assert not list(Path(first.path).rglob(".diffq-part-*"))
    again = fetch(url, first.revision)
    assert (again.hit, again.bytes, again.path) == (True, 0, first.path)


def test_two_processes_started_together_fetch_once(model_cache, model_folder, s3_server):
    url = upload_s3(s3_server, model_folder)
    code = ("import json, sys; from diffq.worker.device.model_fetch import fetch; "
            "print(json.dumps(fetch(sys.argv[1]).report()))")
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    reports = [json.loads(proc.communicate(timeout=300)[0]) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert sorted(r["hit"] for r in reports) == [False, True]
    assert sum(r["bytes"] for r in reports) == list_model(url).size
    assert len([p for p in model_cache.iterdir() if p.is_dir()]) == 1


def test_a_fetch_killed_half_way_resumes_without_refetching(model_cache, model_folder, s3_server):
    url = upload_s3(s3_server, model_folder)
    listing = list_model(url)
    code = "import sys; from diffq.worker.device.model_fetch import fetch; fetch(sys.argv[1])"
    killed = subprocess.run([sys.executable, "-c", code, url], timeout=300,
                            env={**os.environ, "DIFFQ_FAULT_FETCH_KILL_AFTER": "3"})
    assert killed.returncode == -9
    (entry,) = [p for p in model_cache.iterdir() if p.is_dir()]
    assert not (entry / COMPLETE).exists()
    in_place = {key: path.stat().st_ino for key, path in _files(entry).items() if not path.name.startswith(".")}
    assert len(in_place) >= 3 and len(in_place) < len(listing.files)

    resumed = fetch(url)
    assert not resumed.hit and resumed.path == str(entry)
    assert sorted(resumed.files) == sorted(f.key for f in listing.files if f.key not in in_place)
    assert resumed.bytes == sum(f.size for f in listing.files if f.key not in in_place)
    # What was complete stayed: the same files (inodes), not downloaded again.
    assert {key: (entry / key).stat().st_ino for key in in_place} == in_place
    _same_files(entry, model_folder)


# A small object's stored CRC32 and the multipart padding shard's composite CRC32 (over
# its parts' CRC32s) are checked from the pieces' digests, kept as the bytes stream in.
@pytest.mark.parametrize(("key", "ranged"), [("scheduler/scheduler_config.json", False), (PADDING, False),
                                             (PADDING, True)], ids=["small", "multipart-whole", "multipart-ranged"])
def test_a_corrupt_object_is_refused_naming_the_file(key, ranged, model_cache, model_folder, s3_server, monkeypatch):
    found_by = "CRC32"
    if ranged:
        monkeypatch.setattr(model_fetch, "PART_BYTES", 2 * 2**20)
    url = upload_s3(s3_server, model_folder)
    with CorruptingProxy(s3_server.endpoint, corrupt=key) as proxy:
        # The model bucket's own endpoint (DIFFQ_MODEL_STORE_ENDPOINT): here, the proxy.
        settings = Settings(model_store_endpoint=proxy.endpoint, model_cache=str(model_cache))
        with pytest.raises(FetchRefused, match=f"file {re.escape(key)} is corrupt: .*{found_by}"):
            fetch(url, settings=settings)
    (entry,) = [p for p in model_cache.iterdir() if p.is_dir()]
    assert not (entry / COMPLETE).exists() and not (entry / key).exists()


def test_a_model_changed_under_its_prefix_is_another_revision_and_the_pin_refuses(model_cache, model_folder, s3_server):
    url = upload_s3(s3_server, model_folder)
    pinned = fetch(url)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3_server.client.put_object(Bucket=bucket, Key=f"{prefix}/scheduler/scheduler_config.json", Body=b"{}")
    assert list_model(url).revision != pinned.revision
    with pytest.raises(FetchRefused, match="changed since the run pinned it"):
        fetch(url, pinned.revision)
    changed = fetch(url)
    assert changed.path != pinned.path and not changed.hit


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gs"])
def test_a_run_from_object_storage_makes_the_local_folders_images(store, tmp_path, model_cache, model_folder, request):
    url = (upload_s3(request.getfixturevalue("s3_server"), model_folder) if store == "s3"
           else upload_gcs(request.getfixturevalue("gcs_server"), model_folder))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"i{i}", "prompt": f"a prompt {i}", "seed": 7 + i,
                                           "height": 64, "width": 64})
                               + "\n" for i in range(3)))
    images = {}
    for name, model in (("local", str(model_folder)), ("remote", url)):
        out = tmp_path / name
        diffq("run", str(prompts), "--model", model, "--out", str(out), "--batch-size", "2", "--steps", "2",
              "--format", "png", "--no-progress")
        # Pixels: the files' embedded provenance names the model and run.
        images[name] = {p.name: Image.open(p).tobytes() for p in (out / "images").rglob("*.png")}
        records = [json.loads(line) for p in (out / "records").glob("*.jsonl") for line in p.read_text().splitlines()]
        manifest = json.loads((out / "manifest.json").read_text())
        if name == "remote":
            revision = list_model(url).revision
            assert manifest["model_revisions"] == {url: revision}
            assert {r["model_revision"] for r in records} == {revision}
            # The provenance written into each file names it too.
            assert {Image.open(p).text["model_revision"] for p in (out / "images").rglob("*.png")} == {revision}
        else:
            assert manifest["model_revisions"] == {} and {r["model_revision"] for r in records} == {None}
    assert len(images["local"]) == 3 and images["local"] == images["remote"]


def test_the_size_cap_evicts_the_least_recently_used_entry_never_one_in_use(model_cache, model_folder, s3_server):
    first, second, third = (upload_s3(s3_server, model_folder) for _ in range(3))
    size = list_model(first).size
    code = "import sys; from diffq.worker.device.model_fetch import fetch; print(fetch(sys.argv[1]).path)"
    # Fetched by a process that has exited: no longer in use.
    unused = subprocess.run([sys.executable, "-c", code, first], capture_output=True, text=True, timeout=300,
                            check=True).stdout.strip()
    settings = Settings(model_cache=str(model_cache), model_cache_max_gb=2.5 * size / 1e9)  # two fit, not three
    in_use = fetch(second, settings=settings)  # this process holds it from now on
    assert Path(unused).is_dir()
    newest = fetch(third, settings=settings)
    assert not Path(unused).exists()  # the least recently used, no longer held
    assert (Path(in_use.path) / COMPLETE).is_file() and (Path(newest.path) / COMPLETE).is_file()
    # Nothing left to evict but entries in use: the cap is exceeded, never a held entry removed.
    fetch(first, settings=settings)
    assert (Path(in_use.path) / COMPLETE).is_file() and (Path(newest.path) / COMPLETE).is_file()


@pytest.mark.slow
def test_each_worker_life_accounts_its_time_to_first_image(tmp_path, model_cache, model_folder, s3_server):
    url = upload_s3(s3_server, model_folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"i{i}", "prompt": f"p {i}", "height": 64, "width": 64}) + "\n"
                               for i in range(4)))
    out = tmp_path / "out"
    diffq("run", str(prompts), "--model", url, "--out", str(out), "--workers", "2", "--batch-size", "1",
          "--steps", "2", "--no-progress")
    from diffq.core.records import START_PHASES, WorkerStart
    from diffq.results.report import build_report, render_html, render_text

    starts = [WorkerStart.model_validate_json(p.read_bytes()) for p in (out / "starts").glob("*.json")]
    records = [json.loads(line) for p in (out / "records").glob("*.jsonl") for line in p.read_text().splitlines()]
    assert len(starts) == len({r["worker"] for r in records})  # every life that stored a batch
    for start in starts:
        assert list(start.phases) == list(START_PHASES)
        assert start.time_to_first_image_s >= sum(start.phases.values()) - 0.01 * len(START_PHASES)
        (fetched,) = start.fetches
        assert fetched["model"] == url and fetched["revision"] == list_model(url).revision
    # One fetch per node: at most one life missed (the runner lists, never fetches); a
    # worker that stored no batch records no start, so the miss may be its.
    assert [s.fetches[0]["hit"] for s in starts].count(False) <= 1
    assert len([p for p in model_cache.iterdir() if p.is_dir()]) == 1
    report = build_report(str(out))
    assert len(report.starts) == len(starts)
    text = render_text(report)
    assert "median time to first image" in text and "device-seconds spent starting" in text
    assert render_html(report).count("<h2>Time to first image</h2>") == 1


@pytest.mark.parametrize("model", ["s3://models-bucket/flux2", "gs://models-bucket/flux2"])
def test_pools_of_object_storage_models_mount_a_node_local_cache(model):
    from tests.test_infra import render_cli, validate_manifest, worker_deployments

    docs = render_cli("--model", model, "--shapes", "64x64", "--batch-size", "1", "--device", "cuda",
                      "--model-cache-gib", "100")
    for doc in docs:
        validate_manifest(doc)
    pod = worker_deployments(docs)[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {"sizeLimit": "100Gi"}  # per pod, on the node's disk
    assert volumes["diffq-model-store"]["secret"] == {"secretName": "diffq-model-store", "optional": True}
    assert {"name": "model-cache", "mountPath": "/model-cache"} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DIFFQ_MODEL_CACHE"] == "/model-cache" and float(env["DIFFQ_MODEL_CACHE_MAX_GB"]) < 100 * 2**30 / 1e9
    assert json.loads(env["DIFFQ_ALLOWED_MODELS"]) == [model]
    # Pod Security: no hostPath, still run as non-root.
    assert not any("hostPath" in v for v in pod["volumes"]) and pod["securityContext"]["runAsNonRoot"]


def test_a_key_that_would_leave_the_cache_entry_is_refused(model_cache, s3_server, model_folder):
    bucket = s3_server.make_bucket(unique_bucket_name())
    s3_server.client.put_object(Bucket=bucket, Key="m/model_index.json", Body=b"{}")
    s3_server.client.put_object(Bucket=bucket, Key="m/../../escape.json", Body=b"{}")
    from diffq.core.model_store import ModelStoreError

    with pytest.raises(ModelStoreError, match=r"'\.\./\.\./escape\.json' cannot be a file"):
        fetch(f"s3://{bucket}/m")
    assert not model_cache.exists() or not any(model_cache.iterdir())


def test_a_worker_refuses_a_run_pinned_to_another_revision_than_it_loaded(tmp_path):
    from diffq.core.storage import open_storage as storage_of
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost
    from diffq.worker.delivery.runtime import Runtime
    from diffq.worker.sink.store import Sink
    from diffq.worker.delivery.spec import ChildSpec

    url = "s3://models/flux2"
    run = storage_of(str(tmp_path / "run"))
    run.put_bytes("manifest.json", json.dumps({"run_id": "r1", "model_revisions": {url: "sha256:pinned"}}).encode())
    runtime = Runtime(spec=ChildSpec(name="w", broker_url="memory://", queues=["q"]),
                      host=PipelineHost(backend=get_backend("cpu")), sink=Sink())
    assert runtime.run_problem(run, "r1") is None
    # Not loaded yet: it will be loaded at the pinned revision (or the load refuses).
    assert runtime.model_problem(run, url) is None and runtime.host.pins == {url: "sha256:pinned"}
    runtime.host.revisions[url] = "sha256:other"
    assert "loaded at revision sha256:other, but run r1 pinned sha256:pinned" in runtime.model_problem(run, url)
    runtime.host.revisions[url] = "sha256:pinned"
    assert runtime.model_problem(run, url) is None
    assert runtime.model_problem(run, "/models/local") is None  # nothing pinned for a local folder



@pytest.mark.slow
def test_qualify_reports_the_weights_fetch_of_an_object_storage_model(tmp_path, model_cache, model_folder, s3_server):
    url = upload_s3(s3_server, model_folder)
    proc = subprocess.run([sys.executable, "-m", "diffq", "qualify", "--model", url, "--shapes", "64x64",
                           "--batch-size", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    qualified = json.loads(proc.stdout)
    start = qualified["start"]
    (fetched,) = start["fetches"]
    assert fetched["model"] == url and not fetched["hit"] and fetched["bytes"] == list_model(url).size
    assert start["weights_fetch_s"] == fetched["seconds"] and start["load_s"] >= 0

    # The plan's start-up says whether it holds the fetch each new pod makes.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p {i}", "height": 64, "width": 64}) + "\n" for i in range(4)))
    rates = tmp_path / "rates.json"
    for hit, says in ((False, f"includes the model's fetch from object storage ({fetched['seconds']:.1f} s, a cache "
                              "miss)"), (True, "leaves out the fetch each new pod makes")):
        start["fetches"][0]["hit"] = hit
        rates.write_text(json.dumps(qualified))
        plan = json.loads(diffq("plan", str(prompts), "--model", url, "--batch-size", "1", "--rates", str(rates),
                                "--devices", "1", "--json").stdout)
        assert any(says in note for note in plan["fleet"]["notes"]), plan["fleet"]["notes"]


def test_a_file_changed_between_the_listing_and_its_fetch_is_refused(model_cache, model_folder, s3_server, tmp_path):
    from diffq.core.model_store import model_storage
    from diffq.worker.device.fetch_patience import Patience

    url = upload_s3(s3_server, model_folder)
    storage = model_storage(url)
    listing = list_model(url, storage=storage)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3_server.client.put_object(Bucket=bucket, Key=f"{prefix}/scheduler/scheduler_config.json", Body=b"{}")
    # The checksums looked up are the listed object's (If-Match its ETag), never a newer one's.
    with pytest.raises(FetchRefused, match=r"file scheduler/scheduler_config\.json changed since the model was listed"):
        model_fetch._fetch_files(model_fetch._Store(storage, url), list(listing.files), tmp_path, 4,
                                 Patience("S3", url, 60.0, total=listing.size))


def test_a_start_clock_says_its_phases_once_in_a_log_line_metrics_and_the_run_folder(tmp_path, caplog):
    import threading
    from concurrent.futures import Future

    from diffq.core.records import START_PHASES, WorkerStart
    from diffq.worker.observe import metrics
    from diffq.worker.observe.startup import StartClock

    clock = StartClock("w0")
    for phase in ("imports", "compile_cache_pull", "load"):
        clock.phase(phase)
    clock.phase("weights_fetch", seconds=0.0)
    clock.phase("warmup")
    run = open_storage(str(tmp_path / "run"))
    before = metrics.REGISTRY.get_sample_value("diffq_time_to_first_image_seconds_count") or 0
    credited, again = Future(), Future()
    fetch = {"model": "s3://m/x", "revision": "sha256:1", "hit": False, "bytes": 10, "seconds": 0.0, "mb_per_s": 0.0}
    with caplog.at_level("INFO", logger="diffq.worker"):
        clock.first_batch(run, credited, "w0@host", "cpu:0", [fetch])
        clock.first_batch(run, again, "w0@host", "cpu:0", [])  # the second batch: nothing more
        credited.set_result(None)
        again.set_result(None)
        for thread in [t for t in threading.enumerate() if t.name == "diffq-first-image"]:
            thread.join()
    (key,) = run.list("starts/")
    start = WorkerStart.model_validate_json(run.get_bytes(key))
    assert (start.worker, start.device, start.fetches) == ("w0@host", "cpu:0", [fetch])
    assert list(start.phases) == list(START_PHASES) and start.time_to_first_image_s >= sum(start.phases.values()) - 0.1
    (said,) = [r.getMessage() for r in caplog.records if '"first_image"' in r.getMessage()]
    assert json.loads(said)["time_to_first_image_s"] == start.time_to_first_image_s
    assert metrics.REGISTRY.get_sample_value("diffq_time_to_first_image_seconds_count") == before + 1
    assert metrics.REGISTRY.get_sample_value("diffq_model_fetch_bytes_total", {"hit": "false"}) >= 10


@pytest.mark.parametrize("algorithm", ["MD5", "CRC32", "CRC32C", "CRC64NVME", "SHA256", "XXHASH3"])
@pytest.mark.parametrize("parts", [None, (5 * 2**20, 7 * 2**20 + 3, 5 * 2**20, 4)],
                         ids=["single-part", "uneven-multipart"])
def test_the_s3_check_from_the_pieces_digests(algorithm, parts, tmp_path):
    """Each way an S3 object is checked (stored full-object or composite checksum,
    single-part or multipart ETag), from the digests of the pieces it was fetched in:
    pieces of 3 MiB + 1 (CRCs combined), or its real, uneven parts."""
    import base64

    from awscrt import checksums
    from diffq.core.storage.s3 import S3Storage
    from diffq.worker.device import store_checksums

    size = sum(parts) if parts else 12 * 2**20 + 7
    data = os.urandom(size)
    path = tmp_path / "object"
    path.write_bytes(data)

    def raw(body: bytes, name: str) -> bytes:
        h = store_checksums.hasher(name)
        h.update(body)
        return h.digest()

    if algorithm == "CRC64NVME":
        assert raw(data, algorithm) == checksums.crc64nvme(data).to_bytes(8, "big")
    pieces_of = [data[sum(parts[:i]):sum(parts[:i + 1])] for i in range(len(parts))] if parts else [data]
    combined = raw(b"".join(raw(p, algorithm) for p in pieces_of), algorithm) if parts else raw(data, algorithm)
    suffix = f"-{len(parts)}" if parts else ""
    head = {"ETag": '"' + "0" * 32 + suffix + '"'}
    if algorithm == "MD5":  # no stored checksum: the ETag rule
        head["ETag"] = combined.hex() + suffix
    elif parts and algorithm == "CRC64NVME":  # full-object only, multipart or not
        head[f"Checksum{algorithm}"] = base64.b64encode(raw(data, algorithm)).decode()
    else:
        head[f"Checksum{algorithm}"] = base64.b64encode(combined).decode() + suffix
    expect = store_checksums.expectation(S3Storage.checksums_of(head, parts or ()))
    assert expect.algorithm == algorithm

    def check(body: bytes) -> str | None:
        path.write_bytes(body)
        pieces = expect.pieces(len(body), 3 * 2**20 + 1)
        return expect.problem([raw(body[o:o + n], algorithm) for o, n in pieces], pieces, path, "x")

    assert check(data) is None
    damaged = bytearray(data)
    damaged[-1] ^= 1
    assert (problem := check(bytes(damaged))) and problem.startswith("ETag" if algorithm == "MD5" else algorithm)


@pytest.mark.parametrize(("pays_up_to", "most", "settles_at"), [(4, 16, 4), (2, 16, 2), (64, 16, 16)])
def test_s3_streams_double_while_it_pays(pays_up_to, most, settles_at, monkeypatch):
    """The whole-object streams double while a doubling raises the rate by a quarter,
    and go back when one makes it slower (a store that is slower with more streams)."""
    clock = [0.0]
    monkeypatch.setattr(model_fetch, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    streams = model_fetch._Streams(most)
    for _ in range(20):  # windows of STREAMS_WINDOW seconds
        limit = streams.limit
        # 100 MB/s per stream up to `pays_up_to`, then slower with each stream more
        rate = 100e6 * min(limit, pays_up_to) * (0.8 if limit > pays_up_to else 1.0)
        clock[0] += model_fetch.STREAMS_WINDOW
        streams.moved(int(rate * model_fetch.STREAMS_WINDOW))
    assert streams.settled and streams.limit == settles_at


# Patience, resume inside a file, the checksums the stores keep ------------------------
def _folder_with(tmp_path: Path, model_folder: Path, size: int) -> Path:
    """A copy of the model folder whose padding shard is `size` random bytes."""
    import shutil

    folder = tmp_path / "tiny"
    shutil.copytree(model_folder, folder)
    (folder / PADDING).write_bytes(os.urandom(size))
    return folder


def _put(s3_server, url: str, key: str, data: bytes, parts: tuple[int, ...] = (), algorithm: str | None = None):
    """`key` of the model at `url` uploaded again: one PUT, or a multipart upload of
    exactly these part sizes (uneven); with `algorithm` as its checksum, else none (the
    ETag rule: botocore adds no checksum when not required)."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3_server.endpoint,
                          config=Config(request_checksum_calculation="when_required"))
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    name, extra = f"{prefix}/{key}", ({"ChecksumAlgorithm": algorithm} if algorithm else {})
    if not parts:
        client.put_object(Bucket=bucket, Key=name, Body=data, **extra)
        return
    upload = client.create_multipart_upload(Bucket=bucket, Key=name, **extra)["UploadId"]
    done, at = [], 0
    for number, length in enumerate(parts, 1):
        answer = client.upload_part(Bucket=bucket, Key=name, UploadId=upload, PartNumber=number,
                                    Body=data[at:at + length], **extra)
        done.append({"PartNumber": number, "ETag": answer["ETag"],
                     **{k: v for k, v in answer.items() if k.startswith("Checksum")}})
        at += length
    client.complete_multipart_upload(Bucket=bucket, Key=name, UploadId=upload, MultipartUpload={"Parts": done})


UNEVEN = (5 * 2**20 + 17, 7 * 2**20, 5 * 2**20, 123)


@pytest.mark.parametrize(("parts", "algorithm", "found_by"), [
    (UNEVEN, None, "ETag"), (UNEVEN, "CRC32", "CRC32"), ((), "CRC64NVME", "CRC64NVME")],
    ids=["uneven-parts-etag", "uneven-parts-composite-crc32", "crc64nvme-only"])
def test_the_checksum_the_store_keeps_accepts_the_object_and_refuses_a_flipped_byte(
        parts, algorithm, found_by, tmp_path, model_cache, model_folder, s3_server):
    folder = _folder_with(tmp_path, model_folder, sum(parts) or 9 * 2**20 + 5)
    url = upload_s3(s3_server, folder)
    _put(s3_server, url, PADDING, (folder / PADDING).read_bytes(), parts, algorithm)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    head = s3_server.client.head_object(Bucket=bucket, Key=f"{prefix}/{PADDING}", ChecksumMode="ENABLED")
    stored = sorted(k for k in head if k.startswith("Checksum") and k != "ChecksumType")
    assert stored == ([f"Checksum{algorithm}"] if algorithm else [])
    from diffq.core.storage.s3 import S3Storage
    from diffq.worker.device.store_checksums import expectation

    expect = model_fetch._Store(model_fetch.model_storage(url), url).expectation(
        next(f for f in list_model(url).files if f.key == PADDING))
    assert (expect.algorithm, expect.parts) == ({"ETag": "MD5"}.get(found_by, found_by), parts)
    assert expectation(S3Storage.checksums_of(head, parts)).kind == ("etag" if not algorithm else "composite" if parts else "full")
    with CorruptingProxy(s3_server.endpoint, corrupt=PADDING) as proxy:
        settings = Settings(model_store_endpoint=proxy.endpoint, model_cache=str(model_cache))
        with pytest.raises(FetchRefused, match=f"file {re.escape(PADDING)} is corrupt: {found_by} "):
            fetch(url, settings=settings)
    fetched = fetch(url)  # the real bytes: accepted
    _same_files(Path(fetched.path), folder)


@pytest.mark.parametrize(("status", "code", "heals"), [(503, "SlowDown", True), (403, "AccessDenied", False)])
def test_what_may_heal_is_waited_out_and_what_cannot_fails_at_once_naming_the_file(
        status, code, heals, model_cache, model_folder, s3_server, caplog):
    url = upload_s3(s3_server, model_folder)
    key = "scheduler/scheduler_config.json"
    # 6 answers: botocore's own 3 attempts twice, the fetch waiting in between.
    with CorruptingProxy(s3_server.endpoint, corrupt=key, status=status, code=code, times=6) as proxy:
        settings = Settings(model_store_endpoint=proxy.endpoint, model_cache=str(model_cache))
        with caplog.at_level("WARNING", logger="diffq.worker"):
            if heals:
                _same_files(Path(fetch(url, settings=settings).path), model_folder)
            else:
                with pytest.raises(model_fetch.ModelStoreError, match=f"file {re.escape(key)}: .*\\(403\\)"):
                    fetch(url, settings=settings)
    waits = [r.getMessage() for r in caplog.records if "retrying S3" in r.getMessage()]
    if heals:
        assert proxy.answered == 6 and waits and all(f"retrying S3 ({status}" in w and ") for 0:" in w for w in waits)
    else:
        assert proxy.answered == 1 and not waits


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_a_fetch_cut_mid_file_waits_and_resumes_inside_it(store, model_cache, model_folder, tmp_path, caplog,
                                                          monkeypatch, request):
    from tests.proxy import CuttableProxy

    monkeypatch.setattr(model_fetch, "PART_BYTES", 4 * 2**20)
    folder = _folder_with(tmp_path, model_folder, 24 * 2**20 + 3)
    server = request.getfixturevalue("s3_server" if store == "s3" else "gcs_server")
    if store == "s3":
        url = upload_s3(server, folder)
        _put(server, url, PADDING, (folder / PADDING).read_bytes(), algorithm="CRC64NVME")
    else:
        url = upload_gcs(server, folder)
    size = list_model(url).size
    proxy = CuttableProxy(int(server.endpoint.rpartition(":")[2]))
    proxy.start()
    proxy.cut_after(size // 3, 3.0)
    settings = Settings(model_store_endpoint=proxy.endpoint, model_cache=str(model_cache))
    if store == "gs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
    with caplog.at_level("WARNING", logger="diffq.worker"):
        fetched = fetch(url, settings=settings)
    _same_files(Path(fetched.path), folder)
    assert proxy.cuts == 1 and proxy.sent <= 1.1 * size
    said = "S3" if store == "s3" else "GCS"
    assert any(f"retrying {said} (connection" in r.getMessage() for r in caplog.records)


def test_a_fetch_sigkilled_mid_file_resumes_inside_it(model_cache, model_folder, s3_server, tmp_path, monkeypatch):
    from tests.proxy import CuttableProxy

    folder = _folder_with(tmp_path, model_folder, 12 * 2**20 + 5)
    url = upload_s3(s3_server, folder)
    _put(s3_server, url, PADDING, (folder / PADDING).read_bytes(), algorithm="CRC32")
    code = ("import sys; from diffq.worker.device import model_fetch as m; m.PART_BYTES = 2**20; "
            "m.fetch(sys.argv[1])")
    # One stream: the padding (the biggest file) goes first, piece by piece.
    killed = subprocess.run([sys.executable, "-c", code, url], timeout=300,
                            env={**os.environ, "DIFFQ_FAULT_FETCH_KILL_AFTER_PIECES": "5",
                                 "DIFFQ_MODEL_FETCH_THREADS": "1"})
    assert killed.returncode == -9
    (entry,) = [p for p in model_cache.iterdir() if p.is_dir()]
    part = (entry / PADDING).with_name(".diffq-part-padding.safetensors")
    ranges = json.loads(part.with_name(part.name + ".ranges").read_text())
    assert len(ranges["done"]) == 5 and not (entry / PADDING).exists()

    monkeypatch.setattr(model_fetch, "PART_BYTES", 2**20)
    proxy = CuttableProxy(int(s3_server.endpoint.rpartition(":")[2]))
    proxy.start()
    resumed = fetch(url, settings=Settings(model_store_endpoint=proxy.endpoint, model_cache=str(model_cache)))
    assert resumed.path == str(entry) and PADDING in resumed.files
    _same_files(entry, folder)
    # The five pieces in were not fetched again (the listing, HEADs and the rest were).
    assert proxy.sent <= list_model(url).size - 5 * 2**20 + 200_000


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "gs"])
def test_a_run_rides_out_a_20_s_cut_of_a_1_gb_file_and_resumes_inside_it(store, tmp_path, model_cache, model_folder,
                                                                         request):
    """On defaults: the link to the store cut for 20 s once a third of the model has
    arrived; `diffq run` waits, says so, resumes inside the big file and makes the local
    folder's images."""
    from tests.proxy import CuttableProxy

    big = 1_000_000_007  # ≥ 1 GB, not a multiple of any piece
    folder = _folder_with(tmp_path, model_folder, 16)
    with (folder / PADDING).open("wb") as f:
        for _ in range(big // (64 * 2**20)):
            f.write(os.urandom(64 * 2**20))
        f.write(os.urandom(big % (64 * 2**20)))
    server = request.getfixturevalue("s3_server" if store == "s3" else "gcs_server")
    env = dict(os.environ)  # with the server's
    if store == "s3":
        url = upload_s3(server, model_folder)  # the small files; the big one below
        # Uneven parts with a composite CRC32 (each part one ranged GET: moto reads the
        # whole object for each, so few and big).
        _put(server, url, PADDING, (folder / PADDING).read_bytes(), (300_000_000, 250_000_000, 450_000_007),
             "CRC32")
        proxy = CuttableProxy(int(server.endpoint.rpartition(":")[2]))
        env["DIFFQ_MODEL_STORE_ENDPOINT"] = proxy.endpoint
    else:
        url = upload_gcs(server, folder)
        proxy = CuttableProxy(int(server.endpoint.rpartition(":")[2]))
        env["STORAGE_EMULATOR_HOST"] = proxy.endpoint
    size = sum(p.stat().st_size for p in _files(folder).values())
    proxy.start()
    proxy.cut_after(size // 3, 20.0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"i{i}", "prompt": f"a prompt {i}", "seed": 7 + i,
                                           "height": 64, "width": 64}) + "\n" for i in range(2)))
    images = {}
    for name, model in (("local", str(folder)), ("remote", url)):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "diffq", "run", str(prompts), "--model", model, "--out", str(out),
                               "--batch-size", "2", "--steps", "2", "--format", "png", "--no-progress"],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        images[name] = {p.name: Image.open(p).tobytes() for p in (out / "images").rglob("*.png")}
    assert len(images["local"]) == 2 and images["local"] == images["remote"]
    assert proxy.cuts == 1 and proxy.sent <= 1.1 * size, (proxy.sent, size)
    said = proc.stdout + proc.stderr
    assert re.search(rf"fetching weights: [\d.]+ of [\d.]+ GB, retrying {'S3' if store == 's3' else 'GCS'} "
                     r"\(connection (refused|dropped)\) for 0:\d\d", said), said[-3000:]
    (entry,) = [p for p in model_cache.iterdir() if p.is_dir()]
    _same_files(entry, folder)


def test_a_wait_is_said_in_the_log_and_on_the_runs_bar_and_patience_is_a_time_budget(tmp_path, monkeypatch, caplog):
    from diffq.app.run_out import TroubleView
    from diffq.worker.device import fetch_patience
    from diffq.worker.device.fetch_patience import FetchGaveUp, Patience

    monkeypatch.setenv("DIFFQ_TROUBLE_DIR", str(tmp_path / "notes"))
    (tmp_path / "notes").mkdir()
    clock = [1000.0]
    monkeypatch.setattr(fetch_patience, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0]),
                                                                   "sleep": staticmethod(lambda s: None)}))
    patience = Patience("S3", "s3://m/x", 600.0, total=2_000_000_000, done=500_000_000)
    view = TroubleView(open_storage(str(tmp_path / "out")), tmp_path / "notes")
    with caplog.at_level("WARNING", logger="diffq.worker"):
        patience.wait(ConnectionRefusedError("[Errno 111] Connection refused"), "big.safetensors", iter([0.0] * 9))
        clock[0] += 20
        patience.wait(ConnectionRefusedError("[Errno 111] Connection refused"), "big.safetensors", iter([0.0] * 9))
    line = "fetching weights: 0.50 of 2.00 GB, retrying S3 (connection refused) for 0:20"
    assert any(r.getMessage().startswith(line) for r in caplog.records)
    view.look(0.0, pending=1)
    assert view.fetching == line  # what the bar shows while the worker starts
    patience.moved(1_000_000)  # a byte arrived: the outage is over, its clock restarts
    assert patience.since is None and patience.line() == "fetching weights: 0.50 of 2.00 GB"
    with pytest.raises(PermissionError):  # what cannot heal is raised as it is, at once
        patience.wait(PermissionError("403"), "big.safetensors", iter([0.0]))
    patience.wait(TimeoutError("read timed out"), "big.safetensors", iter([0.0]))
    clock[0] += 600
    with pytest.raises(FetchGaveUp, match=r"file big\.safetensors: no byte from S3 for 10:00 \(timed out"):
        patience.wait(TimeoutError("read timed out"), "big.safetensors", iter([0.0]))
    patience.close()
    view._next_look = 0.0
    view.look(0.0, pending=1)
    assert view.fetching is None


def test_only_the_stores_answers_become_refusals():
    """A 403 is the store's refusal, named with the file; a local disk full or any other
    error of this node is raised as it is (the batch is retried, not failed for good);
    a refusal already made keeps its type."""
    import errno

    from botocore.exceptions import ClientError

    class Store:
        def refusal(self, exc, file):
            return model_fetch.ModelStoreError(f"model m: file {file}: {exc}")

    def failing(exc):
        def call():
            raise exc
        return call

    disk = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as raised:
        model_fetch._patiently(None, Store(), "unet.bin", failing(disk))
    assert raised.value is disk
    forbidden = ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
                            "GetObject")
    with pytest.raises(model_fetch.ModelStoreError, match="file unet.bin: .*AccessDenied"):
        model_fetch._patiently(None, Store(), "unet.bin", failing(forbidden))
    refused = FetchRefused("model m: file unet.bin: its parts add up to 10 bytes, the listing says 12")
    with pytest.raises(FetchRefused) as raised:
        model_fetch._patiently(None, Store(), "unet.bin", failing(refused))
    assert raised.value is refused


def test_a_record_of_pieces_that_cannot_be_read_is_said_and_its_file_fetched_from_the_start(tmp_path, caplog):
    """A `.ranges` record cut short (a disk full mid-write) keeps no piece: the fetch says
    so and starts the file over; a file never begun says nothing."""
    part = tmp_path / f"{model_fetch.PART_PREFIX}unet.bin"
    part.write_bytes(b"x" * 8)
    layout = {"size": 8, "pieces": [[0, 8]], "kind": "full", "algorithm": "CRC32"}
    with caplog.at_level("WARNING", logger="diffq.worker"):
        assert model_fetch._Ranges(part, layout).digests == {}
        assert not caplog.records
        model_fetch._Ranges(part, layout).add(0, b"\0\0\0\1")
        assert model_fetch._Ranges(part, layout).digests == {0: b"\0\0\0\1"}
        model_fetch._Ranges.path(part).write_text('{"layout": ')
        assert model_fetch._Ranges(part, layout).digests == {}
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("fetching weights: unet.bin: its record of completed pieces cannot be read (JSONDecodeError")
