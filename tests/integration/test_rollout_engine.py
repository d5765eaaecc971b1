"""One rollout engine (ddrl.sampling.engine) serves training and evaluation: the same prompts and the
same generators give the same tokens through Trainer.rollout and through ddrl.eval's sampling
(sample_and_score), whatever batches each cuts them into, and both sample through the engine."""

from __future__ import annotations

import torch

from ddrl.config import RLConfig, load_config
from ddrl.eval import runner
from ddrl.sampling.engine import RolloutEngine
from ddrl.training.trainer import Trainer
from tests.integration.conftest import ROOT

GROUPS, G = 3, 4


def test_training_rollouts_and_evaluation_samples_are_one_path(tmp_path, monkeypatch):
    cfg = load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", [
        f"train.prompts_per_step={GROUPS}", f"train.group_size={G}", "eval.n=0", "eval.before=false",
        "rollout.temperature=1.0", "train.progress=false", "train.tensorboard=false", f"output_dir={tmp_path}"],
        RLConfig)
    trainer = Trainer(cfg)
    calls: list[tuple[list[int], torch.Tensor]] = []  # every engine call: its generators' seeds, its tokens
    generate = RolloutEngine.generate

    def recorded(self, prompt_ids, prompt_mask, generator, **kwargs):
        out = generate(self, prompt_ids, prompt_mask, generator, **kwargs)
        calls.append(([g.initial_seed() for g in generator.generators], out.completion_ids))
        return out

    monkeypatch.setattr(RolloutEngine, "generate", recorded)
    batch = trainer.rollout(1)
    [(seeds, rollout_ids)] = calls
    assert len(set(batch.completions)) > 1  # temperature 1: the generators decide the tokens

    # The step's examples evaluated with the rollout's settings, G samples each, example i seeded as the
    # trainer seeds group i, two examples per sampler call where the trainer made one call for all three.
    monkeypatch.setattr(runner, "example_seed", lambda seed, i: seeds[i])
    examples = [trainer.example(i) for i in range(GROUPS)]
    rows, _ = runner.sample_and_score(trainer.model, examples, trainer.cfg.rollout, runner.task_scoring(trainer.task),
                                      k=G, batch_size=2)
    assert [len(s) for s, _ in calls[1:]] == [2, 1], "evaluation samples through the rollout engine"
    assert torch.equal(torch.cat([ids for _, ids in calls[1:]]), rollout_ids)
    assert [c for row in rows for c in row["completions"]] == batch.completions
