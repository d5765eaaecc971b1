"""rollout.max_prompt_length: a longer prompt keeps its last N tokens, as TRL and d1 do
(`prompt_ids[:, -max_prompt_length:]`), in the rollout sampler, in every likelihood pass on those
rollouts, and in evaluation; each step counts the prompts it cut (rollout/truncated_prompts)."""

from __future__ import annotations

import pytest
import torch

from ddrl.config import RLConfig, SamplerConfig, load_config
from ddrl.data import encode_prompts
from ddrl.eval import evaluate
from ddrl.registry import SAMPLERS
from ddrl.training.trainer import Trainer
from tests.integration.conftest import ROOT, rl_overrides
from tests.integration.test_cli import ddrl


def _spy_sampler(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every sampler call's (prompt_ids, prompt_mask)."""
    seen, real_get = [], SAMPLERS.get

    def get(name):
        sampler = real_get(name)

        def spy(model, prompt_ids, prompt_mask, *args, **kwargs):
            seen.append((prompt_ids.clone(), prompt_mask.clone()))
            return sampler(model, prompt_ids, prompt_mask, *args, **kwargs)

        return spy

    monkeypatch.setattr(SAMPLERS, "get", get)
    return seen


def _trainer(model, tmp_path, *extra) -> Trainer:
    cfg = load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml",
                      rl_overrides(model, tmp_path) + ["eval.before=false", "train.skip_uninformative=false",
                                                       *extra], RLConfig)
    return Trainer(cfg)


def test_rollouts_and_likelihood_passes_see_the_last_n_prompt_tokens(tiny_sudoku_model, tmp_path, monkeypatch,
                                                                     capsys):
    trainer = _trainer(tiny_sudoku_model, tmp_path, "rollout.max_prompt_length=10", "train.num_iterations=2")
    sampled = _spy_sampler(monkeypatch)
    scored = []
    real_estimator = trainer.estimator

    def estimator(model, mb, seed):
        scored.append(mb.prompt_ids.clone())
        return real_estimator(model, mb, seed)

    trainer.estimator = estimator
    metrics = trainer.train_step(1)

    prompts = [trainer.example(i)["prompt"] for i in range(2)]  # the step's 2 prompts: 16 cells + BOS = 17 tokens
    full, _ = encode_prompts(trainer.model.tokenizer, prompts)
    assert full.shape[1] == 17
    expected = full[:, -10:].repeat_interleave(4, 0)  # TRL's cut of the left-padded batch, G = 4 rows each
    (ids, mask), = sampled
    assert torch.equal(ids.cpu(), expected) and bool(mask.all())
    assert len(scored) >= 2 and all(torch.equal(s, ids) for s in scored)  # old and current passes: the same prompt
    assert metrics["rollout/truncated_prompts"] == 2.0
    out = capsys.readouterr().out
    assert "2 of this step's 2 prompts are longer than rollout.max_prompt_length=10" in out

    trainer.train_step(2)  # announced once; every step still counts
    assert "max_prompt_length=10" not in capsys.readouterr().out

    uncut = _trainer(tiny_sudoku_model, tmp_path / "uncut").train_step(1)
    assert uncut["rollout/truncated_prompts"] == 0.0


def test_a_max_prompt_length_the_model_cannot_hold_fails_at_startup(tiny_sudoku_model, tmp_path):
    # max_seq_len 48 - gen_length 16 leaves 32 prompt tokens
    with pytest.raises(ValueError, match="rollout.max_prompt_length=40 does not fit.*max_seq_len=48.*"
                                         "rollout.gen_length=16 leaves 32.*at most 32"):
        _trainer(tiny_sudoku_model, tmp_path, "rollout.max_prompt_length=40")


def test_evaluation_cuts_prompts_as_the_rollouts_do(tiny_sudoku_model, monkeypatch):
    from ddrl.models import load_model
    from ddrl.tasks import get_task

    model, task = load_model(tiny_sudoku_model), get_task("mini_sudoku")
    sampled = _spy_sampler(monkeypatch)
    sampler = SamplerConfig(gen_length=16, steps=2, block_length=16, temperature=0.0, max_prompt_length=10)
    evaluate(model, task, n=3, sampler=sampler, batch_size=3)
    (ids, mask), = sampled
    assert ids.shape == (3, 10) and bool(mask.all())
    full, _ = encode_prompts(model.tokenizer, [ex["prompt"] for ex in task.test_examples(3)])
    assert sorted(map(tuple, ids.tolist())) == sorted(map(tuple, full[:, -10:].tolist()))


def test_cli_sample_truncates_with_the_flag_and_names_it_without(tiny_sudoku_model):
    refused = ddrl("sample", "--model", tiny_sudoku_model, "--prompt", "1" * 60, "--gen-length", 16)
    assert refused.returncode == 2 and "--max-prompt-length for ddrl eval and sample" in refused.stderr, refused.stderr
    cut = ddrl("sample", "--model", tiny_sudoku_model, "--prompt", "1" * 60, "--gen-length", 16,
               "--max-prompt-length", 20)
    assert cut.returncode == 0, cut.stderr
