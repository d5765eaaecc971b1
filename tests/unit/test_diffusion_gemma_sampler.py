"""ddrl's DiffusionGemma sampler (ddrl.sampling.diffusion_gemma) against transformers' own
DiffusionGemmaForBlockDiffusion.generate (transformers 5.24.0), on a tiny model, one canvas.

The reference is their generate on the same weights, with an explicit generation config:
  * stochastic (their default schedule): the tokens after torch.manual_seed(s) equal ddrl's with a
    generator seeded s (same draws in the same order), for one prompt and an unpadded batch of two;
  * deterministic (t_max = 1e-6: one-hot draws, every position accepted) from a given initial
    canvas (their decoder_input_ids): each row of a left-padded batch equals their generate on that
    row unpadded (their own batched run numbers pads as positions, so it is not the reference).
"""

from __future__ import annotations

import pytest
import torch

import ddrl.sampling  # noqa: F401  (registers the other samplers)
import ddrl.sampling.diffusion_gemma  # noqa: F401  (registers "diffusion_gemma")
from ddrl.models import load_model
from ddrl.sampling.diffusion_gemma import diffusion_gemma_generate
from tests.unit.test_hf_models import CANVAS, padded_batch, write_tiny_diffusion_gemma

VOCAB = 48
EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = write_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "model", vocab_size=VOCAB)
    return load_model(directory).eval()


def their_config(steps: int, t_min: float, t_max: float, entropy_bound: float = 0.1, stability: int = 1,
                 confidence: float = 0.005):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (DiffusionGemmaGenerationConfig,
                                                                                EntropyBoundSamplerConfig)
    return DiffusionGemmaGenerationConfig(max_new_tokens=CANVAS, max_denoising_steps=steps, t_min=t_min, t_max=t_max,
                                          sampler_config=EntropyBoundSamplerConfig(entropy_bound=entropy_bound),
                                          stability_threshold=stability, confidence_threshold=confidence,
                                          eos_token_id=EOS, pad_token_id=PAD)


def theirs(model, prompt_ids: torch.Tensor, config, seed: int = 0, initial_canvas: torch.Tensor | None = None,
           with_passes: bool = False):
    kwargs = {} if initial_canvas is None else {"decoder_input_ids": initial_canvas}
    torch.manual_seed(seed)  # test-only: their generate draws from the global RNG
    with torch.no_grad():
        out = model.model.generate(prompt_ids, generation_config=config, **kwargs)
    if not with_passes:
        return out.sequences
    # their tokens_per_forward = non-pad new tokens / decoder passes of the row
    valid = (out.sequences[:, prompt_ids.shape[1]:] != PAD).sum(-1)
    return out.sequences, (valid / out.tokens_per_forward).round().long()


def ours(model, prompt_ids, mask=None, *, steps, t_min, t_max, seed=0, initial_canvas=None, **kwargs):
    sequence, _ = diffusion_gemma_generate(model, prompt_ids, mask, steps=steps, t_min=t_min, t_max=t_max,
                                           eos_token_id=EOS, pad_token_id=PAD, initial_canvas=initial_canvas,
                                           generator=torch.Generator().manual_seed(seed), **kwargs)
    return sequence


@pytest.mark.parametrize("rows", [[[2, 4, 5, 6, 7]], [[2, 4, 5, 6, 7], [2, 9, 8, 3, 10]]])
def test_stochastic_tokens_equal_generate_for_the_same_seed(model, rows):
    prompt = torch.tensor(rows)
    outputs = set()
    for seed in range(4):
        expected = theirs(model, prompt, their_config(steps=6, t_min=0.4, t_max=0.8), seed=seed)
        got = ours(model, prompt, steps=6, t_min=0.4, t_max=0.8, seed=seed)
        assert torch.equal(got, expected), f"seed {seed}"
        outputs.add(tuple(got.flatten().tolist()))
    assert len(outputs) > 1  # the seed matters: the draws, not a fixed point, are being compared


def test_high_temperature_renoising_and_no_stopping_equal_generate(model):
    """t in [1, 3]: high entropies, few positions accepted per step, so renoising decides the result."""
    prompt = torch.tensor([[2, 11, 12, 13]])
    for seed in range(3):
        expected = theirs(model, prompt, their_config(steps=5, t_min=1.0, t_max=3.0, entropy_bound=0.5), seed=seed)
        got = ours(model, prompt, steps=5, t_min=1.0, t_max=3.0, entropy_bound=0.5, seed=seed)
        assert torch.equal(got, expected), f"seed {seed}"


def test_deterministic_unpadded_prompt_equals_generate(model):
    prompt = torch.tensor([[2, 4, 5, 6, 7]])
    canvas = torch.randint(0, VOCAB, (1, CANVAS), generator=torch.Generator().manual_seed(5))
    expected, passes = theirs(model, prompt, their_config(steps=8, t_min=0.0, t_max=1e-6), seed=1,
                              initial_canvas=canvas, with_passes=True)
    got, nfe = diffusion_gemma_generate(model, prompt, steps=8, t_min=0.0, t_max=1e-6, eos_token_id=EOS,
                                        pad_token_id=PAD, initial_canvas=canvas,
                                        generator=torch.Generator().manual_seed(2))
    assert torch.equal(got, expected)
    assert nfe == int(passes[0]) < 8  # stable and confident: both stop at the same step, early


def test_deterministic_left_padded_rows_equal_generate_on_each_unpadded_row(model):
    rows = [[2, 4, 5, 6, 7, 8], [2, 9, 3]]
    prompt_ids, prompt_mask = padded_batch(rows, pad=PAD)
    canvas = torch.randint(0, VOCAB, (2, CANVAS), generator=torch.Generator().manual_seed(7))
    got = ours(model, prompt_ids, prompt_mask, steps=8, t_min=0.0, t_max=1e-6, initial_canvas=canvas)
    P = prompt_ids.shape[1]
    for i, row in enumerate(rows):
        expected = theirs(model, torch.tensor([row]), their_config(steps=8, t_min=0.0, t_max=1e-6),
                          initial_canvas=canvas[i:i + 1])
        assert torch.equal(got[i, P:], expected[0, len(row):]), f"row {i}"


def test_sampler_entry_runs_via_ddrl_sampling(model):
    from ddrl.config import SamplerConfig
    from ddrl.registry import SAMPLERS

    prompt_ids, prompt_mask = padded_batch([[2, 4, 5, 6], [2, 7]], pad=PAD)
    cfg = SamplerConfig(name="diffusion_gemma", steps=4, gen_length=CANVAS)
    sample = SAMPLERS.get("diffusion_gemma")
    out = sample(model, prompt_ids, prompt_mask, cfg, generator=torch.Generator().manual_seed(3))
    assert out.completion_ids.shape == (2, CANVAS) and 1 <= out.nfe <= 4 and out.trajectory is None
    sequence, nfe = diffusion_gemma_generate(model, prompt_ids, prompt_mask, steps=4,
                                             generator=torch.Generator().manual_seed(3))
    assert torch.equal(out.completion_ids, sequence[:, prompt_ids.shape[1]:]) and out.nfe == nfe
    with pytest.raises(ValueError, match="canvas_length"):
        SAMPLERS.get("diffusion_gemma")(model, prompt_ids, prompt_mask,
                                        SamplerConfig(name="diffusion_gemma", steps=4, gen_length=CANVAS + 1),
                                        generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="generator"):
        diffusion_gemma_generate(model, prompt_ids, prompt_mask, steps=4)
