"""One worker process per device: its spec, its environment, and its entry point.

`child_main` runs in a *spawned* child. It sets the pinning environment from the
backend table before anything imports torch (Neuron and TPU read it once, during
`import torch`), then starts a Celery solo-pool worker on the spec's queues.
This module itself must stay torch-free: the supervisor imports it.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import warnings

from pydantic import BaseModel, ConfigDict, Field

from diffq.worker.backends import Backend, get_backend

# Exit code for a child that can never succeed (bad model, bad option): the
# supervisor must not restart it in a loop.
EXIT_FATAL = 3


class ChildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    device: str = "cpu"
    slot: int = 0  # the device index this process is pinned to
    threads: int = 1
    broker_url: str
    transport_options: dict = Field(default_factory=dict)
    queues: list[str]
    compile: str = "none"
    offload: str | None = None
    compile_cache: str | None = None
    warmup: list[str] = Field(default_factory=list)
    # Loaded before consuming, so a missing model fails the process at once.
    models: list[str] = Field(default_factory=list)
    dtype: str = "float32"
    allowed_out_prefixes: list[str] = Field(default_factory=list)
    loglevel: str = "WARNING"

    @property
    def backend(self) -> Backend:
        return get_backend(self.device)

    def env(self) -> dict[str, str]:
        """What this child adds to its environment before `import torch`."""
        backend = self.backend
        env = dict(backend.base_env)
        env.update(backend.pin(self.slot, self.threads))
        env.update(backend.mode_env.get(self.compile, {}))
        cache = self.compile_cache or backend.default_cache
        if cache and "://" not in cache:
            env[backend.cache_env] = cache
        env["DIFFQ_WORKER_NAME"] = self.name
        return env

    def plan(self) -> dict:
        backend = self.backend
        return {
            "name": self.name,
            "device": backend.torch_device,
            "slot": self.slot,
            "env": self.env(),
            "queues": self.queues,
            "compile": self.compile,
            "compile_backend": backend.compile_backend,
            "cache_env": backend.cache_env,
            "dist_backend": backend.dist_backend,
        }


def hostname() -> str:
    return socket.gethostname()


# Library chatter (per-process load bars, torchvision fallbacks) would drown the
# run's own output when N workers start at once.
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def child_main(spec_json: str) -> None:
    spec = ChildSpec.model_validate_json(spec_json)
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.update(spec.env())
    warnings.filterwarnings("ignore", message=".*superuser privileges.*")

    import torch  # noqa: E402 - deliberately after pinning

    torch.set_num_threads(spec.threads)
    if spec.backend.extension:
        importlib.import_module(spec.backend.extension)

    from diffq.worker.tasks import build_worker_app, preload

    app = build_worker_app(spec)
    try:
        preload(spec)
    except Exception as exc:  # a model that cannot load will not load on retry either
        print(f"diffq worker {spec.name}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FATAL)
    argv = [
        "--quiet",
        "worker",
        "--pool=solo",
        "--concurrency=1",
        "--prefetch-multiplier=1",
        f"--queues={','.join(spec.queues)}",
        f"--hostname={spec.name}@{hostname()}",
        f"--loglevel={spec.loglevel}",
        "--without-mingle",
        "--without-gossip",
    ]
    try:
        app.worker_main(argv)
    except SystemExit as exc:
        sys.exit(exc.code)
