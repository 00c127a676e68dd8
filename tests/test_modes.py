"""Every mode the backend table offers runs, or is shown installable where it would run.

The walk is device × compile mode × offload, read from worker/device/backends.py (BACKENDS,
`compile_modes`, OFFLOAD_MODES), and `check()` decides what is offered. Each offered
combination needs packages and tools; the image that runs a device
(infra/docker/Dockerfile.<device>) must provide them: what it pip-installs (pyproject's
dependencies and extras for `.` / `.[extra]`, ARG defaults substituted) and what it
apt-installs. On cpu every combination also runs here, through the worker's own
PipelineHost on a tiny pipeline, with `--offload model`'s accelerate hooks checked on
every component.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import shlex
import tomllib
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from diffq.core.contract import BatchItem, BatchParams, ShapeKey
from diffq.worker.device.backends import BACKENDS, COMPILING_MODES, OFFLOAD_MODES, get_backend
from diffq.worker.device.pipeline_host import PipelineHost
from tests.test_infra import dockerfile

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def modes() -> list[tuple[str, str, str | None]]:
    """(device, compile, offload) for every combination the backend table offers."""
    offered = []
    for name, backend in BACKENDS.items():
        for compile_mode in backend.compile_modes:
            for offload in (None, *OFFLOAD_MODES):
                try:
                    backend.check(compile=compile_mode, offload=offload)
                except ValueError:
                    continue  # refused before anything starts (tests/test_backends.py pins why)
                offered.append((name, compile_mode, offload))
    return offered


MODES = modes()


def test_the_walk_covers_every_device_compile_mode_and_offload():
    assert {d for d, _, _ in MODES} == set(BACKENDS)
    for name, backend in BACKENDS.items():
        assert {c for d, c, _ in MODES if d == name} == set(backend.compile_modes)
    assert {o for _, _, o in MODES} == {None, *OFFLOAD_MODES}


# --- what a mode needs -------------------------------------------------------------------

def offload_module() -> str:
    """The package diffusers' enable_model_cpu_offload() imports (read from its source)."""
    from diffusers import DiffusionPipeline

    source = inspect.getsource(DiffusionPipeline.enable_model_cpu_offload)
    return re.search(r"from (\w+) import cpu_offload_with_hook", source).group(1)


def inductor_tools(torch_device: str) -> set[str]:
    """Executables Inductor's code generation runs on this device."""
    if torch_device == "cpu":
        from torch._inductor import config

        return {config.cpp.cxx[-1]}  # C++ kernels (g++)
    if torch_device == "cuda":
        return {"gcc"}  # Triton builds its launcher with the system C compiler (triton/runtime/build.py)
    return set()


def needs(device: str, compile_mode: str, offload: str | None) -> tuple[set[str], set[str]]:
    """(Python distributions, executables) a worker in this mode imports or runs."""
    backend = get_backend(device)
    packages = {"diffq", "torch", "diffusers"}
    if backend.extension:
        packages.add(backend.extension)  # imported after torch (torch_neuronx, torch_tpu)
    compiles = compile_mode in COMPILING_MODES or backend.eager_compiles
    if compiles:
        packages |= set(backend.cache_packages)  # what its compiled artefacts depend on (neuronx-cc, triton …)
    tools = inductor_tools(backend.torch_device) if compile_mode in COMPILING_MODES and \
        backend.compile_backend == "inductor" else set()
    if offload == "model":
        packages.add(offload_module())
    return {canonicalize_name(p) for p in packages}, tools


# --- what an image provides -----------------------------------------------------------------

PIP_VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                     "-r", "--requirement", "-t", "--target", "--prefix", "--root", "--trusted-host"}
# Debian / Ubuntu packages that put an executable on PATH (g++ depends on gcc).
APT_PROVIDES = {"g++": {"g++", "build-essential"}, "gcc": {"gcc", "g++", "build-essential"}}
# Brought by PyPI's Linux x86_64 torch wheel, the CUDA build (its Requires-Dist);
# the CPU index's wheel does not bring them.
CUDA_TORCH_BRINGS = {"triton"}


def project_packages(extras: str) -> set[str]:
    """What installing this project (`.` or `.[a,b]`) installs: itself, its dependencies, the extras'."""
    specs = list(PYPROJECT["project"]["dependencies"])
    for extra in filter(None, (e.strip() for e in extras.split(","))):
        specs += PYPROJECT["project"]["optional-dependencies"][extra]
    return {"diffq", *(canonicalize_name(Requirement(spec).name) for spec in specs)}


@dataclasses.dataclass
class Installs:
    packages: set[str] = dataclasses.field(default_factory=set)
    apt: set[str] = dataclasses.field(default_factory=set)
    torch_index: str | None = "pypi"  # where torch came from: "pypi" or the --index-url given


def shell_installs(commands: list[str], variables: dict[str, str]) -> Installs:
    """The pip and apt-get installs of these shell command lines."""
    found = Installs()
    for text in commands:
        text = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)
        words = shlex.split(text, comments=True)
        for command in _split(words, {"&&", "||", ";"}):
            if command[:2] == ["apt-get", "install"]:
                found.apt |= {w for w in command[2:] if not w.startswith("-")}
                continue
            at = next((i for i, w in enumerate(command) if w in ("pip", "pip3") or w.endswith("/pip")
                       or w == "-m" and command[i + 1:i + 2] == ["pip"]), None)
            args = command[at + 1:] if at is not None else []
            if "install" not in args:
                continue
            args = args[args.index("install") + 1:]
            specs, index, i = [], "pypi", 0
            while i < len(args):
                if args[i] in ("-e", "--editable"):
                    specs.append(args[i + 1])
                    i += 2
                    continue
                if args[i] in PIP_VALUE_OPTIONS:
                    if args[i] in ("-i", "--index-url"):
                        index = args[i + 1]
                    i += 2
                    continue
                if not args[i].startswith("-"):
                    specs.append(args[i])
                i += 1
            for spec in specs:
                local = re.fullmatch(r"\.(?:\[([^\]]*)\])?", spec)
                if local:
                    found.packages |= project_packages(local.group(1) or "")
                    continue
                name = canonicalize_name(Requirement(spec).name)
                found.packages.add(name)
                if name == "torch":
                    found.torch_index = index
    return found


def _split(words: list[str], operators: set[str]) -> list[list[str]]:
    commands, current = [], []
    for word in words:
        if word in operators:
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in (*commands, current) if c]


def image_installs(device: str) -> Installs:
    instructions = dockerfile(ROOT / "infra" / "docker" / f"Dockerfile.{device}")
    variables = {}
    for kind, args in instructions:
        if kind == "ARG" and "=" in args:
            name, _, value = args.partition("=")
            variables[name.strip()] = shlex.split(value)[0] if value else ""
    return shell_installs([args for kind, args in instructions if kind == "RUN"], variables)


def missing(installs: Installs, packages: set[str], tools: set[str]) -> list[str]:
    cuda_torch = "torch" in installs.packages and installs.torch_index == "pypi"
    gaps = [f"Python package {p}" for p in sorted(packages)
            if p not in installs.packages and not (p in CUDA_TORCH_BRINGS and cuda_torch)]
    gaps += [f"executable {t} (apt-get install {' or '.join(sorted(APT_PROVIDES[t]))})" for t in sorted(tools)
             if not APT_PROVIDES[t] & installs.apt]
    return gaps


@pytest.mark.parametrize("device, compile_mode, offload", MODES)
def test_the_image_that_runs_a_mode_installs_what_it_needs(device, compile_mode, offload):
    packages, tools = needs(device, compile_mode, offload)
    gaps = missing(image_installs(device), packages, tools)
    assert not gaps, (f"--device {device} --compile {compile_mode}{' --offload ' + offload if offload else ''}: "
                      f"infra/docker/Dockerfile.{device} lacks " + ", ".join(gaps))


def test_make_setup_installs_what_every_cpu_mode_needs():
    # `make setup` (and so `make test`) is the image of this machine.
    recipe = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("\t")]
    installs = shell_installs([line for line in recipe if "pip install" in line and ".[" in line], {})
    assert "accelerate" in installs.packages
    for device, compile_mode, offload in MODES:
        if device == "cpu":
            assert not missing(installs, needs(device, compile_mode, offload)[0], set()), (compile_mode, offload)


def test_the_image_check_finds_what_is_missing():
    # The checker is not vacuous: a bare image lacks everything, a cpu-index torch brings no triton.
    bare = shell_installs(['pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu'], {})
    assert bare.torch_index.endswith("/whl/cpu") and bare.packages == {"torch"}
    assert missing(bare, *needs("cuda", "full", "model")) == [
        "Python package accelerate", "Python package diffq", "Python package diffusers", "Python package triton",
        "executable gcc (apt-get install build-essential or g++ or gcc)"]
    full = shell_installs(["apt-get update && apt-get install -y --no-install-recommends g++",
                           'pip install "torch==2.13.0" && pip install ".[neuron]"'], {})
    assert missing(full, *needs("cuda", "full", "model")) == []
    assert {"torch-neuronx", "neuronx-cc", "nki", "accelerate"} <= full.packages


# --- cpu: each mode runs here ------------------------------------------------------------------

SHAPE = dict(height=32, width=32, batch_size=1, max_sequence_length=16, cfg=False)
PARAMS = BatchParams(num_inference_steps=1, guidance_scale=1.0)
ITEMS = [BatchItem(id="a", prompt="a red cat", seed=7)]


def offload_hooks(pipe) -> dict[str, str]:
    """Each torch module of the pipeline and the accelerate hook on it (None: none)."""
    import torch

    return {name: type(getattr(module, "_hf_hook", None)).__name__
            for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


@pytest.fixture
def hook_calls(monkeypatch):
    """Which modules accelerate's CpuOffload hook moved to the execution device, in call order."""
    from accelerate.hooks import CpuOffload

    calls, real = [], CpuOffload.pre_forward

    def counting(self, module, *args, **kwargs):
        calls.append(type(module).__name__)
        return real(self, module, *args, **kwargs)

    monkeypatch.setattr(CpuOffload, "pre_forward", counting)
    return calls


def test_offload_model_installs_accelerate_hooks_and_generates_through_them(tiny_model, hook_calls):
    """--offload model on this machine, as far as it goes: diffusers refuses
    enable_model_cpu_offload() without an accelerator unless it is given a device, which
    the host passes (the backend's torch device), so on cpu the hooks are real and run;
    they move each model to cpu:0, so the pixels must equal the resident pipeline's."""
    shape = ShapeKey(model=tiny_model, **SHAPE)
    resident = PipelineHost(backend=get_backend("cpu")).generate(shape, PARAMS, ITEMS)
    host = PipelineHost(backend=get_backend("cpu"), offload="model")
    offloaded = host.generate(shape, PARAMS, ITEMS)
    pipe = host.pipeline(tiny_model, "float32")
    assert set(offload_hooks(pipe).values()) == {"CpuOffload"}, offload_hooks(pipe)
    assert str(pipe._offload_device) == "cpu:0" and len(pipe._all_hooks) == len(offload_hooks(pipe))
    # Every model of the pipeline went through its hook during the call, in the pipeline's order.
    modules = {type(m).__name__: name for name, m in pipe.components.items() if name in offload_hooks(pipe)}
    assert [modules[c] for c in dict.fromkeys(hook_calls)] == pipe.model_cpu_offload_seq.split("->")
    assert np.array_equal(offloaded.images[0], resident.images[0])


@pytest.fixture(scope="module")
def resident_image(tiny_model):
    """The eager, resident pipeline's image: what every cpu mode must reproduce."""
    return PipelineHost(backend=get_backend("cpu")).generate(ShapeKey(model=tiny_model, **SHAPE), PARAMS,
                                                             ITEMS).images[0]


@pytest.mark.parametrize("compile_mode, offload", [(c, o) for d, c, o in MODES if d == "cpu"])
def test_every_cpu_mode_generates(tiny_model, resident_image, compile_mode, offload, hook_calls):
    """Each offered cpu combination through the worker's PipelineHost. Compiling modes
    trace the real transformer (whole, or its repeated blocks, inside the offload hooks)
    with the table's fullgraph / static-shape options; the graphs then run on dynamo's
    eager backend rather than Inductor to keep this quick (test_compile.py runs Inductor
    for real, and the image check above covers its compiler)."""
    shape = ShapeKey(model=tiny_model, **SHAPE)
    backend = get_backend("cpu")
    compiles = compile_mode in COMPILING_MODES
    if compiles:
        backend = dataclasses.replace(backend, compile_backend="eager")
    host = PipelineHost(backend=backend, compile_mode=compile_mode, offload=offload)
    generated = host.generate(shape, PARAMS, ITEMS)
    assert generated.compiled is compiles
    assert (host.compile_graphs.get(shape.queue, 0) >= 1) is compiles, host.compile_graphs
    hooks = set(offload_hooks(host.pipeline(tiny_model, "float32")).values())
    assert hooks == ({"CpuOffload"} if offload else {"NoneType"}) and bool(hook_calls) is bool(offload)
    assert np.array_equal(generated.images[0], resident_image)
