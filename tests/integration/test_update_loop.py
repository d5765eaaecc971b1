"""The RL step's loop at scale, on the CPU: one batched sampler call per rollout step, no redundant old
pass, no host sync per statistic, TraceRL's micro-batches of state rows and UniGRPO's of copy rows, and
a SIGTERM that ends the run cleanly after a checkpoint."""

from __future__ import annotations

import json
import os
import signal

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddrl.config import RLConfig, load_config
from ddrl.processes.draws import RowGenerators
from ddrl.sampling import engine as engine_mod
from ddrl.training import trainer as trainer_mod
from ddrl.training.trainer import Trainer, train
from tests.integration.conftest import ROOT, rl_overrides


def _trainer(model, tmp_path, method: str, *extra: str) -> Trainer:
    cfg = load_config(ROOT / f"configs/rl/{method}_mini_sudoku.yaml",
                      rl_overrides(model, tmp_path) + ["eval.before=false", "eval.n=0", *extra], RLConfig)
    return Trainer(cfg)


def test_one_sampler_call_per_rollout_step_with_a_generator_per_group(tiny_sudoku_model, tmp_path, monkeypatch):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "grpo", "train.prompts_per_step=2", "train.group_size=4")
    calls, devices = [], []
    real_samplers, real_make = engine_mod.SAMPLERS, trainer_mod.make_generator

    class Samplers:
        def get(self, name):
            sampler = real_samplers.get(name)

            def counted(model, prompt_ids, prompt_mask, cfg, **kwargs):
                calls.append((prompt_ids.shape[0], kwargs["generator"]))
                return sampler(model, prompt_ids, prompt_mask, cfg, **kwargs)
            return counted

    def make_generator(seed, device="cpu"):
        devices.append(torch.device(device))
        return real_make(seed, device)

    monkeypatch.setattr(engine_mod, "SAMPLERS", Samplers())  # the rollout engine looks the sampler up
    monkeypatch.setattr(trainer_mod, "make_generator", make_generator)
    batch = trainer.rollout(1)
    assert len(calls) == 1, "all of a rank's groups go through one sampler call"
    rows, generator = calls[0]
    assert rows == len(batch) == 8
    assert isinstance(generator, RowGenerators) and generator.rows_per_generator == 4
    assert len(generator.generators) == 2 and devices == [trainer.device, trainer.device]  # on the model's device


def _count_passes(trainer: Trainer) -> dict[str, int]:
    counts = {"old": 0, "ref": 0, "cur": 0}
    real = trainer.estimator

    def estimator(model, mb, seed):
        role = "cur" if torch.is_grad_enabled() else ("ref" if model is trainer.ref_model else "old")
        counts[role] += 1
        return real(model, mb, seed)

    trainer.estimator = estimator
    trainer.train_step(1)
    return counts


def test_the_first_optimizer_step_needs_no_old_pass(tiny_sudoku_model, tmp_path):
    # mu = 2 inner iterations x 2 minibatches of one group each = 4 optimizer steps, 4 current passes.
    # The old pass of the first one would run the unchanged rollout policy on the same masks: it is
    # sg(current) there, so 3 old passes, not 4. With dropout on, every pass draws its own dropout.
    loop = ["train.num_iterations=2", "train.minibatches=2", "train.skip_uninformative=false"]
    shared = _count_passes(_trainer(tiny_sudoku_model, tmp_path / "a", "grpo", *loop))
    assert shared == {"old": 3, "ref": 4, "cur": 4}
    dropout = _count_passes(_trainer(tiny_sudoku_model, tmp_path / "b", "grpo", *loop, "train.disable_dropout=false"))
    assert dropout["old"] == 4
    fresh = _count_passes(_trainer(tiny_sudoku_model, tmp_path / "c", "grpo", *loop, "method.fresh_masks=true"))
    assert fresh["old"] == 4  # fresh masks: the old pass sees other masks than the current one


class _HostSyncs(TorchDispatchMode):
    """Counts reads of a tensor's value on the host (.item(), float(), bool(): aten._local_scalar_dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.paused = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_update_reads_one_value_per_optimizer_step(tiny_sudoku_model, tmp_path):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "grpo", "train.num_iterations=2", "train.minibatches=2",
                       "train.micro_batch_size=4", "train.skip_uninformative=false")
    batch = trainer.rollout(1)
    trainer.score(batch)
    trainer.advantages(batch)
    plan = trainer.planner.plan(batch, trainer.planner.filter_groups(batch))
    old, ref = trainer.behaviour_passes(plan.micro, 1, trainer_mod.Clock({}))
    syncs = _HostSyncs()

    def paused(fn):  # the estimator, the objective, AdamW and the CPU-resident mask seeds are not the loop's
        def call(*args, **kwargs):
            syncs.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                syncs.paused -= 1
        return call

    trainer.estimator, trainer.method.loss, trainer.opt.step = (paused(trainer.estimator), paused(trainer.method.loss),
                                                                paused(trainer.opt.step))
    trainer._seed = paused(trainer._seed)  # batch.mask_seeds lives on the CPU: reading it waits for no device
    with syncs:
        stats = trainer.update(plan.micro, old, ref, 1, plan.counts)
    assert stats["optimizer_steps"] == 4
    assert syncs.count == 4, f"{syncs.count} host reads for 4 optimizer steps: stats must stay on the device"


def _grads_at_the_step(trainer: Trainer) -> list[torch.Tensor]:
    grads: list[torch.Tensor] = []
    real_step = trainer.opt.step

    def step(*args, **kwargs):
        grads.extend(p.grad.clone() for p in trainer.model.parameters() if p.grad is not None)
        return real_step(*args, **kwargs)

    trainer.opt.step = step
    return grads


def _chunked_rows_and_grads(whole, rows, rows_of) -> tuple[list[int], Any]:
    """Step `whole` and `rows` (train.micro_batch_rows) until a step has a gradient; the state rows each
    backward of `rows` ran (rows_of(micro-batch)), the rollout of that step, and both steps' gradients
    compared (the whole gradient through the chunks)."""
    seen: list[int] = []
    real = rows.estimator

    def estimator(model, mb, seed):
        if torch.is_grad_enabled():
            seen.append(rows_of(mb))
        return real(model, mb, seed)

    rows.estimator = estimator
    expected, got = _grads_at_the_step(whole), _grads_at_the_step(rows)
    for step in range(1, 5):  # the first step with a gradient (before it, no weight moved: same rollouts)
        seen.clear(), expected.clear(), got.clear()
        batch = whole.rollout(step)  # the rollout the step will draw
        whole.score(batch)
        whole.train_step(step)
        rows.train_step(step)
        if any(g.abs().max() > 0 for g in expected):
            break
    else:
        raise AssertionError("no step had a gradient: test is void")
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    return seen, batch


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_trace_micro_batches_hold_at_most_n_state_rows_and_give_the_whole_gradient(tiny_sudoku_model, tmp_path):
    loop = ["train.num_iterations=1", "train.prompts_per_step=2", "train.group_size=4", "rollout.steps=4",
            "train.skip_uninformative=false"]
    whole = _trainer(tiny_sudoku_model, tmp_path / "whole", "tracerl", *loop)
    rows = _trainer(tiny_sudoku_model, tmp_path / "rows", "tracerl", *loop, "train.micro_batch_rows=3")
    seen, batch = _chunked_rows_and_grads(whole, rows, lambda mb: int(mb.extras["trace_states"].sum()))
    assert len(seen) > 2 and max(seen) <= 3, seen  # backward per chunk of at most 3 state rows
    assert sum(seen) == whole.method.count_rows(batch)  # every (sample, state) row exactly once


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_unigrpo_copy_rows_in_chunks_give_the_whole_gradient(tiny_sudoku_model, tmp_path):
    """train.micro_batch_rows on random_ratio's (sample, copy) rows: backward per chunk of at most 5 of
    the 8 x 3 rows (chunks split a sample's copies), the optimizer step's gradient the uncut one."""
    loop = ["train.num_iterations=1", "train.prompts_per_step=2", "train.group_size=4", "rollout.steps=4",
            "train.skip_uninformative=false", "method.estimator_args.copies=3"]
    whole = _trainer(tiny_sudoku_model, tmp_path / "whole", "unigrpo", *loop)
    rows = _trainer(tiny_sudoku_model, tmp_path / "rows", "unigrpo", *loop, "train.micro_batch_rows=5")
    seen, batch = _chunked_rows_and_grads(whole, rows, lambda mb: int(mb.extras["copy_rows"].sum()))
    assert len(seen) > 2 and max(seen) <= 5, seen
    assert sum(seen) == whole.method.count_rows(batch) == 3 * int(batch.reward_valid.sum())


def test_sigterm_ends_the_run_after_a_checkpoint_and_resume_loses_nothing(tiny_sudoku_model, tmp_path, monkeypatch):
    cfg = ROOT / "configs/rl/grpo_mini_sudoku.yaml"
    base = rl_overrides(tiny_sudoku_model, tmp_path / "run", steps=4) + ["eval.before=false", "eval.n=0"]
    uninterrupted = train(cfg, rl_overrides(tiny_sudoku_model, tmp_path / "ref", steps=4) + ["eval.before=false",
                                                                                             "eval.n=0"])
    original = Trainer.train_step

    def term_after_2(self, step):
        out = original(self, step)
        if step == 2:
            handler = signal.getsignal(signal.SIGTERM)
            assert handler not in (signal.SIG_DFL, signal.SIG_IGN, None), "Trainer.run installs no SIGTERM handler"
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "train_step", term_after_2)
    run = train(cfg, base)  # returns normally
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    monkeypatch.setattr(Trainer, "train_step", original)
    train(cfg, base + ["resume=true"])
    from safetensors.torch import load_file

    a, b = (load_file(d / "checkpoint-4" / "model.safetensors") for d in (uninterrupted, run))
    assert all(torch.equal(a[k], b[k]) for k in a)
