"""`torchrun --nproc_per_node 2 -m ddrl train ...` on the CPU (gloo): DDP and FSDP2 runs give the
parameters and gradients of a 1-process run with the same global batch and seeds (also with group
filtering, which leaves the ranks different numbers of micro-batches), and a sharded run's
checkpoint loads and resumes in one process.

Exact equality needs every random draw to be independent of how rows are split over processes:
each rank makes one sampler call for its groups, each group drawing from its own generator
(seed, step, group's data position), and shared mask seeds do not depend on the rank. Estimators draw per-row noise from one generator for the whole
micro-batch, so a noisy estimator gives rank 1's rows other noise than the 1-process run's same
rows; the comparison therefore uses GRPO's mean-field estimator with p_mask_prompt=0, whose one
pass is noise-free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ddrl.tasks.sudoku import MiniSudokuTask
from tests.integration.conftest import ROOT


class DenseMiniSudoku(MiniSudokuTask):
    """Mini-Sudoku prompts with a dense reward (fraction of '1' digits), so that a barely trained
    tiny model gets rewards that vary within a group, hence non-zero advantages and gradients."""

    def reward(self, completions: list[str], **columns: object) -> list[float | None]:
        return [c.count("1") / 16 for c in completions]


def dense_mini_sudoku(**kwargs: object) -> DenseMiniSudoku:
    return DenseMiniSudoku(**kwargs)


class FilteredMiniSudoku(DenseMiniSudoku):
    """As DenseMiniSudoku, but every completion of a puzzle whose solution starts with "1" scores 1:
    train.group_filter=[0, 0.9] drops those groups. At seed 0 that is 1 of step 1's 4 groups, held by
    rank 1 of 2: the ranks keep 2 and 1 groups, so rank 1 must pad with a zero-weight micro-batch."""

    def reward(self, completions: list[str], **columns: object) -> list[float | None]:
        dense = super().reward(completions, **columns)
        return [1.0 if str(s).startswith("1") else r for r, s in zip(dense, columns["solution"])]


def filtered_mini_sudoku(**kwargs: object) -> FilteredMiniSudoku:
    return FilteredMiniSudoku(**kwargs)


def overrides(model_dir, out, strategy: str, steps: int = 2) -> list[str]:
    return [f"model.path={model_dir}", f"train.steps={steps}", "train.prompts_per_step=4", "train.group_size=4",
            "train.lr=1e-3", "train.micro_batch_size=4",  # accumulation: gradients sync on the last micro-batch only
            "train.save_every=1", "train.keep_checkpoints=3", "eval.n=0", "eval.before=false",
            "train.progress=false", "train.tensorboard=false", "method.estimator_args.p_mask_prompt=0",
            f"task.name={__name__}:dense_mini_sudoku", f"dist.strategy={strategy}", f"output_dir={out}",
            # Fixed-count decoding: threshold decoding turns float-level parameter differences
            # (FSDP's reduction order) into different committed tokens, hence different rollouts.
            "rollout.threshold=null"]


def ddrl_train(args: list[str], processes: int) -> None:
    """`ddrl train` in fresh processes (torchrun for 2), one thread each: the 1- and 2-process runs
    then do the same arithmetic, and 2 cores are not oversubscribed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    cmd = [sys.executable, *launcher, "-m", "ddrl", "train", str(ROOT / "configs/rl/grpo_mini_sudoku.yaml"), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[:4000] + '\n...\n' + done.stderr[-3000:]  # a rank's own traceback comes first, torchrun's summary last


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process_run(tiny_sudoku_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-process")
    ddrl_train(overrides(tiny_sudoku_model, out, "none", steps=3), processes=1)
    return out


def resumed_weights(model_dir, run) -> dict[str, torch.Tensor]:
    """The weights of run's newest checkpoint as one process resumes them (any format, sharded too)."""
    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    cfg = load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", overrides(model_dir, run, "none") + ["resume=true"],
                      RLConfig)
    trainer = Trainer(cfg)
    return {k.removeprefix("model."): v.detach() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_like_one(strategy, tiny_sudoku_model, one_process_run, tmp_path):
    ddrl_train(overrides(tiny_sudoku_model, tmp_path, strategy), processes=2)
    reference = weights(one_process_run / "checkpoint-2")
    assert max_diff(reference, weights(tiny_sudoku_model)) > 1e-4, "the 1-process run did not move: test is void"
    if strategy == "fsdp":  # FSDP writes sharded checkpoints (train.sharded_checkpoints=auto): no gather
        assert (tmp_path / "checkpoint-2" / "sharded_state").is_dir()
        assert max_diff(resumed_weights(tiny_sudoku_model, tmp_path), reference) < 1e-5
    else:
        assert max_diff(weights(tmp_path / "checkpoint-2"), reference) < 1e-5
    # Metrics are reduced over ranks: the 2-process reward mean is the 1-process one.
    ours = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (one_process_run / "metrics.jsonl").read_text().splitlines()][:2]
    assert [r["reward/mean"] for r in ours] == pytest.approx([r["reward/mean"] for r in theirs], abs=1e-9)
    assert ours[0]["reward/std"] > 0  # rewards vary within groups: the gradients were not zero
    # The gradient itself, not only the weights: AdamW's first updates are ~lr * sign(g), which a rank
    # that skipped the all-reduce (its own half of the batch) would mostly reproduce. The norm of the
    # clipped-before gradient is the full batch's only if every rank summed every rank's gradient.
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in theirs], rel=1e-4)

    if strategy == "fsdp":
        # The sharded run resumes in one process (optimizer state included) like the uninterrupted
        # 1-process run.
        ddrl_train(overrides(tiny_sudoku_model, tmp_path, "none", steps=3) + ["resume=true"], processes=1)
        # Not a weight comparison at step 3: from states equal to ~1e-8, Adam's normalised update
        # turns float-level noise in near-zero gradients (unused embedding rows) into lr-sized steps.
        # What must hold is that the optimizer state was carried over, not restarted.
        def adam_steps(run):
            state = torch.load(run / "checkpoint-3" / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
            return sorted({float(v["step"]) for v in state.values()})

        assert adam_steps(tmp_path) == adam_steps(one_process_run) == [6.0]  # 3 RL steps x mu=2


def test_group_filter_with_two_processes_trains_like_one(tiny_sudoku_model, tmp_path):
    """Each rank drops its filtered groups and pads to the other's micro-batch count, so the ranks run
    the same backward passes and the gradient is the 1-process one (before: filtering was off with
    several processes, and a rank with fewer micro-batches would hang the all-reduce)."""
    task = [f"task.name={__name__}:filtered_mini_sudoku", "train.group_filter=[0.0,0.9]"]
    ddrl_train(overrides(tiny_sudoku_model, tmp_path / "one", "none") + task, processes=1)
    ddrl_train(overrides(tiny_sudoku_model, tmp_path / "two", "ddp") + task, processes=2)
    ones = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    twos = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert ones[0]["update/groups_kept_frac"] == 0.75, "the filter must leave the ranks unequal: test is void"
    assert max_diff(weights(tmp_path / "one" / "checkpoint-2"), weights(tiny_sudoku_model)) > 1e-4
    assert max_diff(weights(tmp_path / "two" / "checkpoint-2"), weights(tmp_path / "one" / "checkpoint-2")) < 1e-5
    assert [r["grad_norm"] for r in twos] == pytest.approx([r["grad_norm"] for r in ones], rel=1e-4)
    # the dropped groups cost nothing on either rank (train.skip_uninformative drops more of them)
    assert [r["update/rows_frac"] for r in twos] == pytest.approx([r["update/rows_frac"] for r in ones], abs=1e-9)
