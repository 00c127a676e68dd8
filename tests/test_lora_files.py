"""LoRA files as people have them (core/adapters.py FILE_LAYOUTS, worker/device/lora_files.py):
kohya / sd-scripts files (fused qkv, `.alpha` keys; also under ComfyUI's `diffusion_model.`),
XLabs files and raw PEFT saves, built here for the tiny FLUX.1 transformer, served by the
worker's pipeline host with the pixels of the same adapter converted by diffusers' own
`FluxPipeline.lora_state_dict` and of diffusers' ordinary `load_lora_weights`; a
text-encoder part refused or dropped; per-module alphas, use_rslora and the mixed ranks
of a kohya conversion against diffusers; what a converter would drop refused by name;
remote failures as file:line:field; `pin` reading each revision once; the spellings
other tools use. The whole `diffq run` over these files is tests/test_lora_files_run.py."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffq.core import adapters as A
from diffq.core.adapters import AdapterError
from diffq.core.contract import BatchParams, ShapeKey
from diffq.worker.device.backends import get_backend
from diffq.worker.device.pipeline_host import PipelineHost
from tests.test_lora import BATCH, SIDE, STEPS, _items, _pixels, _plain, flux, loras  # noqa: F401  (fixtures)

# lora_up's gain: the images move well above what rounding changes.
GAIN = 4.0
# Pixels of one adapter served two ways that must be the same, in 8-bit levels.
SAME = 2
# The least an adapter must move some pixel for a test to call it visible.
VISIBLE = 8

_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_ADD_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
# The modules the kohya files carry, in ComfyUI's dotted names (kohya's: `lora_unet_`
# and underscores) → the tiny FLUX.1 modules diffusers' converter maps each to.
KOHYA = {
    "double_blocks.0.img_attn.qkv": tuple(f"transformer_blocks.0.{t}" for t in _QKV),
    "double_blocks.0.img_attn.proj": ("transformer_blocks.0.attn.to_out.0",),
    "double_blocks.0.txt_attn.qkv": tuple(f"transformer_blocks.0.{t}" for t in _ADD_QKV),
    "double_blocks.0.img_mlp.0": ("transformer_blocks.0.ff.net.0.proj",),
    "single_blocks.0.linear2": ("single_transformer_blocks.0.proj_out",),
}
XLABS = {
    "double_blocks.0.processor.qkv_lora1": KOHYA["double_blocks.0.img_attn.qkv"],
    "double_blocks.0.processor.proj_lora1": ("transformer_blocks.0.attn.to_out.0",),
    "double_blocks.0.processor.qkv_lora2": KOHYA["double_blocks.0.txt_attn.qkv"],
    "double_blocks.0.processor.proj_lora2": ("transformer_blocks.0.attn.to_add_out",),
    "single_blocks.0.processor.qkv_lora": tuple(f"single_transformer_blocks.0.{t}" for t in _QKV),
}
# A kohya text-encoder key (CLIP-L's first layer), as sd-scripts writes it beside the transformer's.
TE = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
RANK = 6  # a fused qkv of rank 6 that is block-sparse splits into three of rank 2: mixed ranks


def _random(flux, modules: dict, seed: int, *, sparse: tuple[str, ...] = ()) -> dict:
    """Per module: (down, up) for its targets' shapes in the tiny transformer; a `sparse`
    module's up weight block-diagonal (each projection its own third of the rank)."""
    weights = A.transformer_weights(flux)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for module, targets in modules.items():
        in_features = weights[f"{targets[0]}.weight"][1]
        sizes = [weights[f"{target}.weight"][0] for target in targets]
        down = torch.randn(RANK, in_features, generator=generator) / in_features ** 0.5
        up = torch.randn(sum(sizes), RANK, generator=generator) * GAIN / RANK ** 0.5
        if module in sparse:
            up = up * torch.block_diag(*(torch.ones(size, RANK // len(targets)) for size in sizes))
        out[module] = (down, up)
    return out


def _kohya(tensors: dict, path, *, comfy: bool = False, extra: dict | None = None) -> str:
    state_dict = {}
    for module, (down, up) in tensors.items():
        name = f"diffusion_model.{module}" if comfy else "lora_unet_" + module.replace(".", "_")
        state_dict |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                       f"{name}.alpha": torch.tensor(RANK / 2)}  # alpha/rank 0.5: folded in by the converter
    save_file({**state_dict, **(extra or {})}, str(path))
    return str(path)


def _converted_by_diffusers(path: str, out) -> str:
    """The file in diffusers' layout as diffusers' own public converter makes it."""
    from diffusers import FluxPipeline

    state_dict = FluxPipeline.lora_state_dict(path)
    save_file({key: value.contiguous().clone() for key, value in state_dict.items()}, str(out))
    return str(out)


def _with_config(flux, out, **config) -> str:
    """A PEFT-built adapter in diffusers' layout whose LoraConfig diffusers writes into the
    file (per-module alphas and ranks, use_rslora), random A and B."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        transformer.add_adapter(LoraConfig(**config, init_lora_weights=False))
    layers = {key: value * GAIN if ".lora_B." in key else value
              for key, value in get_peft_model_state_dict(transformer).items()}
    FluxPipeline.save_lora_weights(str(out.parent), transformer_lora_layers=layers, weight_name=out.name,
                                   transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict())
    return str(out)


@pytest.fixture(scope="module")
def files(flux, loras, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-files")
    kohya = _random(flux, KOHYA, seed=1, sparse=("double_blocks.0.img_attn.qkv",))
    te = {f"{TE}.lora_down.weight": torch.randn(4, 32), f"{TE}.lora_up.weight": torch.randn(32, 4),
          f"{TE}.alpha": torch.tensor(4.0)}
    paths = {
        "kohya": _kohya(kohya, root / "kohya.safetensors"),
        "comfyui": _kohya(kohya, root / "comfyui.safetensors", comfy=True),
        "kohya+te": _kohya(kohya, root / "kohya-te.safetensors", extra=te),
        "xlabs": str(root / "xlabs.safetensors"),
        "peft": str(root / "peft.safetensors"),
        "alphas": _with_config(flux, root / "alphas.safetensors", r=8, lora_alpha=4,
                               target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                               rank_pattern={"to_k": 4}, alpha_pattern={"to_q": 16}),
        "rslora": _with_config(flux, root / "rslora.safetensors", r=8, lora_alpha=8, use_rslora=True,
                               target_modules=["to_q", "to_v"]),
    }
    save_file({f"{module}.{kind}.weight": tensor for module, (down, up) in _random(flux, XLABS, seed=2).items()
               for kind, tensor in (("down", down), ("up", up))}, paths["xlabs"])
    save_file({A.PEFT_PREFIX + key.removeprefix(A.TRANSFORMER_PREFIX): value
               for key, value in load_file(loras[8]).items()}, paths["peft"])
    paths["kohya by diffusers"] = _converted_by_diffusers(paths["kohya"], root / "kohya-diffusers.safetensors")
    paths["xlabs by diffusers"] = _converted_by_diffusers(paths["xlabs"], root / "xlabs-diffusers.safetensors")
    return paths


def _shape(flux) -> ShapeKey:
    return ShapeKey(model=flux, height=SIDE, width=SIDE, batch_size=BATCH, max_sequence_length=16, cfg=False,
                    dtype="float32")


def _served(flux, specs: dict[str, object], model_cache) -> dict[str, np.ndarray]:
    """Each spec's pixels (and none's) from one eager host over the run's layout of them all."""
    run = A.RunAdapters(flux)
    refs = {name: run.add(spec, f"lora[{n}]") for n, (name, spec) in enumerate(specs.items())}
    host = PipelineHost(backend=get_backend("cpu"), compile_mode="none")
    host.use_adapters(flux, run.layout)
    pixels = {}
    for name, adapters in [("none", ()), *refs.items()]:
        generated = host.generate(_shape(flux), BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                                            adapters=adapters), _items())
        pixels[name] = _pixels(generated.images)
    return pixels


def _apart(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a - b).max())


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFQ_MODEL_CACHE", str(tmp_path / "model-cache"))
    return tmp_path / "model-cache"


# --- layouts told apart and checked, torch-free -----------------------------------------


def test_each_layout_is_told_from_its_key_names_and_mapped_to_the_modules_diffusers_makes(flux, files):
    expected = {"kohya": "kohya", "comfyui": "comfyui", "kohya+te": "kohya", "xlabs": "xlabs", "peft": "peft",
                "kohya by diffusers": "diffusers", "alphas": "diffusers"}
    for name, layout in expected.items():
        info = A.inspect(files[name])
        assert info.layout == layout, name
        # The producer's torch-free mapping names exactly the modules diffusers' conversion holds.
        if name in ("kohya", "xlabs"):
            converted = load_file(files[f"{name} by diffusers"])
            assert info.targets == {key[len("transformer."):].rpartition(".lora_")[0] for key in converted}
    assert set(A.inspect(files["kohya+te"]).text_encoder_keys) == {
        f"{TE}.{kind}" for kind in ("alpha", "lora_down.weight", "lora_up.weight")}
    # Pinned refs say what the file was; a diffusers file says nothing (records as before).
    run = A.RunAdapters(flux)
    (kohya,) = run.add(files["kohya"])
    (plain,) = run.add(files["kohya by diffusers"])
    assert kohya.file_layout == "kohya" and kohya.text_encoder is None
    assert plain.model_dump(mode="json") == {"path": files["kohya by diffusers"], "scale": 1.0,
                                             "revision": plain.revision}


def test_foreign_layouts_on_families_that_do_not_convert_them_are_refused_by_name(tiny_pipelines, files):
    klein = tiny_pipelines["flux2-klein"]
    for name in ("kohya", "xlabs"):
        with pytest.raises(AdapterError, match=rf"a {name} file .*for Flux2KleinPipeline diffq takes diffusers, peft"):
            A.RunAdapters(klein).add(files[name])


@pytest.mark.parametrize("extra, says", [
    ({"lora_unet_double_blocks_0_img_attn_proj.diff_b": [32]}, "a bias or norm delta"),
    ({"lora_unet_img_in.lora_down.weight": [6, 64], "lora_unet_img_in.lora_up.weight": [32, 6]},
     "maps no FLUX.1 transformer module from 'lora_unet_img_in'"),
    ({"lora_unet_double_blocks_0_img_attn_proj.dora_scale": [1, 32]}, "a DoRA adapter"),
    ({"lora_unet_single_blocks_0_linear1.lora_down.weight": [6, 32],
      "lora_unet_single_blocks_0_linear1.lora_up.weight": [160, 6]}, "FLUX.1's 3072\\+3072\\+3072\\+12288"),
])
def test_what_diffusers_converter_would_drop_or_break_is_refused_naming_the_key(flux, tmp_path, extra, says):
    tensors = {key: torch.zeros(*shape) for key, shape in extra.items()}
    path = _kohya(_random(flux, KOHYA, seed=3), tmp_path / "odd.safetensors", extra=tensors)
    with pytest.raises(AdapterError, match=says) as caught:
        A.RunAdapters(flux).add(path, "lora")
    assert caught.value.field == "lora"


# --- the pixels -------------------------------------------------------------------------


def test_kohya_comfyui_xlabs_and_peft_files_give_the_pixels_of_their_diffusers_layout(flux, loras, files, model_cache):
    pixels = _served(flux, {name: files[name] for name in ("kohya", "kohya by diffusers", "comfyui", "xlabs",
                                                           "xlabs by diffusers", "peft")} | {
        "loras[8]": loras[8], "kohya+te": {"path": files["kohya+te"], "text_encoder": "drop"}}, model_cache)
    for name, reference in [("kohya", "kohya by diffusers"), ("comfyui", "kohya by diffusers"),
                            ("kohya+te", "kohya by diffusers"), ("xlabs", "xlabs by diffusers"),
                            ("peft", "loras[8]")]:
        assert _apart(pixels[name], pixels[reference]) <= SAME, name
        assert _apart(pixels[name], pixels["none"]) > VISIBLE, name
    # Converted once per file and revision, kept beside the model cache.
    kept = sorted(p.name.rpartition("-")[2] for p in (model_cache / "lora-converted").iterdir())
    assert kept == ["comfyui.safetensors", "kohya.safetensors", "kohya.safetensors", "xlabs.safetensors"]


def test_alphas_rslora_and_a_kohya_conversions_mixed_ranks_match_diffusers_load_lora_weights(flux, files,
                                                                                              model_cache):
    info = A.inspect(files["alphas"])
    assert info.config["alpha_pattern"] == {"to_q": 16} and info.ranks == {4, 8}
    pixels = _served(flux, {name: files[name] for name in ("alphas", "rslora", "kohya")}, model_cache)
    for name in ("alphas", "rslora", "kohya"):
        plain = _plain(flux, False, files[name])  # diffusers' own load_lora_weights, uncompiled like the host
        assert _apart(pixels[name], plain) <= SAME, name
        assert _apart(pixels[name], pixels["none"]) > VISIBLE, name


def test_configs_a_hot_swap_was_thought_to_refuse_are_taken(tmp_path):
    from tests.test_lora import _safetensors

    q = "transformer.transformer_blocks.0.attn.to_q"
    config = {"transformer.use_rslora": True, "transformer.lora_dropout": 0.1, "transformer.r": 4,
              "transformer.alpha_pattern": {"to_q": 2}}
    path = _safetensors(tmp_path / "a.safetensors", {f"{q}.lora_A.weight": [4, 32], f"{q}.lora_B.weight": [32, 4]},
                        {"lora_adapter_metadata": json.dumps(config)})
    assert A.inspect(path).config["use_rslora"] is True


def test_the_worker_scalings_follow_peft(files):
    from diffq.worker.device.lora_files import scalings

    info = A.inspect(files["alphas"])
    state_dict = {f"transformer.{m}.lora_A.weight": torch.zeros(rank, 1) for m, (rank, _, _) in info.modules.items()}
    got = scalings(info, state_dict, {})
    assert {m.rsplit(".", 1)[-1]: s for m, s in got.items()} == {"to_q": 16 / 8, "to_k": 4 / 4, "to_v": 4 / 8,
                                                                  "0": 4 / 8}
    rslora = A.inspect(files["rslora"])
    state_dict = {f"transformer.{m}.lora_A.weight": torch.zeros(8, 1) for m in rslora.modules}
    assert set(scalings(rslora, state_dict, {}).values()) == {8 / 8 ** 0.5}


# --- the text encoder -------------------------------------------------------------------


def test_a_text_encoder_part_is_refused_at_submit_naming_the_option_and_runs_with_drop(flux, files, tmp_path):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "p", "lora": files["kohya+te"]}) + "\n")
    out = tmp_path / "out"
    refused = CliRunner().invoke(app, ["run", str(prompts), "--model", flux, "--out", str(out), "--no-progress"])
    said = " ".join(refused.output.split())
    assert refused.exit_code == 2, refused.output
    assert f"{prompts}:1: field 'lora': {files['kohya+te']}: has a text-encoder LoRA part" in said
    assert "--lora-text-encoder drop" in said and not out.exists()
    accepted = CliRunner().invoke(app, ["plan", str(prompts), "--model", flux, "--lora-text-encoder", "drop",
                                        "--json"])
    assert accepted.exit_code == 0, accepted.output
    # A row's own object says drop; a later row naming the same file without it is refused.
    run = A.RunAdapters(flux)
    (ref,) = run.add({"path": files["kohya+te"], "text_encoder": "drop", "scale": 0.5})
    assert (ref.text_encoder, ref.file_layout, ref.scale) == ("drop", "kohya", 0.5)
    with pytest.raises(AdapterError, match="--lora-text-encoder drop"):
        run.add(files["kohya+te"])
    assert A.RunAdapters(flux, text_encoder="drop").add(files["kohya+te"])[0].text_encoder == "drop"


# --- remote failures, pinning --------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("where", ["s3 without credentials", "unreachable hub", "hub file unreachable"])
def test_a_remote_adapter_that_cannot_be_read_is_file_line_field_and_nothing_is_written(
        where, flux, loras, tmp_path, monkeypatch, request):
    from huggingface_hub import constants

    from diffq.producer.sources import InputError
    from diffq.producer.submit import submit
    from tests.test_lora_run import ARGS, Recording

    if where == "s3 without credentials":
        from tests.servers import unique_bucket_name

        bucket = f"s3://{request.getfixturevalue('s3_server').make_bucket(unique_bucket_name())}"
        from diffq.core.storage import open_storage

        open_storage(bucket).upload_file(loras[8], "loras/r8.safetensors")
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        spec, says = f"{bucket}/loras/r8.safetensors", "credentials"
    else:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        spec = "some-org/some-lora" if where == "unreachable hub" else "hf://some-org/some-lora@main/style.safetensors"
        says = "from the Hub"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "p", "lora": spec}) + "\n")
    recording, out = Recording(), tmp_path / "out"
    with pytest.raises(InputError) as caught:
        submit(prompts, str(out), model=flux, publisher=recording, window=None, **ARGS)
    assert str(caught.value).startswith(f"{prompts}:2: field 'lora': "), str(caught.value)
    assert says in str(caught.value)
    assert recording.published == [] and not out.exists()


def test_plan_exits_2_on_an_unreachable_hub(flux, tmp_path, monkeypatch):
    from huggingface_hub import constants
    from typer.testing import CliRunner

    from diffq.app.cli import app

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "p", "lora": "some-org/some-lora@0.8"}) + "\n")
    result = CliRunner().invoke(app, ["plan", str(prompts), "--model", flux])
    assert result.exit_code == 2 and f"{prompts}:1: field 'lora': some-org/some-lora: cannot read" in " ".join(
        result.output.split()), result.output


def test_pin_reads_each_adapters_revision_once(flux, loras, monkeypatch):
    from diffq.producer.sources import RowAdapters

    reads = []
    read = A.revision
    monkeypatch.setattr(A, "revision", lambda path, **kw: reads.append(path) or read(path, **kw))
    rows = RowAdapters(allowed_prefixes=())
    spellings = [loras[8], f"{loras[8]}@0.5", {"path": loras[8]}, [loras[4], f"{loras[8]}@0.25"], loras[4],
                 f"{loras[4]}@1"]
    for spelling in spellings * 2:
        rows.refs(flux, spelling)
    assert sorted(reads) == sorted([loras[8], loras[4]])
    reads.clear()
    assert A.pin(A.parse_spec([loras[16], f"{loras[4]}@0.5"]) + A.parse_spec(f"{loras[16]}@0.1"))[2].revision
    assert sorted(reads) == sorted([loras[16], loras[4]])


# --- spellings ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec, says", [
    ("styles/ink.safetensors:0.8", "'styles/ink.safetensors:0.8': a scale is written after '@', not ':': "
                                   "styles/ink.safetensors@0.8"),
    ("<lora:ink:0.8>", "'<lora:ink:0.8>' is A1111 / ComfyUI prompt syntax; diffq takes the adapter's file and its "
                       "scale after '@': ink.safetensors@0.8"),
    ("hf://datasets/org/data/x.safetensors", "a dataset URI"),
])
def test_other_tools_spellings_are_answered_with_diffqs(spec, says, flux):
    with pytest.raises(AdapterError) as caught:
        A.RunAdapters(flux).add(spec)
    assert says in caught.value.message and caught.value.field == "lora"
    from diffq.core.options import GenerationOptions

    if spec.startswith("<"):
        with pytest.raises(ValueError, match="--lora: '<lora:ink:0.8>' is A1111"):
            GenerationOptions(lora=spec)


def test_hub_files_are_named_by_the_hubs_uri_with_the_scale_last(tmp_path, monkeypatch):
    (ref,) = A.parse_spec("hf://org/styles@v1.2/flux/ink.safetensors@0.8")
    assert (ref.path, ref.scale) == ("hf://org/styles@v1.2/flux/ink.safetensors", 0.8)
    assert A.source(ref.path) is A.Source.HUB
    assert A.weight_file(ref.path) == ("org/styles", "flux/ink.safetensors")
    assert A.hub_revision(ref.path) == "v1.2"
    assert A.weight_file("hf://org/styles") == ("org/styles", A.LORA_WEIGHT_NAME)
    # A bare OWNER/REPO/FILE.safetensors that names no local file is the Hub's.
    monkeypatch.chdir(tmp_path)
    assert A.hub_spelling("org/styles/ink.safetensors") == "hf://org/styles/ink.safetensors"
    (tmp_path / "org" / "styles").mkdir(parents=True)
    (tmp_path / "org" / "styles" / "ink.safetensors").write_bytes(b"")
    assert A.hub_spelling("org/styles/ink.safetensors") is None
    assert A.allowed("hf://org/styles/ink.safetensors", ["org"])


# --- at the worker: a file that cannot be loaded fails its batch for good ------------------


@pytest.mark.parametrize("fault, says", [
    ("conversion raises", "FluxPipeline.lora_state_dict could not convert this kohya file (KeyError: "),
    ("weights cut short", "its weights cannot be read (SafetensorError: "),
    ("changed after submit", "changed since the run pinned it"),
])
def test_an_adapter_the_worker_cannot_load_fails_its_batch_for_good_naming_it(fault, says, flux, files, tmp_path,
                                                                              model_cache, monkeypatch):
    """Through the worker's batch task (worker/delivery/tasks.py generate_batch) on the real
    pipeline host: a batch of a submitted run whose kohya file cannot be converted (diffusers'
    converter raising), whose body is cut short (the producer reads the header alone, so a
    truncated download passes submit) or that changed since submit fails at its first
    attempt, no retry, and its failure record's reason names the adapter."""
    import shutil

    from diffusers import FluxPipeline

    from diffq.core.records import FailureRecord
    from diffq.producer.submit import submit
    from diffq.worker.delivery.outcomes import Outcome
    from diffq.worker.delivery.runtime import Runtime
    from diffq.worker.delivery.spec import ChildSpec
    from tests.test_delivery import StubSink, StubTask, run_task
    from tests.test_lora_run import ARGS, Recording

    path = tmp_path / "style.safetensors"
    shutil.copy(files["kohya"], path)
    if fault == "weights cut short":
        path.write_bytes(path.read_bytes()[:-64])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "p", "lora": str(path)}) + "\n")
    recording, out = Recording(), tmp_path / "out"
    submit(prompts, str(out), model=flux, publisher=recording, window=None, **ARGS)
    (message,) = recording.published
    if fault == "conversion raises":  # as diffusers' fal-kontext converter does on a model it does not know
        original = FluxPipeline.lora_state_dict  # the scaffold's own load goes through it too

        def raising(cls, state_dict, **kwargs):
            if isinstance(state_dict, dict) and any(key.startswith("lora_unet_") for key in state_dict):
                raise KeyError("single_blocks.37.linear1.lora_A.weight")
            return original(state_dict, **kwargs)

        monkeypatch.setattr(FluxPipeline, "lora_state_dict", classmethod(raising))
    elif fault == "changed after submit":
        shutil.copy(files["comfyui"], path)
    runtime = Runtime(spec=ChildSpec(name="w", broker_url="memory://", queues=[message.shape.queue]),
                      host=PipelineHost(backend=get_backend("cpu"), compile_mode="none"), sink=StubSink())
    task = StubTask(runtime)
    assert run_task(task, message.model_dump(mode="json"))["failed"] == len(message.items)
    assert runtime.line.reported("task-1") is Outcome.FAILED and not hasattr(task, "retried")
    (record,) = [FailureRecord.model_validate_json(p.read_text()) for p in (out / "failures").iterdir()]
    assert record.batch_id == message.batch_id and record.attempts == 1
    assert f"adapter {path}" in record.error and says in record.error, record.error


@pytest.mark.parametrize("raised, for_good", [(KeyError("lora_unet_x"), True), (AssertionError("dims"), True),
                                              (NotImplementedError("key"), True), (MemoryError(), False),
                                              (torch.OutOfMemoryError("alloc"), False),
                                              (RuntimeError("DefaultCPUAllocator: can't allocate memory"), False)])
def test_only_a_files_own_faults_fail_its_batch_for_good(raised, for_good, monkeypatch):
    """What diffusers' converters raise on a bad file is the adapter's fault (no retry);
    running out of memory, or a bug, is not: it reaches the retry as it was (issue 57)."""
    import types

    import safetensors.torch

    from diffq.worker.device import lora_files

    class Pipeline:
        @classmethod
        def lora_state_dict(cls, state_dict, **kwargs):
            raise raised

    info = types.SimpleNamespace(text_encoder_keys=(), path="style.safetensors", layout="kohya")
    with pytest.raises(lora_files.AdapterUnsupported if for_good else type(raised)) as caught:
        lora_files._by_diffusers({}, info, Pipeline)
    if for_good:
        assert f"could not convert this kohya file ({type(raised).__name__}" in str(caught.value)
    else:  # nor when reading the file's weights
        monkeypatch.setattr(safetensors.torch, "load", Pipeline.lora_state_dict)
        with pytest.raises(type(raised)):
            lora_files._load(types.SimpleNamespace(path="style.safetensors"), b"")


def test_a_damaged_cached_conversion_is_converted_again(flux, files, model_cache):
    from pathlib import Path

    from diffusers import FluxPipeline

    from diffq.worker.device.lora_files import convert

    (ref,) = A.RunAdapters(flux).add(files["kohya"])
    data = Path(files["kohya"]).read_bytes()
    first = convert(ref, files["kohya"], data, FluxPipeline)
    (kept,) = (model_cache / "lora-converted").iterdir()
    kept.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{damaged")
    again = convert(ref, files["kohya"], data, FluxPipeline)
    assert again.state_dict.keys() == first.state_dict.keys() and again.scalings == first.scalings
    assert all(torch.equal(again.state_dict[key], first.state_dict[key]) for key in first.state_dict)
    assert load_file(str(kept)).keys() >= first.state_dict.keys()  # kept again, whole
