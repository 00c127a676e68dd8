"""LoRA adapters as a run sees them before anything runs: the spec, the file's header, the layout.

A row or the run names adapters (`{"path": ..., "scale": ...}`, `"PATH"`, `"PATH@0.8"`
or a list of these); each file is checked from its safetensors header alone (a ranged
read on object storage, never the weights): diffusers' LoRA format for the model's
transformer, the ranks, the target modules, and nothing a hot-swap cannot take. The
run's layout (the union of target modules at one padded rank) is what the worker
builds its zero "scaffold" adapter from before compiling (worker/device/adapters.py),
so every adapter of the run swaps into the same graphs.

What a hot-swap cannot take, and where that is decided:
- text-encoder LoRA: diffusers `loaders/peft.py` hot-swaps the transformer only
  ("hotswapping adapters of the text encoder is not yet supported");
- LoKr: the same file raises "Hotswapping LoKr adapters is not supported";
- configs that differ from the scaffold's in `use_rslora`, `lora_dropout`,
  `alpha_pattern` or `use_dora`: peft `utils/hotswap.py` (CONFIG_KEYS_TO_CHECK,
  check_hotswap_configs_compatible) refuses the swap. The scaffold is a plain LoRA
  (diffusers derives alpha = rank per module when a file carries no alphas:
  `utils/peft_utils.py`, get_peft_kwargs), so an adapter must be one too. DoRA is
  refused outright: its magnitude vector rescales the base weight, so no zero DoRA
  adapter leaves the model as it was, and rows without one could not share its graphs.
- a module outside the first adapter's targets: peft's hot-swap raises on unexpected
  keys; the scaffold covers the run's union, so none is outside.

Errors are `AdapterError`s naming the field (`lora`, `lora[1].scale`, `lora.path`):
the producer turns them into file:line:field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from pydantic import Field, ValidationError

from diffq.core.contract import AdapterRef, Strict

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
# Key prefixes of text-encoder LoRA in the formats diffusers reads (its own, kohya's).
TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoder_2.", "text_encoders.", "te.", "te1.", "te2.",
                         "lora_te", "lora_te1", "lora_te2")
LORA_WEIGHTS = (".lora_A.weight", ".lora_B.weight")


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
    from diffq.core.storage import NotFound

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
    except OSError as exc:
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


class Source(str, Enum):
    STORE = "store"  # s3://, gs://: fetched into the node's model cache, pinned by its listing
    LOCAL = "local"  # a file or folder (file:// too): pinned by a digest of its content
    HUB = "hub"  # a Hub repo id: pinned by its commit


def source(path: str) -> Source:
    from diffq.core.model_store import is_model_url

    if is_model_url(path):
        return Source.STORE
    if (path.startswith(("file://", "/", ".", "~")) or path.endswith(".safetensors")
            or Path(path).exists() or not HUB_ID.fullmatch(path)):
        return Source.LOCAL
    return Source.HUB


def weight_file(path: str) -> tuple[str, str]:
    """(the folder, the file's name) of an adapter's weights: a `.safetensors` file itself,
    else diffusers' default name in the folder or repo."""
    path = path.rstrip("/")
    if path.endswith(".safetensors"):
        folder, _, name = path.rpartition("/")
        return folder or ".", name
    return path, LORA_WEIGHT_NAME


def adapter_header(path: str, *, field: str = "lora.path", revision: str | None = None) -> dict:
    """An adapter's safetensors header wherever it is (ranged reads; the Hub's too)."""
    folder, name = weight_file(path)
    if source(path) is Source.HUB:
        return _hub_header(folder, name, revision, field)
    if source(path) is Source.LOCAL and Path(local_file(path)).is_file() and not path.endswith(".safetensors"):
        raise AdapterError(field, f"{path}: not a .safetensors file (nor a folder holding {LORA_WEIGHT_NAME})")
    return read_header(f"{folder}/{name}", field=field)


def _hub_header(repo: str, name: str, revision: str | None, field: str) -> dict:
    # Not tested here (no Hub in the test environment); huggingface_hub reads the
    # header by ranged requests, as read_header does on object storage.
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    try:
        meta = HfApi().parse_safetensors_file_metadata(repo, name, revision=revision)
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise AdapterError(field, f"{repo}: cannot read {name} from the Hub ({exc})") from None
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

    folder, name = weight_file(path)
    where = source(path)
    try:
        if where is Source.STORE:
            return list_model(folder, only=name).revision
        if where is Source.HUB:  # not tested here: no Hub
            from huggingface_hub import HfApi

            return HfApi().model_info(folder).sha
        return content_revision((local_file(folder) / name).read_bytes())
    except ModelStoreError as exc:
        raise AdapterError(field, str(exc)) from None
    except FileNotFoundError:
        raise AdapterError(field, f"{path}: no such file") from None
    except OSError as exc:
        raise AdapterError(field, f"{path}: cannot read ({exc})") from None


def pin(refs: tuple[AdapterRef, ...], revisions: dict[str, str] | None = None) -> tuple[AdapterRef, ...]:
    """The refs with their revisions filled (from `revisions` where known, else read now)."""
    revisions = {} if revisions is None else revisions
    return tuple(ref if ref.revision else ref.model_copy(update={
        "revision": revisions.setdefault(ref.path, revision(ref.path))}) for ref in refs)


def allowed(path: str, prefixes: Iterable[str]) -> bool:
    """An adapter under one of the allow-list's prefixes (DIFFQ_ALLOWED_ADAPTERS), on a path
    boundary: `s3://bucket/loras`, `/data/loras` (absolute), a Hub org or repo (`org`,
    `org/name`). An empty list allows any adapter."""
    prefixes = list(prefixes)
    if not prefixes:
        return True
    spelled = _resolved(path) if source(path) is Source.LOCAL else path
    return any(spelled == prefix or spelled.startswith(prefix + "/")
               for prefix in (_resolved(p) if p.startswith(("/", "file://", "~")) else p.rstrip("/") for p in prefixes))


def _resolved(path: str) -> str:
    return str(local_file(path).expanduser().resolve())


@dataclass(frozen=True)
class AdapterInfo:
    """What one adapter file is, read from its header."""

    path: str
    # Target module (the transformer's module name) → (rank, in_features, out_features).
    modules: dict[str, tuple[int, int, int]]
    # The LoraConfig diffusers wrote into the file (empty if none).
    config: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(rank for rank, _, _ in self.modules.values())

    @property
    def ranks(self) -> set[int]:
        return {rank for rank, _, _ in self.modules.values()}

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(self.modules)


def inspect(path: str, *, field: str = "lora.path") -> AdapterInfo:
    """Read and check one adapter file's header: a plain LoRA of a transformer in
    diffusers' format that a hot-swap can take, or an AdapterError saying why not."""
    header = adapter_header(path, field=field)
    metadata = header.pop("__metadata__", None) or {}
    keys = list(header)
    if not keys:
        raise AdapterError(field, f"{path}: holds no tensors")
    if text := next((k for k in keys if k.startswith(TEXT_ENCODER_PREFIXES)), None):
        raise AdapterError(field, f"{path}: text-encoder LoRA ({text}) cannot be hot-swapped (diffusers "
                                  f"loaders/peft.py swaps the transformer's adapters only)")
    if lokr := next((k for k in keys if ".lokr_" in k), None):
        raise AdapterError(field, f"{path}: a LoKr adapter ({lokr}) cannot be hot-swapped (diffusers "
                                  f"loaders/peft.py: 'Hotswapping LoKr adapters is not supported')")
    if dora := next((k for k in keys if "lora_magnitude_vector" in k), None):
        raise AdapterError(field, f"{path}: a DoRA adapter ({dora}): its magnitude vector rescales the base "
                                  f"weights, so rows without it cannot share its compiled graphs")
    config = _config(metadata, path, field)
    modules: dict[str, dict[str, list[int]]] = {}
    for key in keys:
        if not key.startswith(TRANSFORMER_PREFIX) or not key.endswith(LORA_WEIGHTS):
            raise AdapterError(field, f"{path}: key '{key}' is not a transformer LoRA weight in diffusers' format "
                                      f"(transformer.<module>.lora_A.weight / lora_B.weight)")
        shape = header[key].get("shape") if isinstance(header[key], dict) else None
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
            raise AdapterError(field, f"{path}: key '{key}' has shape {shape}, not a Linear LoRA's 2-D weight")
        module, _, which = key[len(TRANSFORMER_PREFIX):].rpartition(".lora_")
        modules.setdefault(module, {})[which.split(".")[0]] = shape
    found: dict[str, tuple[int, int, int]] = {}
    for module, weights in sorted(modules.items()):
        if set(weights) != {"A", "B"}:
            raise AdapterError(field, f"{path}: module '{module}' has lora_{''.join(weights)} without its pair")
        (rank, in_features), (out_features, rank_b) = weights["A"], weights["B"]
        if rank != rank_b:
            raise AdapterError(field, f"{path}: module '{module}': lora_A's rank {rank} != lora_B's {rank_b}")
        found[module] = (rank, in_features, out_features)
    info = AdapterInfo(path=path, modules=found, config=config)
    if len(info.ranks) > 1 and not config:
        # diffusers then sets alpha_pattern = rank_pattern (peft_utils.get_peft_kwargs), which
        # differs from the scaffold's empty one: peft refuses the swap.
        raise AdapterError(field, f"{path}: ranks {sorted(info.ranks)} differ per module without alphas; diffusers "
                                  f"then derives a per-module alpha_pattern, which a hot-swap refuses (peft "
                                  f"utils/hotswap.py, check_hotswap_configs_compatible)")
    return info


# The scaffold's config where peft compares configs on a swap (peft utils/hotswap.py,
# CONFIG_KEYS_TO_CHECK): a plain LoRA. An adapter that says otherwise is refused.
SCAFFOLD_CONFIG = {"use_rslora": False, "lora_dropout": 0.0, "alpha_pattern": {}, "use_dora": False}


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
    for key, expected in SCAFFOLD_CONFIG.items():
        value = config.get(key, expected) or expected
        if value != expected:
            raise AdapterError(field, f"{path}: {key}={value!r}, incompatible with a hot-swap into the run's plain "
                                      f"LoRA slot ({key} must be {expected!r}; peft utils/hotswap.py)")
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
    adapter checked once (the allow-list, its header, the model's transformer) and pinned
    (its revision now, `revision`); the run's layout when all rows are in. Errors are
    AdapterErrors naming the row's field; the producer adds file and line."""

    def __init__(self, model: str, *, allowed_prefixes: Iterable[str] = ()):
        self.model = model
        self.allowed_prefixes = tuple(allowed_prefixes)
        self.infos: dict[str, AdapterInfo] = {}
        self.revisions: dict[str, str] = {}
        self.slots = 1  # the most adapters a set stacks so far
        self._weights: dict[str, list[int]] | None = None

    def add(self, value, field: str = "lora") -> tuple[AdapterRef, ...]:
        """One row's (or `--lora`'s) adapter set, checked and pinned."""
        refs = parse_spec(value, field)
        check_set(refs, field)
        for index, ref in enumerate(refs):
            where = f"{field}[{index}].path" if isinstance(value, (list, tuple)) else (
                f"{field}.path" if isinstance(value, dict) else field)
            if ref.path in self.infos:
                continue
            if not allowed(ref.path, self.allowed_prefixes):
                raise AdapterError(where, f"{ref.path}: not under DIFFQ_ALLOWED_ADAPTERS "
                                          f"({', '.join(self.allowed_prefixes)})")
            info = inspect(ref.path, field=where)
            if self._weights is None:
                self._weights = transformer_weights(self.model)
            check_against(info, self._weights, self.model, field=where)
            self.revisions[ref.path] = revision(ref.path, field=where)
            self.infos[ref.path] = info
        self.slots = max(self.slots, len(refs))
        return pin(refs, self.revisions)

    @property
    def layout(self) -> AdapterLayout | None:
        return layout(self.infos.values(), self.slots)


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
