"""The dna_enhancer task on a gosai-format CSV with a tiny oracle (a fixed, known function)."""

from __future__ import annotations

import csv
import random

import pytest
import torch

import ddrl
from ddrl.registry import TASKS
from ddrl.tasks.dna import DNAEnhancerTask, dna_reward, kmer_counts, kmer_pearson

L = 8


class CountOracle(torch.nn.Module):
    """[n, 4, L] one-hot -> [n, 3, 1]: HepG2 = #G + 0.5 #C, K562 = #A, SK-N-SH = #T (gReLU's output layout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = x.sum(-1)  # [n, 4]
        return torch.stack([counts[:, 2] + 0.5 * counts[:, 1], counts[:, 0], counts[:, 3]], 1)[..., None]


def write_gosai_csv(path, n=60, seed=0):
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seq", "hepg2", "k562", "sknsh"])
        for _ in range(n):
            s = "".join(rng.choice("ACGT") for _ in range(L))
            w.writerow([s, s.count("G") + 0.5 * s.count("C"), s.count("A"), s.count("T")])
    return path


def test_task_splits_reward_and_metrics(tmp_path):
    data = write_gosai_csv(tmp_path / "gosai.csv")
    task = TASKS.get("dna_enhancer")(path=str(data), split="hash", test_fraction=0.2, oracle=CountOracle(),
                                     atac_oracle=CountOracle(), atac_column=1, top_quantile=0.9)
    test = task.test_examples(100)
    dev = task.dev_examples(100)
    train = task.train_examples(10)
    assert test and dev and all(ex["prompt"] == "" for ex in test + dev + train)
    assert not {ex["seq"] for ex in test} & {ex["seq"] for ex in train + dev}
    assert task.reward(["GGGGCCCC", "AAAAAAAA", "ACGN"]) == [6.0, 0.0, None]
    assert task.correct(["GGGGGGGG", "AAAAAAAA"]) == [True, False]
    rows = [{"completions": [s]} for s in ("GGGGGGGC", "GGGCCCGG", "AGGGTTGG")]
    out = task.eval_breakdown(rows, [{}] * 3)
    assert out["pred_activity_median"] == pytest.approx(6.5)
    assert out["atac_accuracy"] == pytest.approx(1 / 3)  # K562 column = #A > 0.5: only the third
    assert -1.0 <= out["kmer3_pearson"] <= 1.0


def test_kmer_pearson_is_one_for_the_same_composition():
    ref = kmer_counts(["ACGTACGT", "GGGCCC"])
    assert kmer_pearson(ref, 2, kmer_counts(["ACGTACGT", "GGGCCC"] * 2), 4) == pytest.approx(1.0)


def test_plain_reward_function_wraps_any_module():
    assert dna_reward(CountOracle(), target=1)(["AACG", "XX"]) == [2.0, None]


def test_log_likelihood_under_the_base_model(tmp_path):
    from pathlib import Path

    ckpt = Path(__file__).resolve().parents[1] / "fixtures" / "sepo_dna" / "tiny_mdlm_dna.ckpt"
    data = write_gosai_csv(tmp_path / "gosai.csv")
    task = DNAEnhancerTask(path=str(data), split="hash", oracle=CountOracle(), likelihood_model=str(ckpt),
                           likelihood_steps=8)
    out = task.eval_breakdown([{"completions": ["ACGTACGT"]}, {"completions": ["CCCCCCCC"]}], [{}, {}])
    assert out["log_likelihood_median"] < 0


def test_needs_an_oracle(tmp_path):
    with pytest.raises(ValueError, match="oracle="):
        DNAEnhancerTask(path=str(write_gosai_csv(tmp_path / "g.csv")), split="hash")
