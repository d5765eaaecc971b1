"""Sharded checkpoints across process counts (2-process gloo FSDP2 on the CPU, one thread each):
a 2-process save loads in one process and a 1-process save loads into 2 processes, with the same
parameters and optimizer state; a full checkpoint loads into FSDP2 from rank 0 alone; and a model
read on rank 0 only reaches every rank's shards.

The workers are this module run under torchrun: `python -m tests.integration.test_sharded_checkpoint MODE ...`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
IDS = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 3]])


def torchrun(*args: object) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.integration.test_sharded_checkpoint", *map(str, args)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """Deterministic AdamW steps (the same batch on every rank: FSDP2's average is the 1-process gradient)."""
    for _ in range(steps):
        model(IDS).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def full_states(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """{"model": full state dict, "optimizer": full optimizer state keyed by name}: rank 0's under FSDP2."""
    from ddrl.training.checkpoint import gather_full_state

    if opt is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return {"model": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))}
    model_state, optimizer_state = gather_full_state(model, opt)
    return {"model": model_state if model_state is not None else model.state_dict(), "optimizer": optimizer_state}


def assert_same_states(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), k
    if "optimizer" in want:
        a, b = got["optimizer"]["state"], want["optimizer"]["state"]
        assert a.keys() == b.keys() and a
        for name in b:
            for field in b[name]:
                assert torch.equal(torch.as_tensor(a[name][field]), torch.as_tensor(b[name][field])), (name, field)
        lrs = [[g["lr"] for g in states["optimizer"]["param_groups"]] for states in (got, want)]
        assert lrs[0] == lrs[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.unit.test_checkpoint import tiny_builtin

    directory = tmp_path_factory.mktemp("base") / "model"
    tiny_builtin().save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------------------------
# 2-process FSDP2 save -> 1-process load
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_process_save(model_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("two-process-save")
    torchrun("save", model_dir, run)
    return run


def test_a_two_process_fsdp_save_is_shards_and_resumes_in_one_process(two_process_save, model_dir):
    from ddrl.models import load_model
    from ddrl.models.io import SHARDED_STATE_DIR
    from ddrl.training.checkpoint import load_training_checkpoint

    path = two_process_save / "checkpoint-1"
    assert len(list((path / SHARDED_STATE_DIR).glob("*.distcp"))) == 2  # each rank wrote its own shard
    assert not (path / "model.safetensors").exists()
    want = torch.load(two_process_save / "reference.pt", weights_only=False)  # gathered by the workers
    model = load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # another lr: the saved one must come back
    assert load_training_checkpoint(path, model, opt) == {"step": 1}
    assert not torch.equal(model.state_dict()["model.embed_tokens.weight"],
                           load_model(model_dir).state_dict()["model.embed_tokens.weight"])  # it trained
    assert_same_states(full_states(model, opt), want)


def test_load_model_reads_a_two_process_sharded_checkpoint(two_process_save):
    import ddrl

    want = torch.load(two_process_save / "reference.pt", weights_only=False)
    model = ddrl.load_model(two_process_save / "checkpoint-1")
    assert_same_states({"model": model.state_dict()}, {"model": want["model"]})
    assert model(IDS).logits.shape == (*IDS.shape, model.vocab_size)


# --------------------------------------------------------------------------------------------
# 1-process save -> 2-process FSDP2 load (sharded and full)
# --------------------------------------------------------------------------------------------


def test_one_process_checkpoints_load_into_two_process_fsdp(model_dir, tmp_path):
    from ddrl.models import load_model
    from ddrl.training.checkpoint import save_training_checkpoint
    from ddrl.training.distributed import DistInfo

    wants = {}
    for fmt, steps in (("sharded", 1), ("full", 2)):  # different states: one load cannot pass for the other
        model = load_model(model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2 * steps)
        train_steps(model, opt, steps)
        save_training_checkpoint(tmp_path / fmt, steps, model, opt, {"step": steps}, dist=DistInfo(),
                                 sharded=fmt == "sharded", keep=None)
        wants[fmt] = full_states(model, opt)
    torchrun("load", model_dir, tmp_path / "sharded" / "checkpoint-1", tmp_path / "full" / "checkpoint-2", tmp_path)
    for name, want in (("fsdp-sharded", wants["sharded"]), ("fsdp-full", wants["full"]),
                       ("plain-sharded", wants["sharded"])):
        assert_same_states(torch.load(tmp_path / f"{name}.pt", weights_only=False), want)


# --------------------------------------------------------------------------------------------
# Loading at scale: weights read on rank 0, broadcast into the shards
# --------------------------------------------------------------------------------------------


def test_weights_read_on_rank0_reach_every_rank(tmp_path):
    directory = FIXTURES / "llada" / "model"  # the native family of the 8B runs
    torchrun("rank0", directory, tmp_path)
    from ddrl.models import load_model

    want = load_model(directory).state_dict()
    report = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert report["meta_before_wrap"] == [False, True]  # rank 1 held no weights before the broadcast
    for strategy in ("fsdp", "ddp"):
        assert_same_states({"model": report[strategy]}, {"model": want})
        assert all(torch.equal(b, torch.arange(4.0)) for b in report[f"{strategy}_buffers"])  # a non-persistent buffer


# --------------------------------------------------------------------------------------------
# The workers
# --------------------------------------------------------------------------------------------


def _save_worker(model_dir: str, run: str) -> None:
    from ddrl.models import load_model
    from ddrl.training.checkpoint import save_training_checkpoint
    from ddrl.training.distributed import init_distributed, wrap_model

    cpu = torch.device("cpu")
    info = init_distributed(None, cpu)
    model = load_model(model_dir)
    wrap_model(model, "fsdp", cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 1)
    path = save_training_checkpoint(Path(run), 1, model, opt, {"step": 1}, dist=info, sharded=True, keep=None)
    assert path.is_dir()  # on every rank: the checkpoint is in place when the save returns
    reference = full_states(model, opt)
    if info.is_main:
        torch.save(reference, Path(run) / "reference.pt")


def _load_worker(model_dir: str, sharded: str, full: str, out: str) -> None:
    from ddrl.models import load_model
    from ddrl.training.checkpoint import load_training_checkpoint
    from ddrl.training.distributed import init_distributed, wrap_model

    cpu = torch.device("cpu")
    info = init_distributed(None, cpu)
    results = {}
    model = load_model(model_dir)
    wrap_model(model, "fsdp", cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_training_checkpoint(Path(sharded), model, opt)
    results["fsdp-sharded"] = full_states(model, opt)
    load_training_checkpoint(Path(full), model, opt)  # rank 0 reads, broadcasts
    results["fsdp-full"] = full_states(model, opt)
    plain = load_model(model_dir)  # unsharded, under a process group (DDP's case)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    load_training_checkpoint(Path(sharded), plain, plain_opt)
    results["plain-sharded"] = full_states(plain, plain_opt)
    if info.is_main:
        for name, states in results.items():
            torch.save(states, Path(out) / f"{name}.pt")


def _rank0_worker(model_dir: str, out: str) -> None:
    import torch.distributed as tdist

    from ddrl.training.checkpoint import load_model_on_rank0, wrap_from_rank0
    from ddrl.training.distributed import init_distributed

    cpu = torch.device("cpu")
    info = init_distributed(None, cpu)
    report: dict = {}
    for strategy in ("fsdp", "ddp"):
        model = load_model_on_rank0(model_dir, info)
        meta = all(p.is_meta for p in model.parameters())
        probe = torch.arange(4.0) if info.is_main else torch.empty(4, device="meta")
        model.register_buffer("probe", probe, persistent=False)  # like a rotary table: not in the state dict
        wrapped = wrap_from_rank0(model, strategy, cpu, info)
        flags: list = [None] * info.world_size
        tdist.all_gather_object(flags, meta)
        report.setdefault("meta_before_wrap", flags)
        buffers: list = [None] * info.world_size
        tdist.all_gather_object(buffers, model.probe.clone())
        report[f"{strategy}_buffers"] = buffers
        if strategy == "fsdp":
            report[strategy] = full_states(model)["model"]
        else:  # DDP: rank 1's own replica, which must equal rank 0's weights
            replicas: list = [None] * info.world_size
            tdist.all_gather_object(replicas, {k: v.clone() for k, v in wrapped.module.state_dict().items()})
            report[strategy] = replicas[1]
    if info.is_main:
        torch.save(report, Path(out) / "rank0.pt")


if __name__ == "__main__":
    from ddrl.training.distributed import end_process_group, exit_without_finalizing

    {"save": _save_worker, "load": _load_worker, "rank0": _rank0_worker}[sys.argv[1]](*sys.argv[2:])
    end_process_group()
    exit_without_finalizing(0)  # gloo's threads can abort the interpreter's exit (SIGABRT): its docstring
