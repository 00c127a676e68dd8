"""Hostile input and secrets: keys cannot escape, out prefixes are enforced,
credentials never reach messages, manifests, records, status or logs, TLS works."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
from diffq.results.status import status
from diffq.producer.submit import submit
from diffq.worker.delivery.spec import ChildSpec
from tests.helpers import assert_run_complete, start_workers, wait_until

SECRET = "s3cr3t-Pa55w0rd"


def test_worker_refuses_out_outside_allowed_prefixes(tmp_path):
    pytest.importorskip("torch")
    from diffq.worker.delivery.tasks import OutNotAllowed, Runtime
    from diffq.worker.device.pipeline_host import PipelineHost
    from diffq.worker.device.backends import get_backend

    spec = ChildSpec(name="w", broker_url="memory://", queues=["q"],
                     allowed_out_prefixes=[str(tmp_path / "allowed")])
    from diffq.worker.sink.store import Sink

    runtime = Runtime(spec=spec, host=PipelineHost(backend=get_backend("cpu")), sink=Sink())
    assert runtime.storage_for(str(tmp_path / "allowed" / "run1")).url.endswith("run1")
    for hostile in (str(tmp_path / "elsewhere"), "s3://other-bucket/x", "/etc",
                    str(tmp_path / "allowed-evil" / "run"), str(tmp_path / "allowed" / ".." / "escaped")):
        with pytest.raises(OutNotAllowed):
            runtime.storage_for(hostile)
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "escaped").exists()


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["redis-password", "rediss-tls-password"])
def test_credentials_never_leak_and_tls_works(tmp_path, make_redis_server, tiny_model, tls, capfd):
    server = make_redis_server(password=SECRET, tls=tls)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"x{i}", "prompt": f"p {i}", "height": 64, "width": 64}) + "\n"
                               for i in range(4)))
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=2, steps=1)
    # Every queued message, read before any worker drains them: none holds the password
    # (the run folder URL is all they carry).
    import redis

    client = redis.Redis.from_url(server.url)
    queued = [body for key in client.scan_iter("diffq.*", _type="list") for body in client.lrange(key, 0, -1)]
    assert len(queued) == result.batches == 2
    for body in queued:
        envelope = json.loads(body)
        decoded = base64.b64decode(envelope["body"]) if envelope["properties"].get("body_encoding") == "base64" \
            else envelope["body"].encode()
        assert b"batch_id" in decoded  # really a batch, read as the worker reads it
        assert SECRET.encode() not in body and SECRET.encode() not in decoded
    supervisor = start_workers(server.url, list(result.queues), tiny_model, n=1, loglevel="INFO")
    try:
        wait_until(out, supervisor, lambda s: s.done >= 4, timeout=120)
    finally:
        supervisor.stop(timeout=60)
    assert status(out).done == 4
    assert_run_complete(out, prompts, steps=1, model=tiny_model)

    # Nothing stored in the run folder mentions the password.
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    # Nor does what the workers logged, nor `diffq status`.
    captured = capfd.readouterr()
    assert SECRET not in captured.out + captured.err
    proc = subprocess.run([sys.executable, "-m", "diffq", "status", out, "--json"],
                          capture_output=True, text=True, check=True)
    assert SECRET not in proc.stdout + proc.stderr


def test_message_schema_carries_no_broker_and_rejects_credentials_in_out():
    from diffq.core.storage import StorageError, open_storage

    with pytest.raises(StorageError) as info:
        open_storage(f"s3://AKIA:{SECRET}@bucket/prefix")
    assert SECRET not in str(info.value)
    message = BatchMessage(run_id="r", out="/tmp/o", batch_id="b", params=BatchParams(num_inference_steps=1, guidance_scale=1),
                           shape=ShapeKey(model="m", height=64, width=64, batch_size=1, max_sequence_length=8, cfg=False),
                           items=[BatchItem(id="a", prompt="p", seed=1)])
    assert set(message.model_dump()) == {"schema_version", "run_id", "out", "batch_id", "shape", "params", "items"}
