"""A synthetic stand-in for SEPO's enhancer data: sequences with a planted motif grammar and a known oracle.

SEPO's DNA experiment (Zekri & Boullé, arXiv 2502.01384; DRAKES's setup) needs gosai_all.csv and gReLU's
Enformer oracle, neither of which ships with ddrl. This module makes a gosai-format CSV (`seq`, `hepg2`,
`k562`, `sknsh`) and an oracle with the same interface (one-hot [n, 4, L] in, [n, 3] out) from a seed, so the
whole pipeline (ddrl pretrain -> ddrl train with SEPO -> dna_enhancer metrics) runs on a CPU in minutes
(bench/sepo_dna_story.py). Nothing here is biology: the motifs are short words with a preferred position.

Grammar (data). Background bases are i.i.d. (A .3, C .2, G .2, T .3). Each motif m is planted with
probability `plant_prob`, its start drawn from a normal around `center_m` (std `spread`), rounded and clipped;
a later motif overwrites an earlier one where they overlap.

Oracle (the reward). A position-weighted motif count, one weight map per cell line c:

    f_c(x) = Σ_m Σ_p  1[x[p : p + K_m] = motif_m] · w_{c,m} · exp(-(p - center_m)^2 / (2 σ^2))

HepG2 (column 0, the reward) weighs all three motifs; K562 only the E-box; SK-N-SH only GATA. The data's
`hepg2` column is f_0 plus Gaussian measurement noise (std `noise`), as a measured activity would be.
Data sequences carry ~1 motif near its preferred place; the oracle's optimum packs every motif at its
centre (f_0 = 3.3 for one copy each), which is what reward fine-tuning should find, and what pulls the
samples away from the base model's likelihood.
"""

import csv
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

BASES = "ACGT"
LENGTH = 32
BACKGROUND = (0.3, 0.2, 0.2, 0.3)
# (motif, preferred start, weight in HepG2, K562, SK-N-SH)
MOTIFS = (("TGACTC", 3, 1.0, 0.0, 0.0),   # AP-1-like
          ("CACGTG", 13, 1.5, 1.0, 0.0),  # E-box-like
          ("GATAAG", 23, 0.8, 0.0, 1.0))  # GATA-like
SIGMA = 3.0  # the oracle's position tolerance


class MotifOracle(nn.Module):
    """f(x) [n, 3] for one-hot x [n, 4, L] (gReLU's layout); exact motif matches only (a conv that counts
    matching bases, thresholded at the motif length), weighted by a Gaussian around each motif's centre."""

    # Buffers, declared for the type checker. The module has no `from __future__ import annotations`:
    # TorchScript (the oracle is saved scripted) cannot resolve these as strings.
    filters: Tensor  # [M, 4, K]
    position_weights: Tensor  # [M, P]
    cell_weights: Tensor  # [M, 3]

    def __init__(self, length: int = LENGTH, sigma: float = SIGMA):
        super().__init__()
        k = len(MOTIFS[0][0])
        filters = torch.zeros(len(MOTIFS), 4, k)
        for m, (word, *_rest) in enumerate(MOTIFS):
            filters[m, [BASES.index(c) for c in word], torch.arange(k)] = 1.0
        starts = torch.arange(length - k + 1, dtype=torch.float32)
        position = torch.stack([torch.exp(-(starts - centre) ** 2 / (2 * sigma ** 2)) for _, centre, *_w in MOTIFS])
        weights = torch.tensor([w for *_head, w0, w1, w2 in MOTIFS for w in (w0, w1, w2)]).reshape(len(MOTIFS), 3)
        self.register_buffer("filters", filters)  # [M, 4, K]
        self.register_buffer("position_weights", position)  # [M, P]
        self.register_buffer("cell_weights", weights)  # [M, 3]
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        matches = (F.conv1d(x.float(), self.filters) > self.k - 0.5).float()  # [n, M, P]
        per_motif = (matches * self.position_weights).sum(-1)  # [n, M]
        return per_motif @ self.cell_weights  # [n, 3]


def sample_sequences(n: int, seed: int, *, length: int = LENGTH, plant_prob: float = 0.35,
                     spread: float = 4.0) -> list[str]:
    """n sequences from the grammar (module docstring); the same seed gives the same sequences."""
    rng = np.random.default_rng(seed)
    seqs = rng.choice(4, size=(n, length), p=BACKGROUND)
    for word, centre, *_weights in MOTIFS:
        ids = np.array([BASES.index(c) for c in word])
        planted = rng.random(n) < plant_prob
        starts = np.clip(np.rint(rng.normal(centre, spread, n)), 0, length - len(word)).astype(int)
        for row in np.flatnonzero(planted):
            seqs[row, starts[row]:starts[row] + len(word)] = ids
    return ["".join(BASES[i] for i in row) for row in seqs]


def write_motif_dataset(directory: str | Path, n: int = 4000, seed: int = 0, noise: float = 0.1) -> dict[str, Path]:
    """Write `gosai_motifs.csv` (n rows, gosai columns) and `oracle.pt` (TorchScript MotifOracle) under
    directory; returns their paths. Deterministic in (n, seed, noise)."""
    from ddrl.tasks.dna import oracle_predictions

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    oracle = MotifOracle().eval()
    seqs = sample_sequences(n, seed)
    truth = oracle_predictions(oracle, seqs)  # [n, 3]
    measured = truth + np.random.default_rng(seed + 1).normal(0.0, noise, truth.shape)
    paths = {"path": out / "gosai_motifs.csv", "oracle": out / "oracle.pt"}
    with paths["path"].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seq", "hepg2", "k562", "sknsh"])
        writer.writerows([s, *(f"{v:.4f}" for v in row)] for s, row in zip(seqs, measured))
    torch.jit.script(oracle).save(str(paths["oracle"]))
    return paths


if __name__ == "__main__":  # python -m ddrl.tasks.dna_motifs OUT_DIR [SEED]
    import sys

    written = write_motif_dataset(sys.argv[1], seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    print("\n".join(f"{k}: {v}" for k, v in written.items()))
