"""The trainer follows the typed Method: minibatch optimizer steps, reused or shared mask seeds,
the invalid-reward policy, dropout off in every RL pass, and no attribute guessing."""

from __future__ import annotations

import torch

from ddrl.config import RLConfig, load_config
from ddrl.training.loss_terms import ElboTerm
from ddrl.training.method import build_method
from ddrl.training.trainer import Trainer
from tests.integration.conftest import ROOT, rl_overrides


def _trainer(tiny_sudoku_model, tmp_path, method: str, *extra: str) -> Trainer:
    cfg = load_config(ROOT / f"configs/rl/{method}_mini_sudoku.yaml",
                      rl_overrides(tiny_sudoku_model, tmp_path) + ["eval.before=false", *extra], RLConfig)
    return Trainer(cfg)


def _spy_steps_and_counts(trainer: Trainer) -> tuple[list[int], list[float]]:
    steps, rows = [], []
    real_step, real_loss = trainer.sched.step, trainer.method.loss

    def step(*a, **kw):
        steps.append(1)
        return real_step(*a, **kw)

    def loss(mb, new, old, ref, counts):
        rows.append(counts.sequences)
        return real_loss(mb, new, old, ref, counts)

    trainer.sched.step, trainer.method.loss = step, loss  # one scheduler step per optimizer step
    return steps, rows


def test_minibatches_take_one_optimizer_step_per_share(tiny_sudoku_model, tmp_path):
    # 2 prompts x 4 completions, 2 inner iterations, 2 minibatches: 4 optimizer steps, each loss
    # normalised by its own share (4 rows), and an old pass because old != current after a step.
    trainer = _trainer(tiny_sudoku_model, tmp_path, "grpo", "train.num_iterations=2", "train.minibatches=2",
                       "train.skip_uninformative=false")
    steps, rows = _spy_steps_and_counts(trainer)
    seen_old = []
    real_est = trainer.estimator

    def estimator(model, mb, seed):
        out = real_est(model, mb, seed)
        seen_old.append(not torch.is_grad_enabled())
        return out

    trainer.estimator = estimator
    trainer.train_step(1)
    assert len(steps) == 4
    assert rows == [4.0, 4.0, 4.0, 4.0]
    assert any(seen_old), "minibatch steps need the behaviour policy's log-probs"


def test_one_update_needs_no_old_pass(tiny_sudoku_model, tmp_path):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "grpo", "train.num_iterations=1", "train.skip_uninformative=false")
    steps, rows = _spy_steps_and_counts(trainer)
    trainer.train_step(1)
    assert len(steps) == 1 and rows == [8.0]


def _seeds_per_iteration(trainer: Trainer) -> list[int]:
    seeds = []
    real_est = trainer.estimator

    def estimator(model, mb, seed):
        if torch.is_grad_enabled():
            seeds.append(seed)
        return real_est(model, mb, seed)

    trainer.estimator = estimator
    trainer.train_step(1)
    return seeds


def test_reused_masks_give_every_iteration_the_first_seed(tiny_sudoku_model, tmp_path):
    shared = _seeds_per_iteration(_trainer(tiny_sudoku_model, tmp_path / "a", "fpo", "train.num_iterations=2",
                                           "method.reuse_masks=false", "train.skip_uninformative=false"))
    reused = _seeds_per_iteration(_trainer(tiny_sudoku_model, tmp_path / "b", "fpo", "train.num_iterations=2",
                                           "method.reuse_masks=true", "train.skip_uninformative=false"))
    assert len(shared) == len(reused) == 2
    assert shared[0] != shared[1] and reused[0] == reused[1] == shared[0]


def test_invalid_rewards_dropped_or_zero(tiny_sudoku_model, tmp_path):
    for policy, expect_valid in (("drop", False), ("zero", True)):
        trainer = _trainer(tiny_sudoku_model, tmp_path / policy, "grpo", f"method.invalid_reward={policy}")
        batch = trainer.rollout(1)
        trainer.task.reward = lambda completions, **_: [None] + [1.0] * (len(completions) - 1)
        trainer.score(batch)
        assert bool(batch.reward_valid[0]) is expect_valid
        assert batch.rewards[0].item() == 0.0 if expect_valid else torch.isnan(batch.rewards[0])
        trainer.advantages(batch)
        # "zero" keeps the row in its group's mean: the others sit above it
        assert (batch.advantages[0].item() < 0) if expect_valid else batch.advantages[0].item() == 0.0


def test_dropout_is_off_in_rl_passes_unless_asked(tiny_sudoku_model, tmp_path):
    lora = ["model.lora.rank=4", "model.lora.dropout=0.3"]
    on = _trainer(tiny_sudoku_model, tmp_path / "on", "grpo", *lora, "train.disable_dropout=false")
    off = _trainer(tiny_sudoku_model, tmp_path / "off", "grpo", *lora)
    drops = lambda t: [m.p for m in t.model.modules() if isinstance(m, torch.nn.Dropout)]  # noqa: E731
    assert drops(on) and max(drops(on)) == 0.3
    assert drops(off) and max(drops(off)) == 0.0


def test_method_is_typed_and_read_once():
    cfg = load_config(ROOT / "configs/rl/daca_grpo_mini_sudoku.yaml", ["method.advantage_std=population"], RLConfig)
    method = build_method(cfg)
    assert method.needs_trajectory and method.needs_ref and not method.skip_safe
    assert method.advantage.std == "population" and method.advantage.invalid == "drop"
    cfg = load_config(ROOT / "configs/rl/dipod_mini_sudoku.yaml", ["method.elbo_reg=0.2"], RLConfig)
    method = build_method(cfg)
    assert method.objective.elbo_reg == 0.2 and method.terms == ()  # one regulariser, DiPOD's own field
    cfg = load_config(ROOT / "configs/rl/spg_mini_sudoku.yaml", ["method.elbo_reg=0.1"], RLConfig)
    assert build_method(cfg).terms == (ElboTerm(0.1),) and not build_method(cfg).skip_safe


def test_group_filter_and_truncated_reward(tiny_sudoku_model, tmp_path):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "tracerl", "train.group_filter=[0.2,0.8]",
                       "train.truncated_reward=0.0", "rollout.early_exit=false")
    batch = trainer.rollout(1)
    eos = trainer.model.tokenizer.eos_token_id
    batch.completion_ids[:, -1] = eos  # every row ends ...
    batch.completion_ids[0] = batch.completion_ids[0].masked_fill(batch.completion_ids[0] == eos, eos + 1)  # ... but row 0
    trainer.task.reward = lambda completions, **_: [1.0] * len(completions)
    trainer.score(batch)
    assert batch.rewards[0].item() == 0.0 and (batch.rewards[1:] == 1.0).all()  # the cut-off answer is wrong
    trainer.advantages(batch)
    kept = trainer.planner.filter_groups(batch)
    # group 0: 3/4 right (kept, within [0.2, 0.8]); group 1: 4/4 right (left out)
    assert kept.group_ids.tolist() == [0, 0, 0, 0]


def test_truncation_margin_counts_answers_at_the_limit_as_cut_off(tiny_sudoku_model, tmp_path):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "tracerl", "train.truncated_reward=0.0",
                       "train.truncation_margin=2", "rollout.early_exit=false")
    batch = trainer.rollout(1)
    eos, L = trainer.model.tokenizer.eos_token_id, batch.completion_ids.shape[1]
    batch.completion_ids[:] = eos + 1
    batch.completion_ids[0, L - 2] = eos  # ends 2 tokens before the limit: within the margin
    batch.completion_ids[1:, 0] = eos  # the others end at once
    from ddrl.data import completion_mask, model_stop_ids

    batch.completion_mask = completion_mask(batch.completion_ids, model_stop_ids(trainer.model))
    trainer.task.reward = lambda completions, **_: [1.0] * len(completions)
    trainer.score(batch)
    assert batch.rewards[0].item() == 0.0 and (batch.rewards[1:] == 1.0).all()


def test_a_step_whose_groups_are_all_filtered_skips_the_update(tiny_sudoku_model, tmp_path):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "grpo", "train.group_filter=[0.2,0.8]", "train.minibatches=2")
    trainer.task.reward = lambda completions, **_: [1.0] * len(completions)  # every group all right: filtered
    steps, _ = _spy_steps_and_counts(trainer)
    lines = _log_lines("ddrl.training.update_plan")
    metrics = trainer.train_step(1)
    assert steps == [] and metrics["update/skipped"] == 1.0 and metrics["update/groups_kept_frac"] == 0.0
    trainer.train_step(2)
    # not silent: one line per such step, saying why and how often so far
    assert len(lines) == 2, lines
    assert "step 2 made no update: train.group_filter=[0.2, 0.8] dropped every group" in lines[1]
    assert "2 step(s) of this run so far" in lines[1]


def _log_lines(name: str) -> list[str]:
    """The messages logged to `name` from now on (whatever handlers the CLI set on "ddrl")."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger(name).addHandler(Keep(logging.INFO))
    return lines


def test_minibatch_shares_after_a_filter_hold_whole_groups(tiny_sudoku_model, tmp_path):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "grpo", "train.minibatches=2", "train.prompts_per_step=4")
    batch = trainer.rollout(1)
    trainer.task.reward = lambda completions, **_: ([1.0] * 4 + [0.0, 1.0, 0.0, 1.0]) * 2  # groups 0, 2 uniform
    trainer.score(batch)
    trainer.cfg.train.group_filter = [0.2, 0.8]
    kept = trainer.planner.filter_groups(batch)
    shares = trainer.planner.minibatch_shares(kept)
    assert [s.group_ids.tolist() for s in shares] == [[1] * 4, [3] * 4]


def test_sync_ref_every_copies_the_policy_into_the_reference(tiny_sudoku_model, tmp_path):
    from ddrl.training.trainer import train

    cfg_path = ROOT / "configs/rl/grpo_mini_sudoku.yaml"

    def run(every: int) -> bool:  # True when the reference equals the trained policy
        trainer = Trainer(load_config(cfg_path, rl_overrides(tiny_sudoku_model, tmp_path / str(every)) + [
            "eval.before=false", "eval.n=0", f"train.sync_ref_every={every}", "train.steps=1",
            "train.skip_uninformative=false"], RLConfig))
        assert trainer.ref_model is not None
        trainer.run()
        return all(torch.equal(r, p) for r, p in zip(trainer.ref_model.parameters(), trainer.model.parameters()))

    assert run(1) and not run(0)  # the policy moved; only the synced reference follows it
    with __import__("pytest").raises(ValueError, match="sync_ref_every needs a separate reference"):
        train(cfg_path, rl_overrides(tiny_sudoku_model, tmp_path / "lora") + ["train.sync_ref_every=1",
                                                                              "model.lora.rank=4"])


def test_naive_grpo_on_udm_trains_through_the_trainer(tmp_path):
    # UDM-GRPO's ablation: the rollout's own states as inputs and each step's output as the action
    # (it needs the sampler's trajectory, which the trainer asks for from the estimator)
    cfg = load_config(ROOT / "configs/rl/udm_grpo_digits.yaml",
                      ["train.steps=1", "train.prompts_per_step=2", "train.group_size=4", "eval.n=0",
                       "rollout.steps=4", "train.progress=false", f"output_dir={tmp_path}",
                       "method.estimator_args.forward_process=false", "method.estimator_args.clean_target=false"],
                      RLConfig)
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(1)
    assert metrics.get("update/skipped", 0.0) == 0.0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
