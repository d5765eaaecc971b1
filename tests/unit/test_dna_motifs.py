"""The synthetic motif-grammar data and oracle (ddrl/tasks/dna_motifs.py) and `ddrl pretrain` of an MDLM DNA
model (model.architecture=mdlm_dna), read back by load_model."""

from __future__ import annotations

import json

import pytest
import torch

import ddrl
from ddrl.config import ConfigError, PretrainConfig, load_config
from ddrl.tasks.dna import DNAEnhancerTask, one_hot_dna
from ddrl.tasks.dna_motifs import MOTIFS, MotifOracle, sample_sequences, write_motif_dataset

BG = "A" * 32


def place(seq: str, word: str, start: int) -> str:
    return seq[:start] + word + seq[start + len(word):]


def test_oracle_counts_exact_motifs_with_position_weights():
    oracle = MotifOracle()
    ap1, ebox, gata = (m[0] for m in MOTIFS)
    seqs = [BG, place(BG, ebox, 13), place(BG, ebox, 16), place(BG, ebox[:-1] + "A", 13),
            place(place(place(BG, ap1, 3), ebox, 13), gata, 23)]
    out = oracle(one_hot_dna(seqs))  # [5, 3]
    assert out[0].tolist() == [0.0, 0.0, 0.0]
    assert out[1].tolist() == pytest.approx([1.5, 1.0, 0.0])  # at its centre: full weight
    gauss = float(torch.exp(torch.tensor(-9 / (2 * 3.0 ** 2))))
    assert out[2].tolist() == pytest.approx([1.5 * gauss, 1.0 * gauss, 0.0], rel=1e-5)  # 3 bases off centre
    assert out[3].tolist() == [0.0, 0.0, 0.0]  # one base wrong: no match
    assert out[4].tolist() == pytest.approx([3.3, 1.0, 1.0])  # every motif at its centre


def test_data_is_deterministic_and_carries_the_grammar(tmp_path):
    assert sample_sequences(50, seed=3) == sample_sequences(50, seed=3) != sample_sequences(50, seed=4)
    seqs = sample_sequences(2000, seed=0)
    share = sum(MOTIFS[1][0] in s for s in seqs) / len(seqs)
    assert 0.25 < share < 0.45  # planted with probability 0.35 (plus chance, minus overwrites)
    a = write_motif_dataset(tmp_path / "a", n=64, seed=1)
    b = write_motif_dataset(tmp_path / "b", n=64, seed=1)
    assert a["path"].read_text() == b["path"].read_text()
    assert a["path"].read_text().splitlines()[0] == "seq,hepg2,k562,sknsh"


def test_dna_enhancer_pretrain_pairs_come_from_train_rows_only(tmp_path):
    files = write_motif_dataset(tmp_path, n=300, seed=0)
    task = DNAEnhancerTask(path=str(files["path"]), split="hash", oracle=str(files["oracle"]))
    pairs = task.pretrain_pairs(500, seed=0)
    held = {ex["seq"] for split in ("dev", "test") for ex in task._split_rows(split)}
    assert len(pairs) == 500 and all(p["prompt"] == "" and len(p["completion"]) == 32 for p in pairs)
    assert held and not held & {p["completion"] for p in pairs}


def test_pretrain_builds_trains_and_saves_an_mdlm_dna_model(tmp_path):
    files = write_motif_dataset(tmp_path / "data", n=300, seed=0)
    final = ddrl.pretrain("configs/pretrain/dna_motifs_mdlm.yaml", overrides=[
        f"task.args.path={files['path']}", f"task.args.oracle={files['oracle']}", "train.steps=3",
        "train.eval_every=3", "train.progress=false", "data.n_train=64", "data.n_heldout=16",
        f"output_dir={tmp_path / 'base'}"])
    model = ddrl.load_model(final)
    assert model.family == "mdlm_dna" and model.mask_token_id == 4
    assert json.loads((final / "config.json").read_text())["hidden_dim"] == 32
    assert model.model.config.num_cnn_stacks == 1 and model.model.config.length == 32
    assert float(1 - model.process.alpha(torch.tensor(1.0))) == pytest.approx(1 - 1e-3)  # loglinear
    fresh = ddrl.models.mdlm_dna.build_mdlm_dna(load_config("configs/pretrain/dna_motifs_mdlm.yaml",
                                                            cls=PretrainConfig).model, generator_seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                     model.model.state_dict().values()))  # trained


def test_mdlm_dna_build_is_seeded_and_refuses_a_wrong_process():
    cfg = load_config("configs/pretrain/dna_motifs_mdlm.yaml", cls=PretrainConfig).model
    from ddrl.models.mdlm_dna import build_mdlm_dna

    state = torch.random.get_rng_state()
    a, b = build_mdlm_dna(cfg, 5), build_mdlm_dna(cfg, 5)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    cfg.schedule = "linear"
    with pytest.raises(ValueError, match="schedule=loglinear"):
        build_mdlm_dna(cfg, 0)
    with pytest.raises(ConfigError, match="architecture"):
        load_config("configs/pretrain/dna_motifs_mdlm.yaml", ["model.architecture=cnn"], cls=PretrainConfig)


def test_completions_without_eos_must_fill_gen_length():
    from ddrl.data import encode_completions
    from ddrl.models.mdlm_dna import DNATokenizer

    assert encode_completions(DNATokenizer(), ["ACGT", "TTTT"], 4).tolist() == [[0, 1, 2, 3], [3, 3, 3, 3]]
    with pytest.raises(ValueError, match="no EOS"):
        encode_completions(DNATokenizer(), ["ACG"], 4)
