"""Training checkpoints: a model directory plus trainer state, written atomically, full or sharded.

    full     run/checkpoint-20/ config.json model.safetensors tokenizer.json trainer_state.pt COMPLETE
    sharded  run/checkpoint-20/ config.json tokenizer.json weight_layout.json sharded_state/ trainer_state.pt COMPLETE

full (train.sharded_checkpoints=false): model and optimizer states are gathered to rank 0's CPU
(a collective under FSDP2), which writes an ordinary model directory; trainer_state.pt holds the
optimizer state keyed by parameter name. At 8B with fp32 master weights and AdamW that is ~96 GB on one CPU.
sharded: every rank writes its own shard of the model and optimizer states with
torch.distributed.checkpoint (DCP) and nothing is gathered; rank 0 writes the rest of the model
directory and the weight layout (ddrl.models.io). ddrl.load_model still reads a sharded checkpoint
in one process (it consolidates the shards), and `load_training_checkpoint` loads either format
into a plain or an FSDP2-sharded model under any number of processes (DCP reshards).

Everything is written into a hidden temp directory first and renamed into place at the end, so a
run killed mid-write leaves either the previous checkpoint or a `.checkpoint-N.tmp-*` directory
that is never loaded. The COMPLETE marker is written last, inside the temp directory. A sharded
save needs a filesystem every rank sees (DCP writes one file per rank into the same directory).

Rotation (train.keep_checkpoints) keeps the newest N and one more: the `pinned` step, which the
trainer sets to its newest checkpoint made with valid rewards, so that a reward server that died
cannot rotate away every checkpoint of the run that worked. A complete checkpoint that was damaged
afterwards (a truncated model.safetensors, a missing or garbage trainer_state.pt) is a
CorruptCheckpointError naming the file, checked before anything is loaded; `load_newest_training_checkpoint`
then falls back to the one before it.

Loading at scale (`load_model_on_rank0`, `wrap_from_rank0`): rank 0 alone reads the pretrained
weights; the other ranks build the model on the meta device, and the weights reach their shards
by broadcast after sharding (torch.distributed.checkpoint.state_dict's broadcast_from_rank0).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from ddrl.models.io import (MODEL_STATE_KEY, SHARDED_STATE_DIR, is_sharded_checkpoint, quiet_single_process_dcp,
                            write_weight_layout)
from ddrl.training.distributed import DistInfo, is_sharded, wrap_model

log = logging.getLogger(__name__)

_NAME = re.compile(r"^checkpoint-(\d+)$")
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
OPTIMIZER_STATE_KEY = "optimizer"  # next to MODEL_STATE_KEY in the sharded state


class CorruptCheckpointError(ValueError):
    """A complete checkpoint one of whose files cannot be read (the message names the file)."""


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------


def save_training_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             trainer_state: dict[str, Any], *, dist: DistInfo, sharded: bool,
                             keep: int | None, pinned: int | None = None) -> Path:
    """Write run_dir/checkpoint-{step} and keep the newest `keep` checkpoints (None or 0: all) and
    checkpoint-{pinned} (the newest made with valid rewards), whatever its age.

    A collective: every rank calls it with its own (plain or FSDP2-sharded, unwrapped) model and
    optimizer. trainer_state is what resuming needs besides the model and optimizer (step,
    scheduler, eval history ...). Returns the checkpoint's path on every rank once it is in place;
    a failure on rank 0 raises on every rank, so no rank trains on past a checkpoint that is missing.
    """
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint-{step}"
    if not sharded:
        model_state, optimizer_state = gather_full_state(model, optimizer)  # collective under FSDP2
        error = None
        if dist.is_main:
            try:
                save_checkpoint(run_dir, step, GatheredModel(model, model_state),
                                {**trainer_state, OPTIMIZER_STATE_KEY: optimizer_state}, keep=keep or 0,
                                pinned=pinned)
            except BaseException as e:  # raised below, after the other ranks have heard of it
                error = e
        _raise_on_every_rank(error, dist)
        return final
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = _shared_temp_dir(run_dir, step, dist)
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, keyed by name
        with quiet_single_process_dcp():  # a file per rank; an error raises on every rank
            save({MODEL_STATE_KEY: model_state, OPTIMIZER_STATE_KEY: optimizer_state},
                 checkpoint_id=str(tmp / SHARDED_STATE_DIR), no_dist=not dist.enabled)
    except BaseException:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if dist.is_main:
        try:
            write_weight_layout(model, tmp)  # config, tokenizer, weight_layout.json: no weights read
            torch.save(trainer_state, tmp / TRAINER_STATE)
            _commit(tmp, final, step)
            _prune(run_dir, keep or 0, pinned)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = e
    _raise_on_every_rank(error, dist)
    return final


def save_checkpoint(run_dir: Path, step: int, model: Any, trainer_state: dict[str, Any], keep: int = 2,
                    pinned: int | None = None) -> Path:
    """One process writes run_dir/checkpoint-{step}: model.save_pretrained + trainer_state.pt."""
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint-{step}"
    tmp = _temp_dir(run_dir, step)
    try:
        model_dir = tmp / "m"
        model.save_pretrained(model_dir)  # itself atomic into model_dir
        for item in model_dir.iterdir():
            os.replace(item, tmp / item.name)
        model_dir.rmdir()
        torch.save(trainer_state, tmp / TRAINER_STATE)
        _commit(tmp, final, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(run_dir, keep, pinned)
    return final


def _temp_dir(run_dir: Path, step: int) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}.tmp-", dir=run_dir))


def _commit(tmp: Path, final: Path, step: int) -> None:
    """COMPLETE last, then one rename: a reader sees the whole checkpoint or none of it."""
    (tmp / COMPLETE).write_text(str(step))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _shared_temp_dir(run_dir: Path, step: int, dist: DistInfo) -> Path:
    """A fresh hidden directory next to the checkpoint, made by rank 0, its name sent to every rank."""
    name = [str(_temp_dir(run_dir, step)) if dist.is_main else None]
    if dist.enabled:
        tdist.broadcast_object_list(name, src=0)
    assert name[0] is not None  # rank 0's name, broadcast to every rank
    return Path(name[0])


def _raise_on_every_rank(error: BaseException | None, dist: DistInfo) -> None:
    """Rank 0's failure (or None) is broadcast; every rank raises, or every rank goes on. Also a
    barrier: no rank returns before the checkpoint is in place (a preempted run may exit next)."""
    if dist.enabled:
        message = [None if error is None else f"{type(error).__name__}: {error}"]
        tdist.broadcast_object_list(message, src=0)
        if error is None and message[0] is not None:
            raise RuntimeError(f"rank 0 failed to write the checkpoint ({message[0]}); see its log")
    if error is not None:
        raise error


def _prune(run_dir: Path, keep: int, pinned: int | None = None) -> None:
    """The newest `keep` checkpoints stay, and checkpoint-{pinned} however old it is."""
    if keep <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        if old.name != f"checkpoint-{pinned}":
            shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Find and load
# --------------------------------------------------------------------------------------------


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).exists():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_trainer_state(checkpoint: Path, *, mmap: bool = False) -> dict[str, Any]:
    """trainer_state.pt of a complete checkpoint. mmap: map its tensors instead of reading them
    (a rank that does not use a full checkpoint's optimizer state then costs no memory for it)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / COMPLETE).exists():
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} is incomplete (no {COMPLETE} marker): it was interrupted "
            f"while being written; resume from an earlier checkpoint"
        )
    path = checkpoint / TRAINER_STATE
    if not path.is_file():
        raise CorruptCheckpointError(f"{str(path)!r} is missing: the checkpoint cannot be resumed")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # truncated zip, garbage bytes, a pickle of something else
        raise CorruptCheckpointError(f"{str(path)!r} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CorruptCheckpointError(f"{str(path)!r} is not a ddrl trainer state (no step)")
    return state


def check_weight_files(checkpoint: Path) -> None:
    """Every .safetensors file of the checkpoint is whole: its header parses and the file is as long
    as the header says (a copy or a disk that ran out cuts files short). Reads headers only."""
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                n = int.from_bytes(f.read(8), "little")  # the header's length, then the JSON header
                header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except Exception as e:
            raise CorruptCheckpointError(f"{str(path)!r} is not a readable safetensors file "
                                         f"({type(e).__name__}: {e})") from None
        size = path.stat().st_size
        if size < 8 + n + end:
            raise CorruptCheckpointError(f"{str(path)!r} is truncated: {size} bytes, its header needs {8 + n + end}")


def load_newest_training_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                                    *, trust_remote_code: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of run_dir that loads (see load_training_checkpoint), and its trainer state;
    a corrupt one is skipped with a warning naming the file; None when run_dir holds no checkpoint.
    Every tensor is overwritten by the checkpoint that loads, so a failed try leaves nothing behind."""
    checkpoints = list_checkpoints(run_dir)
    problems = []
    for path in reversed(checkpoints):
        try:
            return path, load_training_checkpoint(path, model, optimizer, trust_remote_code=trust_remote_code)
        except CorruptCheckpointError as e:
            problems.append(str(e))
            log.warning("resume: %s; falling back to the checkpoint before it", e)
    if problems:
        raise CorruptCheckpointError(f"no checkpoint of {str(run_dir)!r} can be resumed: " + "; ".join(problems) +
                                     ". Restore the files, or start a new run (resume=false with another "
                                     "output_dir, or overwrite=true)")
    return None


def load_training_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                             trust_remote_code: bool = False) -> dict[str, Any]:
    """Load a full or sharded checkpoint into `model` and `optimizer` (plain, or FSDP2-sharded over
    any number of ranks: a collective then); returns the trainer state, without the optimizer's.

    Sharded: each rank reads only what its shards need (DCP reshards to this run's layout).
    Full into an FSDP2 model: rank 0 alone reads the weights and optimizer state and broadcasts
    them (the other ranks map trainer_state.pt without reading it). Full into a plain model: each
    process reads it (DDP keeps a full copy per rank anyway).
    """
    path = Path(path)
    check_weight_files(path)  # before anything is loaded into the model
    if is_sharded_checkpoint(path):
        state = load_trainer_state(path)
        load_sharded_state(path, model, optimizer)
        return state
    main = not tdist.is_initialized() or tdist.get_rank() == 0
    state = load_trainer_state(path, mmap=is_sharded(model) and not main)  # those ranks only receive
    optimizer_state = state.pop(OPTIMIZER_STATE_KEY, None)
    if is_sharded(model):
        _broadcast_full_state(path, model, optimizer, optimizer_state, main=main, trust_remote_code=trust_remote_code)
    else:
        load_full_state(model, optimizer, _read_full_weights(path, trust_remote_code), optimizer_state)
    return state


def _broadcast_full_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                          optimizer_state: dict[str, Any] | None, *, main: bool, trust_remote_code: bool) -> None:
    """A full checkpoint into an FSDP2 model: rank 0 reads it, every rank receives its shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    if optimizer is not None and optimizer_state is not None and _is_index_keyed(optimizer_state):
        raise ValueError("this checkpoint's optimizer state is keyed by position (an older ddrl); it cannot "
                         "be resharded. Resume it without dist.strategy=fsdp, save once, then switch")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    full: dict[str, Any] = _read_full_weights(path, trust_remote_code) if main else {}  # dict is invariant
    set_model_state_dict(model, full, options=options)
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state if main else {}, options=options)


def _read_full_weights(path: Path, trust_remote_code: bool) -> dict[str, torch.Tensor]:
    from ddrl.models import load_model

    return load_model(path, trust_remote_code=trust_remote_code).state_dict()


def load_sharded_state(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """DCP-load a sharded checkpoint's model (and optimizer) state into this process's model,
    whatever its sharding: the current state dicts are the templates DCP fills."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    if optimizer is not None:  # get_state_dict gives a fresh optimizer its state (a zero-lr step) to fill
        model_state, optimizer_state = get_state_dict(model, optimizer)
        wanted = {MODEL_STATE_KEY: model_state, OPTIMIZER_STATE_KEY: optimizer_state}
    else:
        model_state = get_model_state_dict(model)
        wanted = {MODEL_STATE_KEY: model_state}
    reader = FileSystemReader(str(Path(checkpoint) / SHARDED_STATE_DIR))
    _check_sharded_keys(wanted, set(reader.read_metadata().state_dict_metadata), checkpoint)
    with quiet_single_process_dcp():
        load(wanted, storage_reader=reader, no_dist=not tdist.is_initialized())
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    else:
        set_model_state_dict(model, model_state)


def _check_sharded_keys(wanted: dict[str, Any], saved: set[str], checkpoint: Path) -> None:
    """Name the fix before DCP fails deep inside: the checkpoint must hold every tensor this model
    and optimizer have (DCP flattens nested keys with dots: model.<name>, optimizer.state.<name>.<field>)."""
    keys = [f"{MODEL_STATE_KEY}.{name}" for name in wanted[MODEL_STATE_KEY]]
    if OPTIMIZER_STATE_KEY in wanted:
        keys += [f"{OPTIMIZER_STATE_KEY}.state.{name}.{field}"
                 for name, fields in wanted[OPTIMIZER_STATE_KEY]["state"].items() for field in fields]
    missing = [k for k in keys if k not in saved]
    if missing:
        raise ValueError(f"the sharded checkpoint {str(checkpoint)!r} lacks {len(missing)} tensors this model or "
                         f"optimizer has ({missing[:3]} ...): was LoRA switched on or off, or the model changed? "
                         f"Resume with the model and LoRA settings the run started with")


# --------------------------------------------------------------------------------------------
# Loading at scale: rank 0 reads, the other ranks receive
# --------------------------------------------------------------------------------------------


def load_model_on_rank0(path: str | Path, dist: DistInfo, **load_kwargs: Any) -> Any:
    """ddrl.load_model(path, **load_kwargs) on rank 0 (weights on the CPU); on the other ranks the
    same model on the meta device: no memory for weights, and no weight read where the family's
    reader honours the meta device (ddrl.models.io.read_safetensors). Then wrap_from_rank0."""
    from ddrl.models import load_model

    if dist.is_main:
        return load_model(path, **load_kwargs)
    if load_kwargs.get("device") is not None:
        raise ValueError("load_model_on_rank0 builds the other ranks' models on the meta device; pass no device "
                         "(wrap_from_rank0 places the shards)")
    with torch.device("meta"):
        return load_model(path, **load_kwargs)


def wrap_from_rank0(model: torch.nn.Module, strategy: str, device: torch.device, dist: DistInfo,
                    **wrap_kwargs: Any) -> torch.nn.Module:
    """wrap_model(model, strategy, device, **wrap_kwargs) where only rank 0's model holds weights
    (load_model_on_rank0: the others' may be on the meta device); afterwards every rank holds rank
    0's values. FSDP2: rank 0's full state dict is taken before sharding, then sent into every rank's
    shards (broadcast_to_shards). DDP: the model is materialised and DDP's constructor broadcasts
    rank 0's parameters and buffers itself."""
    if not dist.enabled:
        return wrap_model(model, strategy, device, **wrap_kwargs)
    if strategy != "fsdp":
        _materialise(model, device)
        return wrap_model(model.to(device), strategy, device, **wrap_kwargs)
    full = model.state_dict() if dist.is_main else {}  # rank 0: the tensors as loaded (keep them on the CPU)
    wrapped = wrap_model(model, strategy, device, **wrap_kwargs)
    broadcast_to_shards(model, full, device)
    return wrapped


def broadcast_to_shards(model: torch.nn.Module, full_state: dict[str, torch.Tensor], device: torch.device) -> None:
    """After fully_shard: every rank's shards get rank 0's values. `full_state` is rank 0's full
    state dict taken before sharding ({} on the other ranks); a collective.

    Meta shards are first materialised on `device`; set_model_state_dict(broadcast_from_rank0)
    then sends one tensor at a time (rank 0 needs no second copy on the device). Buffers, which
    FSDP2 does not shard and which are not all in the state dict (rotary tables), are broadcast whole.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _materialise(model, device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    state: dict[str, Any] = full_state  # dict is invariant: torch asks for dict[str, ValueType]
    set_model_state_dict(model, state, options=options)
    with torch.no_grad():
        for buffer in model.buffers():
            tdist.broadcast(buffer, src=0)


def _materialise(model: torch.nn.Module, device: torch.device) -> None:
    """Meta tensors -> uninitialised ones on `device` (their values arrive by broadcast)."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=device)


# --------------------------------------------------------------------------------------------
# Full state dicts (the full format, which loads under any strategy)
# --------------------------------------------------------------------------------------------


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict]:
    """-> (model state or None, optimizer state keyed by parameter name).

    Sharded (FSDP2): a collective, so every rank must call it; full tensors are gathered to the CPU
    of rank 0 (the other ranks get empty dicts). Unsharded: the model state is None (save the
    module's own tensors) and the optimizer state is renamed, without copies.
    """
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options))
    return None, named_optimizer_state(model, optimizer)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict[str, Any],
                    optimizer_state: dict[str, Any] | None) -> None:
    """Load full model and optimizer states into a plain (unsharded) model; the optimizer state keyed
    by parameter name (or, from an older ddrl, by position)."""
    model.load_state_dict(model_state)
    if optimizer is not None and optimizer_state is not None:
        if _is_index_keyed(optimizer_state):
            optimizer.load_state_dict(optimizer_state)
        else:
            load_named_optimizer_state(model, optimizer, optimizer_state)


def named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """optimizer.state_dict() with parameter names instead of positions (the layout of
    torch.distributed.checkpoint's full optimizer state dict), so it loads under any strategy."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    own = optimizer.state_dict()
    names, groups = [], []
    for group in optimizer.param_groups:
        group_names = [name_of[id(p)] for p in group["params"]]
        names += group_names
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    state = {names[i]: s for i, s in own["state"].items()}
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                               named: dict[str, Any]) -> None:
    name_of = {id(p): n for n, p in model.named_parameters()}
    if len(named["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(named['param_groups'])} parameter groups, this one "
                         f"{len(optimizer.param_groups)}; resume with the same model and LoRA settings")
    state, groups, index = {}, [], 0
    for saved, group in zip(named["param_groups"], optimizer.param_groups):
        names = [name_of[id(p)] for p in group["params"]]
        if set(names) != set(saved["params"]):
            raise ValueError("the checkpoint's optimizer holds other parameters than this model's trainable ones "
                             "(was LoRA switched on or off?); resume with the settings the run started with")
        positions = []
        for n in names:
            if n in named["state"]:
                state[index] = named["state"][n]
            positions.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": positions})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _is_index_keyed(optimizer_state: dict[str, Any]) -> bool:
    groups = optimizer_state.get("param_groups") or [{}]
    return any(isinstance(p, int) for g in groups for p in g.get("params", []))


class GatheredModel:
    """Stands for a model whose weights were gathered: save_pretrained writes the given full state
    (what save_checkpoint calls on rank 0 of a sharded run)."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor] | None):
        self.model: Any = model  # a DiffusionLM or backbone: its save_pretrained takes state_dict=
        self.state = state

    def save_pretrained(self, directory: Any) -> None:
        self.model.save_pretrained(directory, state_dict=self.state)
