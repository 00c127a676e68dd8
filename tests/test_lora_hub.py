"""Hub files and remote failures (issue 57), against a loopback stand-in for the Hub:
a `hf://OWNER/REPO@REV/PATH/FILE.safetensors@SCALE` adapter checked from its header,
pinned by commit at submit and fetched by the worker at that commit, all through
huggingface_hub's own code (HfApi.parse_safetensors_file_metadata, model_info,
hf_hub_download) pointed at the stand-in (its ENDPOINT and URL template, as HF_ENDPOINT
sets them); and every kind of remote adapter a submit cannot read — the Hub answering
404 or 403, object storage answering 403, holding no such key or not answering — ending at
`file:line: field 'lora': …` with nothing enqueued and no OUT, exit 2 from `plan`.
No network: the stand-in answers on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from diffq.core import adapters as A
from diffq.core.adapters import AdapterError
from tests.test_lora import flux, loras  # noqa: F401  (fixtures: tiny FLUX.1, adapters of ranks 4, 8, 16)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "some-org/styles"
FILE = "flux/ink.safetensors"


class StandInHub:
    """The Hub's few routes huggingface_hub uses here: a model's info (at a revision:
    `/api/models/REPO[/revision/REV]`, its commit) and a file at a revision
    (`/REPO/resolve/REV/PATH`, HEAD and ranged GET, with the Hub's X-Repo-Commit and
    ETag headers). `files`: repo -> {path: bytes}, all at COMMIT, which the branch `main`
    and the tag `v1` name too; `refuse`: repo -> the status its every route answers
    (404 RepoNotFound, 403 GatedRepo), as the Hub does. Every request is kept in `seen`."""

    def __init__(self, files: dict[str, dict[str, bytes]], refuse: dict[str, int] | None = None):
        self.files, self.refuse, self.seen = files, refuse or {}, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                hub.seen.append((self.command, self.path.split("?")[0]))
                route = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/?]+))?(\?.*)?", self.path)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path)
                repo = (route or resolve).group(1) if route or resolve else None
                if repo not in hub.files:
                    return self._error(hub.refuse.get(repo, 404), "RepoNotFound")
                if repo in hub.refuse:
                    return self._error(hub.refuse[repo], "GatedRepo" if hub.refuse[repo] == 403 else "RepoNotFound")
                revision = (route or resolve).group(2) or "main"
                if revision not in ("main", "v1", COMMIT):
                    return self._error(404, "RevisionNotFound")
                if route:
                    return self._send(200, json.dumps({"id": repo, "sha": COMMIT}).encode(),
                                      {"Content-Type": "application/json"}, body)
                data = hub.files[repo].get(resolve.group(3))
                if data is None:
                    return self._error(404, "EntryNotFound")
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Accept-Ranges": "bytes"}
                if (wanted := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")) and body:
                    start, end = int(wanted.group(1)), int(wanted.group(2) or len(data) - 1)
                    return self._send(206, data[start:end + 1], headers | {
                        "Content-Range": f"bytes {start}-{min(end, len(data) - 1)}/{len(data)}"}, body)
                return self._send(200, data, headers, body)

            def _error(self, status: int, code: str):
                self._send(status, json.dumps({"error": code}).encode(),
                           {"X-Error-Code": code, "Content-Type": "application/json"}, True)

            def _send(self, status: int, data: bytes, headers: dict, body: bool):
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(loras, tmp_path, monkeypatch):
    """The stand-in, with huggingface_hub pointed at it and a cache of its own."""
    from huggingface_hub import constants

    data = Path(loras[8]).read_bytes()
    stand_in = StandInHub({REPO: {FILE: data}, "some-org/gated": {FILE: data}}, refuse={"some-org/gated": 403})
    monkeypatch.setattr(constants, "ENDPOINT", stand_in.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        stand_in.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("DIFFQ_MODEL_CACHE", str(tmp_path / "model-cache"))  # where the worker keeps Hub files
    yield stand_in
    stand_in.close()


def test_a_hub_file_is_checked_pinned_by_commit_and_fetched_at_it(hub, flux, loras):
    from diffq.worker.device.adapters import AdapterCache

    run = A.RunAdapters(flux)
    (ref,) = run.add(f"hf://{REPO}@v1/{FILE}@0.8")
    assert (ref.path, ref.scale, ref.revision) == (f"hf://{REPO}@v1/{FILE}", 0.8, COMMIT)
    assert run.infos[ref.path].modules == A.inspect(loras[8]).modules  # its header, read from the Hub
    # The header by ranged reads at the revision named; the commit from the model's info.
    assert ("GET", f"/{REPO}/resolve/v1/{FILE}") in hub.seen and ("GET", f"/api/models/{REPO}/revision/v1") in hub.seen
    hub.seen.clear()
    loaded = AdapterCache().get(ref)
    expected = load_file(loras[8])
    assert loaded.state_dict.keys() == expected.keys()
    assert all(torch.equal(loaded.state_dict[key], expected[key]) for key in expected)
    # The worker fetched the file at the pinned commit, not at the tag the user typed,
    # into the model cache; a second worker process on the node asks the Hub nothing.
    assert {path for _, path in hub.seen} == {f"/{REPO}/resolve/{COMMIT}/{FILE}"}
    hub.seen.clear()
    assert AdapterCache().get(ref).nbytes == loaded.nbytes and hub.seen == []
    # A bare OWNER/REPO/FILE that is no local file is the same Hub file (a note says so).
    (bare,) = A.RunAdapters(flux).add(f"{REPO}/{FILE}")
    assert (bare.path, bare.revision) == (f"hf://{REPO}/{FILE}", COMMIT)


def test_a_hub_file_gone_after_submit_fails_its_batch_for_good_naming_it(hub, flux):
    from diffq.worker.device.adapters import AdapterCache
    from diffq.worker.device.lora_files import AdapterUnsupported

    (ref,) = A.RunAdapters(flux).add(f"hf://{REPO}/{FILE}")
    hub.files[REPO].clear()
    with pytest.raises(AdapterUnsupported, match=rf"adapter hf://{REPO}/{FILE}: .*EntryNotFound"):
        AdapterCache().get(ref)


def test_a_hub_unreachable_at_the_worker_is_left_to_the_batchs_retries(hub, flux, monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import _http

    from diffq.worker.device.adapters import AdapterCache
    from tests.test_lora_files import _closed_port

    (ref,) = A.RunAdapters(flux).add(f"hf://{REPO}/{FILE}")
    gone = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", gone)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", gone + "/{repo_id}/resolve/{revision}/{filename}")
    # huggingface_hub's own back-off between its tries (1 s doubling to 8 s) counted, not slept.
    waits = []
    monkeypatch.setattr(_http, "time", SimpleNamespace(sleep=waits.append))
    with pytest.raises(LocalEntryNotFoundError):  # not AdapterUnsupported: no permanent failure
        AdapterCache().get(ref)
    assert waits and max(waits) <= 8


# --- remote failures at submit and plan --------------------------------------------------


@pytest.mark.parametrize("kind", ["hub 404 repo", "hub 404 file", "hub 404 revision", "hub 403 gated",
                                  "s3 404 key", "s3 403", "s3 unreachable"])
def test_every_remote_refusal_is_file_line_field_exit_2_nothing_enqueued(kind, flux, loras, tmp_path, monkeypatch,
                                                                         request):
    from typer.testing import CliRunner

    from diffq.app.cli import app
    from diffq.producer.sources import InputError
    from diffq.producer.submit import submit
    from tests.test_lora_run import ARGS, Recording

    proxy = None
    if kind.startswith("hub"):
        request.getfixturevalue("hub")
        spec, says = {"hub 404 repo": (f"hf://some-org/nothing/{FILE}", "RepositoryNotFoundError"),
                      "hub 404 file": (f"hf://{REPO}/flux/other.safetensors", "EntryNotFoundError"),
                      "hub 404 revision": (f"hf://{REPO}@v2/{FILE}", "RevisionNotFoundError"),
                      "hub 403 gated": (f"hf://some-org/gated/{FILE}", "GatedRepoError")}[kind]
    else:
        from diffq.core.storage import open_storage
        from tests.proxy import CorruptingProxy
        from tests.servers import unique_bucket_name

        server = request.getfixturevalue("s3_server")
        bucket = f"s3://{server.make_bucket(unique_bucket_name())}"
        open_storage(bucket).upload_file(loras[8], "loras/r8.safetensors")
        if kind == "s3 unreachable":
            from tests.test_lora_files import _closed_port

            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
            spec, says = f"{bucket}/loras/r8.safetensors", "127.0.0.1"
        elif kind == "s3 403":
            proxy = CorruptingProxy(server.endpoint, corrupt="r8.safetensors", status=403, code="AccessDenied")
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.__enter__().endpoint)
            spec, says = f"{bucket}/loras/r8.safetensors", "AccessDenied"
        else:
            spec, says = f"{bucket}/loras/r9.safetensors", "no such file"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "p", "lora": spec}) + "\n")
    recording, out = Recording(), tmp_path / "out"
    try:
        with pytest.raises(InputError) as caught:
            submit(prompts, str(out), model=flux, publisher=recording, window=None, **ARGS)
        assert str(caught.value).startswith(f"{prompts}:2: field 'lora': "), str(caught.value)
        assert says in str(caught.value), str(caught.value)
        assert recording.published == [] and not out.exists()
        planned = CliRunner().invoke(app, ["plan", str(prompts), "--model", flux], env={"COLUMNS": "1000"})
        assert planned.exit_code == 2 and f"{prompts}:2: field 'lora': " in planned.output, planned.output
        assert "Traceback" not in planned.output
    finally:
        if proxy is not None:
            proxy.__exit__(None, None, None)
