"""LoRA adapters as a run sees them before anything runs: the spec, the file's header, the layout.

A row or the run names adapters (`{"path": ..., "scale": ...}`, `"PATH"`, `"PATH@0.8"`
or a list of these); each file is checked from its safetensors header alone (a ranged
read on object storage, never the weights): its layout (diffusers' own, or one the
family's pipeline class converts: `FILE_LAYOUTS`, read from the key names), the
modules of the model's transformer it targets after the converter's renames, the
ranks, and nothing a hot-swap cannot take. The run's layout (the union of target
modules at one padded rank) is what the worker builds its zero "scaffold" adapter from
before compiling (worker/device/adapters.py), so every adapter of the run swaps into
the same graphs. A file not in diffusers' layout is converted at the worker, through
the pipeline class's public `lora_state_dict` (worker/device/lora_files.py).

What a hot-swap cannot take, and where that is decided:
- text-encoder LoRA: diffusers `loaders/peft.py` hot-swaps the transformer only
  ("hotswapping adapters of the text encoder is not yet supported"); refused unless
  the row or run says `drop` (`--lora-text-encoder drop`);
- LoKr: the same file raises "Hotswapping LoKr adapters is not supported";
- DoRA: its magnitude vector rescales the base weight, so no zero DoRA adapter leaves
  the model as it was, and rows without one could not share its graphs.
A config's `use_rslora`, `alpha_pattern`, `rank_pattern` and per-module ranks are
honoured: peft's `hotswap_adapter_from_state_dict` runs no config check (peft
`utils/hotswap.py`: only `hotswap_adapter` and diffusers' `load_lora_adapter(hotswap=True)`
call `check_hotswap_configs_compatible`), and the worker writes each module's scaling
itself. `lora_dropout` does nothing at inference.

Errors are `AdapterError`s naming the field (`lora`, `lora[1].scale`, `lora.path`):
the producer turns them into file:line:field.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from pydantic import Field, ValidationError

from diffq.core.contract import AdapterRef, Strict

log = logging.getLogger(__name__)

# The header of a safetensors file: an 8-byte little-endian length, then that many
# bytes of JSON (the format's spec, huggingface/safetensors README "Format"). The
# reference implementation refuses headers over 100 MB (safetensors/src/tensor.rs,
# MAX_HEADER_SIZE); so does this.
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000
# diffusers' key for an adapter's LoraConfig in the file's metadata (loaders/lora_base.py,
# LORA_ADAPTER_METADATA_KEY), and the prefix of a transformer's keys in its LoRA format.
LORA_METADATA_KEY = "lora_adapter_metadata"
TRANSFORMER_PREFIX = "transformer."
# Key prefixes of text-encoder LoRA in the layouts diffusers reads (its own; kohya's
# `lora_te*`; ComfyUI's `text_encoders.clip_l.`, `text_encoders.t5xxl.`).
TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoder_2.", "text_encoders.", "te.", "te1.", "te2.", "lora_te")
LORA_WEIGHTS = (".lora_A.weight", ".lora_B.weight")
# A per-module alpha beside diffusers' weights (`transformer.<module>.alpha`): diffusers'
# `lora_state_dict` takes every key with "alpha" for a network alpha (loaders/lora_pipeline.py).
ALPHA_SUFFIX = ".alpha"


class AdapterError(ValueError):
    """A bad adapter: which field, and why (the producer adds file and line)."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"field '{field}': {message}")


# --- the spec ------------------------------------------------------------------------


def parse_spec(value, field: str = "lora") -> tuple[AdapterRef, ...]:
    """An adapter spec as a row or `--lora` gives it → the adapters, in order.

    `"PATH"` (scale 1), `"PATH@0.8"`, `{"path": PATH, "scale": 0.8}`, or a list of these;
    None or an empty list: no adapter."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        refs = tuple(one for index, entry in enumerate(value) for one in parse_spec(entry, f"{field}[{index}]"))
        paths = [ref.path for ref in refs]
        if len(set(paths)) != len(paths):
            raise AdapterError(field, "names an adapter twice")
        return refs
    if isinstance(value, str):
        _habit(value, field)
        path, at, scale = value.rpartition("@")
        if not at or "/" in scale or not _is_number(scale):
            path, scale = value, None  # an '@' inside a path is part of it
        data = {"path": path.strip()} if scale is None else {"path": path.strip(), "scale": float(scale)}
    elif isinstance(value, dict):
        data = value
    else:
        raise AdapterError(field, f"expected a path, 'PATH@SCALE', an object or a list, got {type(value).__name__}")
    try:
        return (AdapterRef.model_validate(data),)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise AdapterError(f"{field}.{where}" if where else field, error["msg"]) from None


# A1111's / ComfyUI's prompt syntax for a LoRA, and its scale.
PROMPT_LORA = re.compile(r"\s*<lora:([^:>]+)(?::([^>]*))?>\s*")


def _habit(value: str, field: str) -> None:
    """Spellings other tools take, answered with diffq's (one message for `--lora` and a row)."""
    if hit := PROMPT_LORA.fullmatch(value):
        name, scale = hit.group(1).strip(), (hit.group(2) or "1").strip()
        raise AdapterError(field, f"'{value.strip()}' is A1111 / ComfyUI prompt syntax; diffq takes the adapter's "
                                  f"file and its scale after '@': {name}.safetensors@{scale} (a path, s3://, gs:// "
                                  f"or hf://)")
    path, colon, scale = value.rpartition(":")
    if colon and "/" not in scale and _is_number(scale) and not Path(value).exists():
        raise AdapterError(field, f"'{value}': a scale is written after '@', not ':': {path}@{scale}")


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


# --- the header ----------------------------------------------------------------------


def read_header(path: str, *, field: str = "lora.path") -> dict:
    """A safetensors file's header (tensor name → {dtype, shape, data_offsets}, and
    `__metadata__`) from its first bytes: a local file, `file://`, `s3://` or `gs://`
    (two ranged reads through the storage interface; the weights are never read)."""
    from diffq.core.storage import NotFound, StorageError

    folder, _, name = path.rstrip("/").rpartition("/")
    if not name.endswith(".safetensors"):
        raise AdapterError(field, f"{path}: not a .safetensors file")
    try:
        storage = _storage(folder or ".")
        head = storage.get_range(name, 0, HEADER_LENGTH_BYTES)
        if len(head) < HEADER_LENGTH_BYTES:
            raise AdapterError(field, f"{path}: {len(head)} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise AdapterError(field, f"{path}: corrupt header (says {length} bytes; the format allows "
                                      f"{MAX_HEADER_BYTES})")
        text = storage.get_range(name, HEADER_LENGTH_BYTES, length)
    except NotFound:
        raise AdapterError(field, f"{path}: no such file") from None
    except (OSError, StorageError) as exc:  # a store unreachable, no credentials, 403
        raise AdapterError(field, f"{path}: cannot read ({exc})") from None
    if len(text) < length:
        raise AdapterError(field, f"{path}: corrupt header (file ends before its {length}-byte header does)")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(field, f"{path}: corrupt header (not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(field, f"{path}: corrupt header (not a JSON object)")
    return header


def _storage(folder: str):
    """Object storage as models are read (the model bucket's own credentials,
    DIFFQ_MODEL_STORE_*: adapters usually live beside the models); anything else as
    run folders are."""
    from diffq.core.model_store import ModelStoreError, is_model_url, model_storage
    from diffq.core.storage import StorageError, open_storage

    if is_model_url(folder):
        try:
            return model_storage(folder)
        except ModelStoreError as exc:
            raise StorageError(str(exc)) from None
    return open_storage(folder)


# --- where an adapter is, and its revision -------------------------------------------

# diffusers' file name of a LoRA's weights in a folder or Hub repo (loaders/lora_base.py,
# LORA_WEIGHT_NAME_SAFE): what `load_lora_weights(folder)` reads when no weight_name is given.
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
# A Hub repo id (`org/name`): what is neither a URL nor a local path that exists.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


# The Hub's own URI form (huggingface_hub utils/_hf_uris.py): hf://OWNER/REPO[@REVISION][/PATH].
HF_PREFIX = "hf://"
# A bare OWNER/REPO/…/FILE.safetensors: a Hub file where no such local path exists.
HUB_FILE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+/[\w./-]*\.safetensors")


class Source(str, Enum):
    STORE = "store"  # s3://, gs://: fetched into the node's model cache, pinned by its listing
    LOCAL = "local"  # a file or folder (file:// too): pinned by a digest of its content
    HUB = "hub"  # a Hub repo id or hf:// URI: pinned by its commit


def source(path: str) -> Source:
    from diffq.core.model_store import is_model_url

    if is_model_url(path):
        return Source.STORE
    if path.startswith(HF_PREFIX):
        return Source.HUB
    if (path.startswith(("file://", "/", ".", "~")) or path.endswith(".safetensors")
            or Path(path).exists() or not HUB_ID.fullmatch(path)):
        return Source.LOCAL
    return Source.HUB


def hub_spelling(path: str) -> str | None:
    """`hf://PATH` for a bare OWNER/REPO/FILE.safetensors that names no local file, else None."""
    if HUB_FILE.fullmatch(path) and not Path(path).exists() and not path.startswith((".", "/", "~")):
        return HF_PREFIX + path
    return None


def _hf_uri(path: str, field: str = "lora.path"):
    from huggingface_hub.errors import HfUriError
    from huggingface_hub.utils import parse_hf_uri

    try:
        uri = parse_hf_uri(path)
    except HfUriError as exc:
        raise AdapterError(field, f"{path}: {exc}") from None
    if uri.type != "model":
        raise AdapterError(field, f"{path}: a {uri.type} URI; an adapter is a file of a model repo "
                                  f"(hf://OWNER/REPO[@REVISION]/FILE.safetensors)")
    return uri


def weight_file(path: str, field: str = "lora.path") -> tuple[str, str]:
    """(the folder or Hub repo, the file's name in it) of an adapter's weights: a
    `.safetensors` file itself, else diffusers' default name in the folder or repo."""
    path = path.rstrip("/")
    if path.startswith(HF_PREFIX):
        uri = _hf_uri(path, field)
        name = uri.path_in_repo.strip("/")
        return uri.id, name if name.endswith(".safetensors") else "/".join(filter(None, (name, LORA_WEIGHT_NAME)))
    if path.endswith(".safetensors"):
        folder, _, name = path.rpartition("/")
        return folder or ".", name
    return path, LORA_WEIGHT_NAME


def hub_revision(path: str) -> str | None:
    """The revision an hf:// URI names (`@REVISION`), None for a bare repo id."""
    return _hf_uri(path).revision if path.startswith(HF_PREFIX) else None


def adapter_header(path: str, *, field: str = "lora.path", revision: str | None = None) -> dict:
    """An adapter's safetensors header wherever it is (ranged reads; the Hub's too)."""
    folder, name = weight_file(path, field)
    if source(path) is Source.HUB:
        return _hub_header(folder, name, revision or hub_revision(path), field)
    if source(path) is Source.LOCAL and Path(local_file(path)).is_file() and not path.endswith(".safetensors"):
        raise AdapterError(field, f"{path}: not a .safetensors file (nor a folder holding {LORA_WEIGHT_NAME})")
    return read_header(f"{folder}/{name}", field=field)


def hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for a Hub file it cannot read: its HTTP errors (401,
    403, 404: huggingface_hub errors.py HfHubHTTPError), the transport's (huggingface_hub
    2.4 runs on httpx2: an unreachable endpoint is httpx2.ConnectError, neither an OSError
    nor an HfHubHTTPError), offline mode (an OSError), a file that is no safetensors."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, NotASafetensorsRepoError, SafetensorsParsingError

    return HfHubHTTPError, httpx2.HTTPError, NotASafetensorsRepoError, SafetensorsParsingError, OSError, ValueError


def _hub_header(repo: str, name: str, revision: str | None, field: str) -> dict:
    # huggingface_hub reads the header by ranged requests, as read_header does on object storage.
    from huggingface_hub import HfApi

    try:
        meta = HfApi().parse_safetensors_file_metadata(repo, name, revision=revision)
    except hub_errors() as exc:
        raise AdapterError(field, f"{repo}: cannot read {name} from the Hub ({type(exc).__name__}: {exc})") from None
    header = {key: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
              for key, info in meta.tensors.items()}
    return {**header, "__metadata__": dict(meta.metadata or {})}


def content_revision(data: bytes) -> str:
    """A local adapter's revision: a digest of its bytes (as a listing's digest pins a
    model or adapter on object storage, core/model_store.py)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()[:32]


def revision(path: str, *, field: str = "lora.path") -> str:
    """The adapter's revision now, which a run pins at submit (`AdapterRef.revision`) and
    a worker requires (worker/device/adapters.py): object storage, the listing's digest of
    its one file (core/model_store.py); a local file, its content's digest; the Hub, the
    repo's commit."""
    from diffq.core.model_store import ModelStoreError, list_model
    from diffq.core.storage import StorageError

    folder, name = weight_file(path)
    where = source(path)
    if where is Source.HUB:
        from huggingface_hub import HfApi

        try:
            return HfApi().model_info(folder, revision=hub_revision(path)).sha
        except hub_errors() as exc:
            raise AdapterError(field, f"{folder}: cannot read its commit from the Hub "
                                      f"({type(exc).__name__}: {exc})") from None
    try:
        if where is Source.STORE:
            return list_model(folder, only=name).revision
        return content_revision((local_file(folder) / name).read_bytes())
    except (ModelStoreError, StorageError) as exc:
        raise AdapterError(field, str(exc)) from None
    except FileNotFoundError:
        raise AdapterError(field, f"{path}: no such file") from None
    except OSError as exc:
        raise AdapterError(field, f"{path}: cannot read ({exc})") from None


def pin(refs: tuple[AdapterRef, ...], revisions: dict[str, str] | None = None) -> tuple[AdapterRef, ...]:
    """The refs with their revisions filled: from `revisions` where known, else read now
    (once per path: a revision may be a whole file's digest or a remote call)."""
    revisions = {} if revisions is None else revisions
    for ref in refs:
        if not ref.revision and ref.path not in revisions:
            revisions[ref.path] = revision(ref.path)
    return tuple(ref if ref.revision else ref.model_copy(update={"revision": revisions[ref.path]}) for ref in refs)


SET_DIGEST_CHARS = 8


def set_digest(refs: Iterable[AdapterRef]) -> str | None:
    """An adapter set's short name: a digest of each adapter's path, pinned revision and
    scale, in order (a scale is a set of its own: rows are batched by it). What credits,
    failures, the manifest's `adapter_sets` and the metrics' `adapter_set` label carry:
    bounded, and no path leaks into a label. None for no adapters."""
    key = [[ref.path, ref.revision, float(ref.scale)] for ref in refs]
    if not key:
        return None
    return hashlib.sha1(json.dumps(key, separators=(",", ":")).encode()).hexdigest()[:SET_DIGEST_CHARS]


def allowed(path: str, prefixes: Iterable[str]) -> bool:
    """An adapter under one of the allow-list's prefixes (DIFFQ_ALLOWED_ADAPTERS), on a path
    boundary: `s3://bucket/loras`, `/data/loras` (absolute), a Hub org or repo (`org`,
    `org/name`). An empty list allows any adapter."""
    prefixes = list(prefixes)
    if not prefixes:
        return True
    spelled = _resolved(path) if source(path) is Source.LOCAL else path.removeprefix(HF_PREFIX)
    return any(spelled == prefix or spelled.startswith(prefix + "/")
               for prefix in (_resolved(p) if p.startswith(("/", "file://", "~")) else p.rstrip("/") for p in prefixes))


def _resolved(path: str) -> str:
    return str(local_file(path).expanduser().resolve())


@dataclass(frozen=True)
class AdapterInfo:
    """What one adapter file is, read from its header."""

    path: str
    # Target module (the transformer's module name, after the layout's renames) →
    # (rank, in_features, out_features).
    modules: dict[str, tuple[int, int, int]]
    # The LoraConfig diffusers wrote into the file (empty if none).
    config: dict = field(default_factory=dict)
    layout: str = "diffusers"  # FILE_LAYOUTS' name of the layout the file is in
    text_encoder_keys: tuple[str, ...] = ()  # its text-encoder part (refused unless dropped)

    @property
    def rank(self) -> int:
        return max(rank for rank, _, _ in self.modules.values())

    @property
    def ranks(self) -> set[int]:
        return {rank for rank, _, _ in self.modules.values()}

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(self.modules)


# --- the file's layout ----------------------------------------------------------------

PEFT_PREFIX = "base_model.model."  # a raw PEFT save (`get_peft_model_state_dict` + save_file)
COMFYUI_PREFIX = "diffusion_model."  # ComfyUI's name for the transformer


@dataclass(frozen=True)
class FileLayout:
    """One way LoRA files are written: who writes it, how diffq tells it from the key
    names (the order diffusers' FluxLoraLoaderMixin.lora_state_dict tests them in,
    loaders/lora_pipeline.py), how it becomes diffusers' layout, and its modules in
    diffusers' names, torch-free (`modules(header, path, field)` → (modules, text-encoder keys))."""

    name: str
    origin: str
    # "": diffusers' own; "prefix": diffq swaps PEFT's prefix for `transformer.` (diffusers
    # would send any `base_model` key to its fal-kontext converter, which assumes
    # FLUX.1-dev's 19/38 blocks); "diffusers": the pipeline class's `lora_state_dict` at
    # the worker (worker/device/lora_files.py).
    converter: str
    sign: Callable[[list[str]], bool]
    modules: Callable


def _diffusers_modules(header: dict, path: str, field: str, prefix: str = TRANSFORMER_PREFIX):
    modules: dict[str, dict[str, list[int]]] = {}
    text = []
    for key in header:
        if key.startswith(TEXT_ENCODER_PREFIXES):
            text.append(key)
            continue
        if key.startswith(prefix) and key.endswith(ALPHA_SUFFIX) and prefix == TRANSFORMER_PREFIX:
            continue  # a network alpha: the worker reads its value
        if not key.startswith(prefix) or not key.endswith(LORA_WEIGHTS):
            raise AdapterError(field, f"{path}: key '{key}' is not a transformer LoRA weight in diffusers' format "
                                      f"({prefix}<module>.lora_A.weight / lora_B.weight), nor in a layout diffq "
                                      f"converts ({', '.join(FILE_LAYOUTS)}; docs/prompts.md)")
        module, _, which = key[len(prefix):].rpartition(".lora_")
        modules.setdefault(module, {})[which.split(".")[0]] = _matrix(header, key, path, field)
    found: dict[str, tuple[int, int, int]] = {}
    for module, weights in sorted(modules.items()):
        if set(weights) != {"A", "B"}:
            raise AdapterError(field, f"{path}: module '{module}' has lora_{''.join(weights)} without its pair")
        (rank, in_features), (out_features, rank_b) = weights["A"], weights["B"]
        if rank != rank_b:
            raise AdapterError(field, f"{path}: module '{module}': lora_A's rank {rank} != lora_B's {rank_b}")
        found[module] = (rank, in_features, out_features)
    return found, tuple(text)


def _peft_modules(header: dict, path: str, field: str):
    return _diffusers_modules(header, path, field, prefix=PEFT_PREFIX)


def _matrix(header: dict, key: str, path: str, field: str) -> list[int]:
    shape = header[key].get("shape") if isinstance(header[key], dict) else None
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise AdapterError(field, f"{path}: key '{key}' has shape {shape}, not a Linear LoRA's 2-D weight")
    return shape


def _fused_modules(header: dict, path: str, field: str, parts: dict[str, tuple[str, str]], resolve):
    """Modules of a layout whose projections may be fused (kohya's and XLabs' qkv):
    `parts` maps each LoRA key to (its source module, "down" | "up"); `resolve(module,
    key)` gives its diffusers targets and the split of its outputs (None: even), as
    diffusers' converter splits them (the up weight by rows, the down weight shared)."""
    pairs: dict[str, dict[str, str]] = {}
    for key, (module, kind) in parts.items():
        pairs.setdefault(module, {})[kind] = key
    found: dict[str, tuple[int, int, int]] = {}
    for module, keys in sorted(pairs.items()):
        if set(keys) != {"down", "up"}:
            raise AdapterError(field, f"{path}: module '{module}' has a {''.join(keys)} weight without its pair")
        targets, dims = resolve(module, keys["down"])
        (rank, in_features), (out_features, rank_up) = (_matrix(header, keys["down"], path, field),
                                                        _matrix(header, keys["up"], path, field))
        if rank != rank_up:
            raise AdapterError(field, f"{path}: module '{module}': down rank {rank} != up rank {rank_up}")
        if dims is None:
            if out_features % len(targets):
                raise AdapterError(field, f"{path}: '{keys['up']}' has {out_features} outputs, which diffusers' "
                                          f"converter cannot split evenly over {len(targets)} projections")
            dims = (out_features // len(targets),) * len(targets)
        if sum(dims) != out_features:
            raise AdapterError(field, f"{path}: '{keys['up']}' has {out_features} outputs; diffusers' converter "
                                      f"splits it as FLUX.1's {'+'.join(map(str, dims))} (an adapter for another "
                                      f"model?)")
        for target, size in zip(targets, dims):
            found[target] = (rank, in_features, size)  # a split's rank: at most the fused one's
    return found


# kohya / sd-scripts names of FLUX.1's transformer modules → diffusers' (diffusers
# loaders/lora_conversion_utils.py, _convert_kohya_flux_lora_to_diffusers, which walks
# double blocks 0-18 and single blocks 0-37 only): each a pattern, its targets, the
# split of a fused projection's outputs (None: even) and the blocks walked. Modules
# outside the blocks (img_in, txt_in, time_in, ...) it writes without the `transformer.`
# prefix, so `load_lora_weights` would drop them: not in the table, so refused.
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
KOHYA_FLUX = (
    ("double_blocks_{}_img_attn_proj", "transformer_blocks", ("attn.to_out.0",), None, 19),
    ("double_blocks_{}_img_attn_qkv", "transformer_blocks", _QKV, None, 19),
    ("double_blocks_{}_img_mlp_0", "transformer_blocks", ("ff.net.0.proj",), None, 19),
    ("double_blocks_{}_img_mlp_2", "transformer_blocks", ("ff.net.2",), None, 19),
    ("double_blocks_{}_img_mod_lin", "transformer_blocks", ("norm1.linear",), None, 19),
    ("double_blocks_{}_txt_attn_proj", "transformer_blocks", ("attn.to_add_out",), None, 19),
    ("double_blocks_{}_txt_attn_qkv", "transformer_blocks", ("attn.add_q_proj", "attn.add_k_proj",
                                                             "attn.add_v_proj"), None, 19),
    ("double_blocks_{}_txt_mlp_0", "transformer_blocks", ("ff_context.net.0.proj",), None, 19),
    ("double_blocks_{}_txt_mlp_2", "transformer_blocks", ("ff_context.net.2",), None, 19),
    ("double_blocks_{}_txt_mod_lin", "transformer_blocks", ("norm1_context.linear",), None, 19),
    ("single_blocks_{}_linear1", "single_transformer_blocks", (*_QKV, "proj_mlp"), (3072, 3072, 3072, 12288), 38),
    ("single_blocks_{}_linear2", "single_transformer_blocks", ("proj_out",), None, 38),
    ("single_blocks_{}_modulation_lin", "single_transformer_blocks", ("norm.linear",), None, 38),
)
_KOHYA = [(re.compile("lora_unet_" + pattern.replace("{}", r"(\d+)")), blocks, targets, dims, count)
          for pattern, blocks, targets, dims, count in KOHYA_FLUX]
_KOHYA_KEY = re.compile(r"(.+?)\.(lora_down\.weight|lora_up\.weight|alpha)")


def _kohya_name(key: str) -> str:
    """A ComfyUI key in kohya's names, as diffusers' converter renames it first
    (`diffusion_model.` → `lora_unet_`, dots before the LoRA suffix → underscores)."""
    if not key.startswith(COMFYUI_PREFIX):
        return key
    module, dot, rest = ("lora_unet_" + key[len(COMFYUI_PREFIX):]).partition(".lora_")
    if not dot:
        module, dot, rest = module.rpartition(".")
    return module.replace(".", "_") + dot + rest


def _kohya_modules(header: dict, path: str, field: str):
    parts, text = {}, []
    for key in header:
        name = _kohya_name(key)
        if name.startswith(("lora_te", "text_encoders.")):
            text.append(key)
            continue
        if name.endswith((".diff", ".diff_b")):
            raise AdapterError(field, f"{path}: key '{key}' (a bias or norm delta): diffusers' kohya converter drops "
                                      f"it with only a log line (loaders/lora_conversion_utils.py), so the adapter "
                                      f"would run without it; refused")
        match = _KOHYA_KEY.fullmatch(name)
        if not match or not name.startswith("lora_unet_"):
            raise AdapterError(field, f"{path}: key '{key}' is no kohya LoRA weight of the transformer "
                                      f"(lora_unet_<module>.lora_down.weight / lora_up.weight / alpha)")
        if match.group(2) != "alpha":  # folded into the weights by the converter
            parts[key] = (match.group(1), "down" if match.group(2).startswith("lora_down") else "up")

    def resolve(module: str, key: str):
        for pattern, blocks, targets, dims, count in _KOHYA:
            if hit := pattern.fullmatch(module):
                if int(hit.group(1)) >= count:
                    break
                return tuple(f"{blocks}.{hit.group(1)}.{target}" for target in targets), dims
        raise AdapterError(field, f"{path}: key '{key}': diffusers' kohya converter maps no FLUX.1 transformer "
                                  f"module from '{module}' (it would be dropped or refused there)")

    return _fused_modules(header, path, field, parts, resolve), tuple(text)


# XLabs' names (diffusers _convert_xlabs_flux_lora_to_diffusers): block kind, processor
# LoRA → targets in that block (a qkv split evenly).
XLABS_FLUX = {
    ("double", "proj_lora1"): ("attn.to_out.0",), ("double", "proj_lora2"): ("attn.to_add_out",),
    ("double", "qkv_lora1"): _QKV, ("double", "qkv_lora2"): ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ("single", "proj_lora"): ("proj_out",), ("single", "qkv_lora"): _QKV,
}
_XLABS_KEY = re.compile(r"(?:diffusion_model\.)?(double|single)_blocks\.(\d+)\.processor\.(\w+)\.(down|up)\.weight")
_XLABS_BLOCKS = {"double": "transformer_blocks", "single": "single_transformer_blocks"}


def _xlabs_modules(header: dict, path: str, field: str):
    parts = {}
    for key in header:
        match = _XLABS_KEY.fullmatch(key)
        if not match or (match.group(1), match.group(3)) not in XLABS_FLUX:
            raise AdapterError(field, f"{path}: key '{key}' is no XLabs LoRA weight diffusers' converter maps "
                                      f"(double_blocks.N.processor.qkv_lora1.down.weight, ...)")
        parts[key] = (".".join(match.group(1, 2, 3)), match.group(4))

    def resolve(module: str, key: str):
        kind, block, name = module.split(".")
        return tuple(f"{_XLABS_BLOCKS[kind]}.{block}.{t}" for t in XLABS_FLUX[(kind, name)]), None

    return _fused_modules(header, path, field, parts, resolve), ()


FILE_LAYOUTS: dict[str, FileLayout] = {layout.name: layout for layout in (
    FileLayout("peft", "a raw PEFT save (base_model.model.<module>.lora_A.weight)", "prefix",
               lambda keys: any(k.startswith(PEFT_PREFIX) for k in keys), _peft_modules),
    FileLayout("comfyui", "kohya / sd-scripts keys under ComfyUI's diffusion_model. prefix", "diffusers",
               lambda keys: any(".lora_down.weight" in k for k in keys)
               and any(k.startswith(COMFYUI_PREFIX) for k in keys), _kohya_modules),
    FileLayout("kohya", "kohya / sd-scripts (lora_unet_<module>.lora_down.weight, .alpha; fused qkv)", "diffusers",
               lambda keys: any(".lora_down.weight" in k for k in keys), _kohya_modules),
    FileLayout("xlabs", "XLabs (double_blocks.N.processor.qkv_lora1.down.weight)", "diffusers",
               lambda keys: any("processor" in k for k in keys), _xlabs_modules),
    FileLayout("diffusers", "diffusers' own (transformer.<module>.lora_A.weight), as save_lora_weights writes",
               "", lambda keys: True, _diffusers_modules),
)}


def file_layout(keys: list[str]) -> FileLayout:
    """The layout a file's keys are in: the first in FILE_LAYOUTS whose sign they show."""
    return next(layout for layout in FILE_LAYOUTS.values() if layout.sign(keys))


def inspect(path: str, *, field: str = "lora.path", family=None) -> AdapterInfo:
    """Read and check one adapter file's header: a plain LoRA of a transformer, in
    diffusers' layout or one the family (core/families.py `lora_layouts`; None: any)
    converts, that a hot-swap can take, or an AdapterError saying why not. Its
    text-encoder part is found, not judged (`check_text_encoder`)."""
    header = adapter_header(path, field=field)
    metadata = header.pop("__metadata__", None) or {}
    keys = list(header)
    if not keys:
        raise AdapterError(field, f"{path}: holds no tensors")
    if lokr := next((k for k in keys if ".lokr_" in k), None):
        raise AdapterError(field, f"{path}: a LoKr adapter ({lokr}) cannot be hot-swapped (diffusers "
                                  f"loaders/peft.py: 'Hotswapping LoKr adapters is not supported')")
    if dora := next((k for k in keys if "lora_magnitude_vector" in k or "dora_scale" in k), None):
        raise AdapterError(field, f"{path}: a DoRA adapter ({dora}): its magnitude vector rescales the base "
                                  f"weights, so rows without it cannot share its compiled graphs")
    layout = file_layout(keys)
    if family is not None and layout.name not in family.lora_layouts:
        raise AdapterError(field, f"{path}: a {layout.name} file ({layout.origin}); for {family.pipeline_class} diffq "
                                  f"takes {', '.join(family.lora_layouts)} (docs/prompts.md): convert it to "
                                  f"diffusers' layout first")
    modules, text = layout.modules(header, path, field)
    if not modules:
        raise AdapterError(field, f"{path}: holds only a text-encoder LoRA ({len(text)} keys, {text[0]}), no "
                                  f"transformer weights: nothing a run could swap in")
    return AdapterInfo(path=path, modules=modules, config=_config(metadata, path, field), layout=layout.name,
                       text_encoder_keys=text)


# --- the text encoder -----------------------------------------------------------------

TEXT_ENCODER_CHOICES = ("refuse", "drop")


def check_text_encoder(info: AdapterInfo, text_encoder: str | None, *, field: str = "lora.path") -> None:
    """A file with a text-encoder part runs only where its row or run says `drop`."""
    if info.text_encoder_keys and text_encoder != "drop":
        raise AdapterError(field, f"{info.path}: has a text-encoder LoRA part ({len(info.text_encoder_keys)} keys, "
                                  f"{info.text_encoder_keys[0]}), which cannot be hot-swapped (diffusers "
                                  f"loaders/lora_base.py _load_lora_into_text_encoder; loaders/peft.py swaps the "
                                  f"transformer's adapters only): run its transformer part alone with "
                                  f"--lora-text-encoder drop, or \"text_encoder\": \"drop\" in the row's lora "
                                  f"object")


def _config(metadata: dict, path: str, field: str) -> dict:
    text = metadata.get(LORA_METADATA_KEY)
    if not text:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        raise AdapterError(field, f"{path}: corrupt {LORA_METADATA_KEY} metadata (not JSON)") from None
    if not isinstance(config, dict):
        raise AdapterError(field, f"{path}: corrupt {LORA_METADATA_KEY} metadata (not an object)")
    # diffusers writes the config under the component's prefix ("transformer.r", ...).
    config = {key.removeprefix(TRANSFORMER_PREFIX): value for key, value in config.items()}
    if config.get("use_dora"):
        raise AdapterError(field, f"{path}: use_dora=True: a DoRA adapter's magnitude vector rescales the base "
                                  f"weights, so rows without it cannot share its compiled graphs")
    return config


# --- the model -----------------------------------------------------------------------


def transformer_weights(model: str) -> dict[str, list[int]]:
    """The model's transformer weights (name → shape) from its safetensors headers: a
    diffusers folder, local or on object storage (`transformer/` with one file or an index)."""
    from diffq.core.storage import NotFound, open_storage

    folder = model.rstrip("/") + "/transformer"
    storage = open_storage(folder)
    try:
        index = json.loads(storage.get_bytes("diffusion_pytorch_model.safetensors.index.json"))
        files = sorted(set(index["weight_map"].values()))
    except NotFound:
        files = ["diffusion_pytorch_model.safetensors"]
    weights: dict[str, list[int]] = {}
    for name in files:
        header = read_header(f"{folder}/{name}", field="model")
        header.pop("__metadata__", None)
        weights.update({key: value["shape"] for key, value in header.items()})
    return weights


def model_family(model: str):
    """The family (core/families.py) of a model folder, local or on object storage, from
    its model_index.json; None where it has none diffq knows."""
    from diffq.core.families import FamilyError, family_for_class
    from diffq.core.storage import NotFound, StorageError, open_storage

    try:
        return family_for_class(json.loads(open_storage(model).get_bytes("model_index.json"))["_class_name"])
    except (NotFound, StorageError, OSError, ValueError, KeyError, TypeError, FamilyError):
        return None


def check_against(info: AdapterInfo, weights: dict[str, list[int]], model: str, *, field: str = "lora.path") -> None:
    """The adapter fits this transformer: every target is a Linear of it, with the
    adapter's in and out features."""
    for module, (_, in_features, out_features) in info.modules.items():
        shape = weights.get(f"{module}.weight")
        if shape is None:
            raise AdapterError(field, f"{info.path}: targets '{module}', which {model}'s transformer does not have "
                                      f"(an adapter for another model?)")
        if shape != [out_features, in_features]:
            raise AdapterError(field, f"{info.path}: '{module}' is {out_features}x{in_features} in the adapter but "
                                      f"{shape[0]}x{shape[1] if len(shape) > 1 else '?'} in {model}'s transformer "
                                      f"(an adapter for another model?)")


# --- the run's layout -----------------------------------------------------------------


# The most adapters one set may stack: each is a slot of the scaffold that every call of
# the run computes (zeros where a row names fewer), so the cap bounds what rows without
# adapters pay. Dataset recipes stack two or three (style, subject, domain).
MAX_STACK = 4


class AdapterLayout(Strict):
    """What the adapters of one model's shape change in its graphs: the modules that carry
    a LoRA, the rank they are padded to and the number of slots (the most adapters any set
    of the run stacks). Every adapter of the run hot-swaps into one of its slots."""

    targets: tuple[str, ...]  # the union of the run's target modules, sorted
    rank: int  # the padded rank
    # Slots (K): each a LoRA per target module in the graphs. 1 is left out of manifests,
    # so one-adapter runs read and write what they did before stacking.
    slots: int = Field(default=1, ge=1, le=MAX_STACK, exclude_if=lambda slots: slots == 1)

    @property
    def digest(self) -> str:
        import hashlib

        return hashlib.sha1("\n".join(self.targets).encode()).hexdigest()[:8]

    @property
    def label(self) -> str:
        """What a shape key says of it (phase 2's queue names): rank, slots beyond one and a
        digest of the targets (`r16-1a2b3c4d`, `r16x2-1a2b3c4d`)."""
        stacked = f"x{self.slots}" if self.slots > 1 else ""
        return f"r{self.rank}{stacked}-{self.digest}"


def padded_rank(rank: int) -> int:
    """The rank a run's slot is padded to: the next power of two, so runs whose largest
    ranks differ a little share graphs (a zero-padded rank changes no image)."""
    return 1 << max(0, math.ceil(math.log2(rank)))


def layout(infos: Iterable[AdapterInfo], slots: int = 1) -> AdapterLayout | None:
    """The run's layout over all its adapters, with `slots` for its largest set; None without any."""
    infos = list(infos)
    if not infos:
        return None
    targets = sorted(set().union(*(info.targets for info in infos)))
    return AdapterLayout(targets=tuple(targets), rank=padded_rank(max(info.rank for info in infos)), slots=slots)


class RunAdapters:
    """A run's adapters as the producer meets them, row by row: each spec parsed, each
    adapter checked once (the allow-list, its header and layout for the model's family,
    the model's transformer) and pinned (its revision now, `revision`, read once per path;
    its layout; its text-encoder part dropped where the row or run says so); the run's
    layout when all rows are in. Errors are AdapterErrors naming the row's field; the
    producer adds file and line."""

    def __init__(self, model: str, *, allowed_prefixes: Iterable[str] = (), text_encoder: str | None = None):
        self.model = model
        self.allowed_prefixes = tuple(allowed_prefixes)
        self.text_encoder = text_encoder  # the run's `--lora-text-encoder`, for refs that say nothing
        self.infos: dict[str, AdapterInfo] = {}
        self.revisions: dict[str, str] = {}
        self.slots = 1  # the most adapters a set stacks so far
        self._weights: dict[str, list[int]] | None = None
        self._family = None

    def add(self, value, field: str = "lora") -> tuple[AdapterRef, ...]:
        """One row's (or `--lora`'s) adapter set, checked and pinned."""
        refs = tuple(map(self._spelled, parse_spec(value, field)))
        check_set(refs, field)
        for index, ref in enumerate(refs):
            where = f"{field}[{index}].path" if isinstance(value, (list, tuple)) else (
                f"{field}.path" if isinstance(value, dict) else field)
            if ref.path not in self.infos:
                self._check(ref.path, where)
            check_text_encoder(self.infos[ref.path], ref.text_encoder or self.text_encoder, field=where)
        self.slots = max(self.slots, len(refs))
        return tuple(ref.model_copy(update={
            "file_layout": None if self.infos[ref.path].layout == "diffusers" else self.infos[ref.path].layout,
            "text_encoder": "drop" if self.infos[ref.path].text_encoder_keys else None})
            for ref in pin(refs, self.revisions))

    def _spelled(self, ref: AdapterRef) -> AdapterRef:
        if (hub := hub_spelling(ref.path)) is None:
            return ref
        if hub not in self.infos:
            log.warning("lora %s: no such local file; taken as the Hub file %s", ref.path, hub)
        return ref.model_copy(update={"path": hub})

    def _check(self, path: str, where: str) -> None:
        if not allowed(path, self.allowed_prefixes):
            raise AdapterError(where, f"{path}: not under DIFFQ_ALLOWED_ADAPTERS ({', '.join(self.allowed_prefixes)})")
        if self._weights is None:
            self._family = model_family(self.model)
            self._weights = transformer_weights(self.model)
        info = inspect(path, field=where, family=self._family)
        check_against(info, self._weights, self.model, field=where)
        self.revisions[path] = revision(path, field=where)
        self.infos[path] = info

    @property
    def layout(self) -> AdapterLayout | None:
        return layout(self.infos.values(), self.slots)

    def scaffold_share(self) -> float | None:
        """The run's scaffold over this model's transformer (`scaffold_share`); None without adapters."""
        run_layout = self.layout
        return None if run_layout is None else scaffold_share(run_layout, self._weights or {})


# Above this share of the base transformer's linear work, `diffq plan` warns that the
# scaffold (swap) costs every row more than a cheaper mode would (issue 59).
SCAFFOLD_WARN = 0.05


def scaffold_share(layout: AdapterLayout, weights: dict[str, list[int]]) -> float:
    """What the swap scaffold adds to every row's linear work, as a share of the base
    transformer's: per token each of its K slots computes, in each target module, a down
    (in × r) and an up (r × out) matmul at the padded rank r, against every Linear's
    in × out (its 2-D weights). Every Linear is counted as if it saw every token (the
    modulation linears see one per sample: the base is overstated there a little)."""
    base = sum(shape[0] * shape[1] for name, shape in weights.items() if name.endswith(".weight") and len(shape) == 2)
    extra = layout.slots * layout.rank * sum(sum(weights[f"{target}.weight"]) for target in layout.targets)
    return extra / base if base else 0.0


def run_layout(specs: Iterable[tuple[str, object]], model: str, *,
               allowed_prefixes: Iterable[str] = ()) -> AdapterLayout | None:
    """The run's layout from its specs, each given with its field (`("lora", "a.safetensors@0.8")`),
    or the first AdapterError naming the field; None without adapters."""
    run = RunAdapters(model, allowed_prefixes=allowed_prefixes)
    for field_name, value in specs:
        run.add(value, field_name)
    return run.layout


def check_set(refs: tuple[AdapterRef, ...], field: str = "lora") -> None:
    """An adapter set the worker can apply: at most MAX_STACK adapters, each a slot of
    the scaffold (the same adapter twice is refused by parse_spec)."""
    if len(refs) > MAX_STACK:
        raise AdapterError(field, f"{len(refs)} adapters in one set: at most {MAX_STACK} stack (each is a LoRA "
                                  f"slot every call of the run computes)")


def local_file(path: str) -> Path:
    return Path(path.removeprefix("file://"))
