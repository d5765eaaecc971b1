"""The emerge sampler's released RNG layout (rollout.rng=released; docs/diffusion.md#emerge-sampler).

ddrl's own layout (rollout.rng=ddrl) keys every draw by (chunk seed, block, step) on the model's device
(ddrl.sampling.utils.StepNoise): a row's tokens do not depend on the other rows, but no seed makes them
the tokens of the authors' code. Under rollout.rng=released the emerge sampler spends random numbers as
MaskGRPO's image rollouts do (martian422/MaskGRPO @ b74ba3c, grpo/mask_grpo_trainer.py
`t2i_generate_emerge`, lines 439-515), so that with the same seed the tokens equal theirs
(tests/unit/test_emerge_released.py against tests/fixtures/methods/make_maskgrpo_emerge.py). With T steps
and C image codes, at step s:

    p = softmax(z)  over the C codes (the model's logits_range; the model computes those logits only), in the
                    logits' dtype
    s < T-1:  q = [p * (k_t - k_s) / k_t,  k_s / k_t]     C + 1 classes, the last one "stays masked";
              k(tau) = cos(pi tau / 2), k_t = k(s/T), k_s = k((s+1)/T), as float32 0-dim tensors
              computed as theirs; the concatenation makes q float32 under bf16 logits, as theirs
              one torch.multinomial(q.reshape(-1, C + 1), 1) over every slot of every row: a slot
              already decided draws too and its draw is thrown away (their shapes and order)
    s = T-1:  one torch.multinomial(p.reshape(-1, C), 1); every slot still masked takes its draw

Their sampler draws from torch's global RNG; ddrl never does. Here the draws come from the caller's
generator, so a generator seeded with `seed` on the device their model ran on gives what their call gives
after torch.manual_seed(seed). A RowGenerators draws chunk by chunk, each chunk's rows from its own
generator: every chunk gets what their call on those rows alone gives (their trainer calls the sampler
once per generation_batch_size rows, the global RNG running on). The draws happen on the generator's
device; the probabilities are copied there when the model is elsewhere (a CPU generator for a CUDA model
gives the CPU stream).

What it covers: MaskGRPO's text-to-image rollouts, one block of image codes (their trainer's
t2i_generate_emerge; the GenEval script's models/modeling_mmada.py t2i_generate_emerge draws the same).
Not covered, refused by check_released_model: their text emerge (mask_grpo_trainer.py generate_v2,
models/modeling_mmada.py mmu_generate_emerge), which their training never calls (text rollouts run LLaDA's
low-confidence generate) and which is another rule, not only another layout (a linear pace, p * (k_t - k_s)
with the mask id's own probability overwritten by k_s / k_t, unnormalised, drawn over every prompt and
completion slot of the whole vocabulary).

Temperature: their emerge takes a temperature and never uses it. Here p = softmax(z / tau), so tau = 1 is
theirs; tau = 0 makes p the argmax's one-hot, and the draw still decides which slots appear.
Host reads: torch.multinomial checks its input on the host, one read per chunk and step (ddrl's layout
reads nothing per step).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.processes.draws import row_chunks
from ddrl.sampling.utils import codebook_range

RNG_LAYOUTS = ("ddrl", "released")  # rollout.rng
RELEASED = "released"


def released_pace(step: int, steps: int) -> Tensor:
    """k(step / steps) = cos(pi/2 * step / steps): a float32 0-dim tensor, rounded as MaskGRPO's
    cosine_schedule(torch.tensor(step / steps)) rounds it (the ratio (k_t - k_s) / k_t then matches bit
    for bit; ddrl's EMERGE_SCHEDULES pace is float64)."""
    return torch.cos(torch.tensor(step / steps, dtype=torch.float32) * math.pi * 0.5)


def code_probabilities(codes_logits: Tensor, temperature: float) -> Tensor:
    """softmax(z / temperature) over the last dim, in z's dtype; temperature 0: the argmax's one-hot."""
    if temperature == 0:
        top = codes_logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(codes_logits).scatter_(-1, top, 1.0)
    z = codes_logits if temperature == 1 else codes_logits / temperature
    return z.softmax(dim=-1)


def multinomial_rows(probs: Tensor, generator: Any) -> Tensor:
    """[B, W, K] probabilities -> [B, W] long: torch.multinomial(rows, 1) of each chunk's rows, flattened
    to [rows x W, K] as theirs, from the chunk's generator on its device (module doc)."""
    B, W, K = probs.shape
    out = []
    for lo, hi, g in row_chunks(generator, B):
        rows = probs[lo:hi].reshape(-1, K).contiguous().to(g.device)
        out.append(torch.multinomial(rows, 1, generator=g).view(hi - lo, W).to(probs.device))
    return torch.cat(out)


class ReleasedEmergeRule:
    """The emerge sampler under rollout.rng=released: one draw per slot gives the code and whether it
    appears (module doc); the sampler takes tokens and commits from `draw` (masked._step)."""

    uses_confidence = False
    fixed_steps = True

    def __init__(self, steps_per_block: int, codes: tuple[int, int]):
        self.steps_per_block = steps_per_block
        self.codes = (int(codes[0]), int(codes[1]))

    def begin_block(self, masked: Tensor) -> None:
        pass

    def more_steps(self, step: int, masked: Tensor) -> bool:
        return step < self.steps_per_block

    def draw(self, step: int, logits: Tensor, masked: Tensor, temperature: float,
             generator: Any) -> tuple[Tensor, Tensor]:
        """logits [B, W, C] of the codes (the sampler asks the model for those only), masked [B, W] ->
        (tokens [B, W] vocabulary ids, committed [B, W] bool)."""
        lo, hi = self.codes
        C, T = hi - lo, self.steps_per_block
        if logits.shape[-1] != C:
            raise ValueError(f"the released emerge draw takes the logits of the {C} image codes [{lo}, {hi}), "
                             f"got {logits.shape[-1]} columns")
        p = code_probabilities(logits, temperature)  # [B, W, C]
        if step == T - 1:
            return multinomial_rows(p, generator) + lo, masked
        k_t, k_s = released_pace(step, T), released_pace(step + 1, T)
        stay = (k_s / k_t).expand(*p.shape[:-1], 1).to(p.device)  # [B, W, 1] float32
        drawn = multinomial_rows(torch.cat([p * (k_t - k_s) / k_t, stay], dim=-1), generator)  # [B, W] in [0, C]
        return drawn.clamp(max=C - 1) + lo, masked & (drawn < C)

    def step_time(self, step: int) -> float | None:
        return 1.0 - step / self.steps_per_block


def check_released_model(model: Any, key: str = "rollout") -> tuple[int, int]:
    """The image codes [lo, hi) of a model whose completions are image codes (its logits_range is its
    image_token_range: MMaDA loaded with a vq_path); anything else is refused (module doc)."""
    p = f"{key}." if key else ""
    codes = codebook_range(model)
    if codes is None:
        family = model_view(model).family or "this"
        raise ValueError(f"{p}rng='released' reproduces MaskGRPO's text-to-image rollouts (t2i_generate_emerge: "
                         f"image-code completions), but this {family} model completes text; their text rollouts "
                         f"use LLaDA's sampler and their text emerge is another rule. Set {p}rng=ddrl (or load "
                         f"MMaDA with model.vq_path to generate images)")
    return codes
