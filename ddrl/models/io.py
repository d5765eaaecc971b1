"""Model directories on disk: atomic writes and the checks made before reading one.

A run that is killed while saving must never leave a directory that looks complete. So a save
writes into a temporary sibling directory (same filesystem, so the final rename is atomic) that
holds a marker file until everything is written; only then is the marker removed and the
directory renamed into place. A reader refuses any directory that still holds the marker.

A sharded training checkpoint (ddrl.training.checkpoint, train.sharded_checkpoints) is a model
directory without its weight files: every rank wrote its shard of the model and optimizer state
with torch.distributed.checkpoint into sharded_state/, and rank 0 wrote the rest of the directory
(config.json, tokenizer ...) plus weight_layout.json, which says which state-dict tensor goes to
which entry of which weight file. `consolidate_checkpoint` reads the shards in one process and
writes the weight files, giving an ordinary model directory:

    run/checkpoint-20/ config.json tokenizer.json weight_layout.json sharded_state/ trainer_state.pt COMPLETE
    consolidate_checkpoint("run/checkpoint-20", "run/model-20")    # -> config.json model.safetensors ...

The layout is learned from the model's own save_pretrained (`write_weight_layout`), so every family
(built-in, native, transformers, LoRA adapters) is covered without a name rule per family.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INCOMPLETE_MARKER = ".ddrl-incomplete"  # present only while a directory is being written
# Weight files a Hugging Face directory may hold instead of a single model.safetensors.
HF_WEIGHT_FILES = (WEIGHTS_FILE, "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
SHARDED_STATE_DIR = "sharded_state"  # a torch.distributed.checkpoint directory: every rank's shards
WEIGHT_LAYOUT_FILE = "weight_layout.json"  # weight file -> {entry name: state-dict key}
MODEL_STATE_KEY = "model"  # the sharded state is {"model": model state dict, "optimizer": optimizer state dict}


class ModelDirectoryError(ValueError, FileNotFoundError):
    """A model directory that cannot be loaded. Both a ValueError (bad argument) and a
    FileNotFoundError, so callers catching either kind see it."""


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory to write into; on success it replaces `target` in one rename.

        with atomic_directory("runs/x/checkpoint-10") as tmp:
            model.save(tmp); (tmp / "trainer_state.json").write_text(...)

    On an exception the temporary directory is removed and `target` is left as it was.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise ValueError(f"cannot save to {str(target)!r}: it exists and is not a directory; choose another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = target.parent / f".{target.name}.tmp-{tag}"
    tmp.mkdir()
    (tmp / INCOMPLETE_MARKER).write_text("this directory is being written; do not load it\n")
    try:
        yield tmp
        (tmp / INCOMPLETE_MARKER).unlink()
        if target.exists():
            # Move the old directory aside rather than deleting it first, so that the window in
            # which no complete directory exists at `target` is one rename long.
            old = target.parent / f".{target.name}.old-{tag}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_model_dir(path: str | Path, weights: tuple[str, ...] = (WEIGHTS_FILE,)) -> Path:
    """Fail early, with the fix, on a directory that is missing, half-written or incomplete."""
    p = Path(path)
    if not p.exists():
        raise ModelDirectoryError(
            f"model directory {str(p)!r} does not exist; pass a directory written by save_pretrained "
            f"(or download a Hugging Face model to a local directory first)"
        )
    if not p.is_dir():
        raise ModelDirectoryError(
            f"model path {str(p)!r} is a file, not a model directory; pass the directory that holds config.json"
        )
    if (p / INCOMPLETE_MARKER).exists():
        raise ModelDirectoryError(
            f"model directory {str(p)!r} is half-written (it still holds {INCOMPLETE_MARKER}: a save was interrupted); "
            f"use another checkpoint"
        )
    if not (p / CONFIG_FILE).is_file():
        raise ModelDirectoryError(
            f"model directory {str(p)!r} is incomplete: it has no {CONFIG_FILE}; use another checkpoint"
        )
    if not any((p / w).is_file() for w in weights) and is_sharded_checkpoint(p):
        raise ModelDirectoryError(
            f"{str(p)!r} is a sharded training checkpoint (its weights are shards in {SHARDED_STATE_DIR}/): load it "
            f"with ddrl.load_model, or write an ordinary model directory once with "
            f"ddrl.models.io.consolidate_checkpoint({str(p)!r}, OUT)"
        )
    if not any((p / w).is_file() for w in weights):
        raise ModelDirectoryError(
            f"model directory {str(p)!r} is incomplete: it has no weights ({' or '.join(weights)}); use another checkpoint"
        )
    return p


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirectoryError(
            f"{str(path)!r} is not valid JSON ({e}); the checkpoint is damaged, use another one"
        ) from None
    if not isinstance(data, dict):
        raise ModelDirectoryError(f"{str(path)!r} must hold a JSON object; the checkpoint is damaged, use another one")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


# --------------------------------------------------------------------------------------------
# Sharded training checkpoints: the weight layout, and consolidation into a model directory
# --------------------------------------------------------------------------------------------

_LAYOUT_FORMAT = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A directory written by a sharded save: torch.distributed.checkpoint shards + weight_layout.json."""
    p = Path(path)
    return (p / SHARDED_STATE_DIR / ".metadata").is_file() and (p / WEIGHT_LAYOUT_FILE).is_file()


def write_weight_layout(model: Any, directory: Path) -> None:
    """Write the model directory of `model` without its weights into `directory`, plus
    weight_layout.json: for each weight file its save_pretrained would write, which state-dict key
    fills each entry. Reads no weights and makes no collective call (rank 0 of a sharded save).

    The layout is learned by saving tags: model.save_pretrained(state_dict=...) is given, for state
    key i, the one-element tensor [i] (one tag per distinct tensor, so tied weights stay tied), and
    each written entry's value names its source. Family rules (renames, tied heads dropped, LoRA's
    base weights + adapter/) are thus the family's own save_pretrained, applied once.
    """
    state = model.state_dict(keep_vars=True)  # the module's own tensors (FSDP2: its DTensor shards)
    sources: list[str] = []
    tag_of: dict[int, torch.Tensor] = {}
    tags: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if id(value) not in tag_of:
            tag_of[id(value)] = torch.tensor([len(sources)], dtype=torch.int64)
            sources.append(key)
        tags[key] = tag_of[id(value)]
    scratch = directory / ".layout"
    model.save_pretrained(scratch, state_dict=tags)
    try:
        weights = {}
        for file in sorted(scratch.rglob("*")):
            if not file.is_file():
                continue
            name = file.relative_to(scratch).as_posix()
            if name.endswith(".safetensors"):
                weights[name] = _tag_entries(file, sources)
                file.unlink()
            elif name.endswith(".safetensors.index.json"):
                file.unlink()  # consolidation writes each file whole
            elif name.endswith(_WEIGHT_SUFFIXES):
                raise ModelDirectoryError(f"{type(model).__name__}.save_pretrained wrote {name}, not safetensors; "
                                          f"sharded checkpoints need safetensors weights "
                                          f"(set train.sharded_checkpoints=false)")
        files = []
        for item in sorted(scratch.rglob("*")):
            if item.is_file():
                target = directory / item.relative_to(scratch)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(item, target)
                files.append(item.relative_to(scratch).as_posix())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_json(directory / WEIGHT_LAYOUT_FILE, {"format": _LAYOUT_FORMAT, "state": MODEL_STATE_KEY,
                                                "files": files, "weights": weights})


def _tag_entries(file: Path, sources: list[str]) -> dict[str, Any]:
    """{"metadata": the file's safetensors metadata, "tensors": {entry name: state-dict key}}."""
    from safetensors import safe_open

    entries = {}
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
        for name in f.keys():
            tag = f.get_tensor(name)
            if tag.dtype != torch.int64 or tag.numel() != 1 or not 0 <= int(tag) < len(sources):
                raise ModelDirectoryError(
                    f"save_pretrained changed the tensor it was given for {name!r} in {file.name} (or wrote one of "
                    f"its own), so the sharded checkpoint's weight layout cannot be recorded; it must write the "
                    f"state_dict it is given unchanged (or set train.sharded_checkpoints=false)")
            entries[name] = sources[int(tag)]
    return {"metadata": metadata, "tensors": entries}


def read_sharded_model_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint, read in this process alone (no process
    group needed, none used): one CPU tensor per key, the optimizer's shards are not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(checkpoint) / SHARDED_STATE_DIR))
    prefix = MODEL_STATE_KEY + "."
    state = {key[len(prefix):]: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in reader.read_metadata().state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}
    with quiet_single_process_dcp():
        dcp.load({MODEL_STATE_KEY: state}, storage_reader=reader, no_dist=True)
    return state


@contextlib.contextmanager
def quiet_single_process_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint warns on every save/load without a process group; in ddrl that
    is the intended one-process case (a CPU run, or reading shards for eval), not a mistake."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def consolidate_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """A sharded training checkpoint -> an ordinary model directory at `out` (config, tokenizer,
    weights; no trainer or optimizer state), written atomically. Needs the model's size in memory."""
    src = Path(checkpoint)
    if not is_sharded_checkpoint(src):
        raise ModelDirectoryError(f"{str(src)!r} is not a sharded checkpoint (no {SHARDED_STATE_DIR}/.metadata and "
                                  f"{WEIGHT_LAYOUT_FILE}); pass a checkpoint-N directory of a sharded run")
    layout = read_json(src / WEIGHT_LAYOUT_FILE)
    if layout.get("format") != _LAYOUT_FORMAT:
        raise ModelDirectoryError(f"{str(src / WEIGHT_LAYOUT_FILE)!r} has format {layout.get('format')!r}; this ddrl "
                                  f"reads format {_LAYOUT_FORMAT}: consolidate it with the ddrl version that wrote it")
    state = read_sharded_model_state(src)
    from safetensors.torch import save_file

    with atomic_directory(out) as tmp:
        for name in layout["files"]:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, tmp / name)
        for name, entry in layout["weights"].items():
            missing = sorted(set(entry["tensors"].values()) - set(state))
            if missing:
                raise ModelDirectoryError(f"the shards in {str(src / SHARDED_STATE_DIR)!r} lack {missing[:5]} that "
                                          f"{WEIGHT_LAYOUT_FILE} names; the checkpoint is damaged, use another one")
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            tensors = {entry_name: state[key].contiguous() for entry_name, key in entry["tensors"].items()}
            save_file(tensors, str(tmp / name), metadata=entry["metadata"])
    return Path(out)


@contextlib.contextmanager
def consolidated_model_dir(checkpoint: str | Path) -> Iterator[Path]:
    """`with consolidated_model_dir(ckpt) as d: load_model(d)`: the checkpoint as an ordinary model
    directory in a temporary folder (under $TMPDIR; it holds the model's size), removed on exit."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddrl-consolidated-") as tmp:
        yield consolidate_checkpoint(checkpoint, Path(tmp) / "model")


# Header dtype names of safetensors -> torch dtypes (the ones model weights use).
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


@contextlib.contextmanager
def open_safetensors(file: str | Path) -> Iterator[Any]:
    """safetensors' safe_open, with a damaged file (cut short by a full disk or a killed copy, or not
    safetensors at all) a ModelDirectoryError naming it, raised when the header or a tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ModelDirectoryError(f"weight file {str(file)!r} is damaged or not a safetensors file ({e}); copy "
                                  f"it again from its source, or load another checkpoint") from None


def read_safetensors(file: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file. Under `with torch.device("meta")` only the header is
    read: meta tensors of the stored shapes and dtypes, so a rank that will receive its weights by
    broadcast (ddrl.training.checkpoint.load_model_on_rank0) builds the model without reading them."""
    on_meta = torch.get_default_device().type == "meta"
    state = {}
    with open_safetensors(file) as f:
        for name in f.keys():
            if on_meta:
                header = f.get_slice(name)
                state[name] = torch.empty(header.get_shape(), dtype=_SAFETENSORS_DTYPES[header.get_dtype()],
                                          device="meta")
            else:
                state[name] = f.get_tensor(name)
    return state
