"""Where a model comes from: a local folder, the HF cache, the Hub, or object storage
(s3:// or gs://, fetched into the node-local cache by worker/device/model_fetch.py). Torch-free,
so the producer and the embedded runner can check a model before spawning workers."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit


class ModelUnavailable(RuntimeError):
    pass


def _hub_reachable(timeout: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlsplit(endpoint).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_model(model: str) -> str:
    """A local folder, a cached hub id, or a hub id we can download — else fail fast.

    Without this, `from_pretrained` of a hub id on an offline machine retries for
    minutes before saying anything useful. An object-storage model is listed, not
    fetched: it must hold a diffusers pipeline.
    """
    from diffq.core.model_store import ModelStoreError, is_model_url, list_model

    if is_model_url(model):
        try:
            list_model(model)
        except ModelStoreError as exc:
            raise ModelUnavailable(str(exc)) from exc
        return model
    if Path(model).is_dir():
        if not (Path(model) / "model_index.json").is_file():
            raise ModelUnavailable(f"{model} is a folder but holds no diffusers pipeline (no model_index.json)")
        return model
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, "model_index.json"), str):
        return model
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline or not _hub_reachable():
        raise ModelUnavailable(
            f"model '{model}' is not a local folder, not in the Hugging Face cache "
            f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}), and the Hub is "
            f"{'disabled (HF_HUB_OFFLINE)' if offline else 'unreachable'}. Pre-download it "
            f"(huggingface-cli download {model}) onto shared storage, or pass a local path; "
            f"for tests use `diffq tiny-pipeline DIR`."
        )
    return model


def local_model(model: str, revision: str | None = None):
    """(the source `from_pretrained` reads, the fetch report or None): an object-storage
    model fetched into the node-local cache (at `revision`, the run's pin, or refused),
    anything else as `resolve_model` finds it."""
    from diffq.core.model_store import ModelStoreError, StoreUnreachable, is_model_url

    if not is_model_url(model):
        return resolve_model(model), None
    from diffq.worker.device.model_fetch import fetch

    try:
        fetched = fetch(model, revision)
    except StoreUnreachable:
        raise  # not permanent: the batch is retried
    except ModelStoreError as exc:
        raise ModelUnavailable(str(exc)) from exc
    return fetched.path, fetched
