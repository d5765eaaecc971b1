"""rollout.batch_rows: the rollout cut into sampler calls of at most that many rows
(ddrl.sampling.base.sample_in_chunks), so that a call holds the logits of that many rows only.

Calls of whole prompt groups give the tokens of one call (each group draws from its own generator);
calls that split a group give every row its own generator, seeded from the group's, so the tokens are
the same for every batch_rows below the group size. Checked on the masked sampler of the shipped tiny
Sudoku model and on the emerge sampler of a tiny MMaDA text-to-image model under guidance (the sampler
and the prompt layout MaskGRPO's image recipe runs), with a spy that counts the calls and their rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ddrl
import ddrl.sampling  # noqa: F401  (registers the samplers)
from ddrl.data import encode_prompts
from ddrl.config import ConfigError, RLConfig, SamplerConfig, load_config
from ddrl.processes.draws import RowGenerators
from ddrl.registry import SAMPLERS
from ddrl.sampling.base import sample_in_chunks

ROOT = Path(__file__).resolve().parents[2]
GROUPS, G = 3, 4


def _sudoku():
    model = ddrl.load_model(ROOT / "checkpoints/mini_sudoku-masked").eval()
    rows, mask = encode_prompts(model.tokenizer, ["4..1.2....3.1..4", "..3.4......1.2..", "1...2...3...4..."])
    cfg = SamplerConfig(name="masked", steps=8, gen_length=8, block_length=8, temperature=1.0)
    return model, rows, mask, cfg


def _mmada(tmp_path_factory):
    from tests.unit.test_mmada_t2i import write_magvit, write_tiny_mmada

    root = tmp_path_factory.mktemp("batch_rows_mmada")
    model = ddrl.load_model(write_tiny_mmada(root / "mmada"), dtype="float32",
                            vq_path=write_magvit(root / "magvit")).eval()
    rows, mask = encode_prompts(model.tokenizer, ["a red cat", "dog", "a tree"])  # the t2i layout
    return model, rows, mask, SamplerConfig(name="emerge", steps=3, gen_length=4, temperature=1.0, cfg_scale=3.5,
                                            cache="none")


@pytest.fixture(scope="module", params=["masked_sudoku", "emerge_mmada_cfg"])
def setting(request, tmp_path_factory):
    return _sudoku() if request.param == "masked_sudoku" else _mmada(tmp_path_factory)


def _rollout(setting, batch_rows):
    """Completions [GROUPS * G, L] of one rollout at batch_rows, and the rows of each sampler call."""
    model, prompts, mask, cfg = setting
    cfg = SamplerConfig(**{**vars(cfg), "batch_rows": batch_rows})
    calls = []
    real = SAMPLERS.get(cfg.name)

    def spy(model, ids, prompt_mask, cfg, **kwargs):
        calls.append(ids.shape[0])
        return real(model, ids, prompt_mask, cfg, **kwargs)

    generators = RowGenerators([torch.Generator().manual_seed(100 + i) for i in range(GROUPS)], G)
    out = sample_in_chunks(spy, model, prompts.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), cfg,
                           generator=generators)
    assert out.completion_ids.shape[0] == GROUPS * G and out.nfe == len(calls) * cfg.steps
    return out.completion_ids, calls


def test_calls_of_whole_groups_give_the_tokens_of_one_call(setting):
    whole, calls = _rollout(setting, None)
    assert calls == [GROUPS * G]
    for rows, expected in ((G, [G] * GROUPS), (2 * G, [2 * G, G]), (2 * G + 1, [2 * G, G])):
        tokens, calls = _rollout(setting, rows)
        assert calls == expected, (rows, calls)
        assert torch.equal(tokens, whole), f"batch_rows={rows} changed the tokens"


def test_calls_that_split_groups_draw_each_row_alone(setting):
    one, calls = _rollout(setting, 1)
    assert calls == [1] * (GROUPS * G)
    three, calls = _rollout(setting, 3)
    assert calls == [3, 1] * GROUPS  # a call never spans two groups
    assert torch.equal(one, three), "rows drawn from their own generators depend on how a group is split"
    assert len({tuple(r) for r in one.tolist()}) > GROUPS, "the rows of a group must not share their draws"


def test_batch_rows_is_validated_with_the_key():
    for bad, why in ((0, "must be a positive number of rows"), (-2, "must be a positive number of rows"),
                     (1.5, "expected an integer"), ("true", "")):
        with pytest.raises(ConfigError, match=rf"rollout\.batch_rows.*{why}"):
            load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", [f"rollout.batch_rows={bad}"], RLConfig)
    cfg = load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", ["rollout.batch_rows=1"], RLConfig)
    assert cfg.rollout.batch_rows == 1


def test_the_command_line_takes_batch_rows(capsys):
    from ddrl.cli import main

    assert main(["sample", "--model", str(ROOT / "checkpoints/mini_sudoku-masked"), "--prompt", "4..1.2....3.1..4",
                 "--n", "3", "--batch-rows", "2", "--temperature", "1.0"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    assert main(["sample", "--model", str(ROOT / "checkpoints/mini_sudoku-masked"), "--prompt", "4..1",
                 "--batch-rows", "0"]) != 0
    assert "--batch-rows must be a positive number" in capsys.readouterr().err


def test_the_trainer_rolls_out_in_calls_of_batch_rows(tmp_path, monkeypatch):
    from ddrl.sampling import engine as engine_mod
    from ddrl.training import trainer as trainer_mod

    def rollout(*extra):
        cfg = load_config(ROOT / "configs/rl/grpo_mini_sudoku.yaml", [
            "train.prompts_per_step=2", "train.group_size=4", "eval.n=0", "eval.before=false",
            "rollout.temperature=1.0", "train.progress=false", "train.tensorboard=false",
            f"output_dir={tmp_path / str(len(extra))}", *extra],
            RLConfig)
        calls = []
        real = SAMPLERS

        class Spy:
            def get(self, name):
                def counted(model, ids, mask, cfg, **kwargs):
                    calls.append(ids.shape[0])
                    return real.get(name)(model, ids, mask, cfg, **kwargs)
                return counted

        monkeypatch.setattr(engine_mod, "SAMPLERS", Spy())  # the rollout engine looks the sampler up
        return trainer_mod.Trainer(cfg).rollout(1).completion_ids, calls

    whole, calls = rollout()
    assert calls == [8]
    chunked, calls = rollout("rollout.batch_rows=4")
    assert calls == [4, 4] and torch.equal(chunked, whole)


def test_trajectories_of_the_calls_are_joined_along_the_rows():
    model, prompts, mask, cfg = _sudoku()
    ids, mask = prompts.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)

    def run(rows):
        generators = RowGenerators([torch.Generator().manual_seed(100 + i) for i in range(GROUPS)], G)
        chunked = SamplerConfig(**{**vars(cfg), "batch_rows": rows})
        return sample_in_chunks(SAMPLERS.get("masked"), model, ids, mask, chunked, generator=generators,
                                return_trajectory=True).trajectory

    whole, chunked = run(None), run(G)
    assert torch.equal(chunked.commit_step, whole.commit_step)
    assert torch.allclose(chunked.token_probs, whole.token_probs, equal_nan=True)
