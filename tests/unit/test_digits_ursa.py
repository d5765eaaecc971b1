"""The digits toy on URSA's path: the shipped tiny pipeline, its exact gray-level decoder, the pixel
reward, and `ddrl pretrain` building and training a metric-path model (docs/udm_digits_ursa.md)."""

from pathlib import Path

import numpy as np
import pytest
import torch

import ddrl
from ddrl.models.ursa_init import gray_codebook, write_gray_level_pipeline
from ddrl.rewards.image import digits_classifier_reward, digits_splits, encode_image, pixels_to_levels
from ddrl.tasks import get_task

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "checkpoints" / "digits-ursa"


def test_shipped_checkpoint_is_an_ursa_pipeline_that_decodes_codes_to_their_gray_levels():
    model = ddrl.load_model(SHIPPED)
    assert model.family == "ursa" and (SHIPPED / "model_index.json").is_file()
    assert not (SHIPPED / "config.json").exists()  # the diffusers pipeline layout, read natively
    lo, hi = model.image_token_range
    assert hi - lo == 17 and model.max_prompt_length == 1  # 17 gray levels; the prompt is one class word
    codes = torch.randint(0, 17, (5, 8, 8), generator=torch.Generator().manual_seed(0))
    pixels = model.decode_images(codes)  # [5, 3, 8, 8]
    assert pixels.shape == (5, 3, 8, 8)
    assert torch.allclose(pixels, (codes.float() / 16)[:, None].expand(5, 3, 8, 8), atol=1e-5)
    ids, _ = model.encode_prompts(["<c3>", ""])
    assert ids[0, 0] != ids[1, 0] and ids[0, 1] == ids[1, 1] == model.bov_token_id  # word vs pad, then <bov>


def test_gray_codebook_gives_the_metric_path_distances_that_grow_with_the_level_gap():
    model = ddrl.load_model(SHIPPED)
    d = model.process.distances(torch.tensor(0))  # d(level 0, level k) [17]
    assert torch.all(d[1:] > d[:-1]) and d[0].abs() < 1e-6 and abs(float(d[-1]) - 2.0) < 1e-4
    assert torch.allclose(model.process.emb, gray_codebook(17), atol=1e-4)


def test_fresh_pipeline_decoder_is_exact_for_any_codebook_size(tmp_path):
    path = write_gray_level_pipeline(tmp_path / "p", words=["a", "b"], levels=5, hidden_size=32, num_layers=1,
                                     num_heads=2, ffn_mult=2.0, max_prompt_length=2, seed=0)
    model = ddrl.load_model(path)
    codes = torch.arange(5).repeat(13)[:64].view(1, 8, 8)
    assert torch.allclose(model.decode_images(codes)[0, 1], codes[0].float() / 4, atol=1e-5)
    assert model.max_prompt_length == 2 and model.image_token_range == (4, 9)


def test_pixel_reward_reads_decoded_pixels_as_the_classifier_reads_gray_levels():
    images, labels = digits_splits()["generator"]
    levels = torch.tensor(images[:6]).view(6, 1, 8, 8).float() / 16
    pixels = levels.expand(6, 3, 8, 8)
    assert np.array_equal(pixels_to_levels(pixels), images[:6])
    task = get_task("digits_image")
    texts = [encode_image(im) for im in images[:6]]
    expected = digits_classifier_reward(texts, label=list(labels[:6]))
    assert task.reward([""] * 6, images=pixels, label=list(labels[:6])) == pytest.approx(expected)
    assert task.image_texts(pixels) == texts
    wrong = [(int(y) + 1) % 10 for y in labels[:6]]
    assert sum(task.correct([""] * 6, images=pixels, label=list(labels[:6]))) > sum(
        task.correct([""] * 6, images=pixels, label=wrong))


def test_pretrain_builds_and_trains_a_metric_path_ursa_model(tmp_path):
    from ddrl.training.pretrain import pretrain

    final = pretrain(ROOT / "configs/pretrain/digits_ursa.yaml",
                     ["train.steps=2", "train.batch_size=4", "train.eval_every=2", "data.n_train=16",
                      "data.n_heldout=4", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                      "train.progress=false", f"output_dir={tmp_path / 'run'}"])
    model = ddrl.load_model(final)
    init = ddrl.load_model(tmp_path / "run" / "init")
    assert model.family == "ursa" and model.process.name == "metric_path"
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), init.parameters())]
    assert any(moved)
    codes = torch.arange(17).repeat(4)[:64].view(1, 8, 8)
    assert torch.allclose(model.decode_images(codes)[0, 0], codes[0].float() / 16, atol=1e-5)
