"""SDAR's decoding rules as pure functions: the tempered top-k / top-p confidence of each masked
position and the dynamic (threshold) commit rule (JetAstra/SDAR generate.py,
`sample_with_temperature_topk_topp` and `remasking_strategy="low_confidence_dynamic"`; TraDo's
rollouts use the same rule with `dynamic_threshold`).

At every denoising step of a block, each position gets a candidate token and its confidence:

    logits' = top_p(top_k(logits / temperature))         (-inf outside the kept set)
    p       = softmax(logits')
    x0 ~ p,  confidence = p[x0]

At temperature 0 (greedy) the candidate is argmax p and its confidence p[x0] is taken under the
temperature-1 filtered softmax: what their code gives with temperature 1.0 and argmax for
torch.multinomial, the fixture's greedy setting. The dynamic rule then commits, among the block's
masked positions, every one with confidence > threshold (strictly) if there are at least k of them,
else the k most confident; k is the step's transfer count (get_num_transfer_tokens(block_length,
denoising_steps)[step] in their code: block_length // steps, one more in the first
block_length % steps steps, however many positions are still masked).

Deviations: the top-k fallback never commits a position that is not masked (theirs runs torch.topk
over -inf confidences, and commits prompt tokens when k exceeds the masked count in a partial first
block, see tests/fixtures/sdar/golden.json); ties go to the leftmost position (ddrl's
commit_top_k), theirs to torch.topk.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddrl.sampling.utils import gumbel_argmax


def top_k_top_p_filter(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """logits [..., V] -> the same with -inf outside the top-k and the top-p nucleus (in that order).

    top_k <= 0 and top_p >= 1 keep everything. Every logit equal to the k-th largest is kept. The
    nucleus is the smallest prefix of the sorted tokens whose probability reaches top_p: a token is
    dropped when the tokens ranked above it already hold more than top_p.
    """
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ranked, order = torch.sort(logits, dim=-1, descending=True)
        above = ranked.softmax(dim=-1).cumsum(dim=-1) > top_p  # [..., V] in rank order
        drop_ranked = torch.cat([torch.zeros_like(above[..., :1]), above[..., :-1]], dim=-1)
        drop = torch.zeros_like(drop_ranked).scatter(-1, order, drop_ranked)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def tempered_confidence(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, *,
                        uniforms: Tensor | None = None,
                        generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> (tokens [...] long, probs [...]: each token's probability under the
    filtered, tempered softmax), computed in the logits' dtype as SDAR's sampler does.

    temperature 0: argmax, probability at temperature 1 (module doc). temperature > 0: a draw from
    that softmax, either by Gumbel-max from `uniforms` [..., V] in [0, 1) (ddrl's per-row noise),
    or, with `generator`, by torch.multinomial over the flattened rows, the call SDAR makes (the
    same generator state gives their tokens).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    scaled = logits if temperature in (0.0, 1.0) else logits / temperature
    filtered = top_k_top_p_filter(scaled, top_k, top_p)  # [..., V]
    probs = filtered.softmax(dim=-1)  # [..., V]
    if temperature == 0:
        tokens = probs.argmax(dim=-1)
    elif uniforms is not None:
        tokens = gumbel_argmax(filtered, 1.0, uniforms)
    elif generator is not None:
        flat = probs.reshape(-1, probs.shape[-1])  # [N, V]
        tokens = torch.multinomial(flat, num_samples=1, generator=generator).view(probs.shape[:-1])
    else:
        raise ValueError("temperature > 0 draws a token: pass uniforms=[..., V] (ddrl's row noise) or "
                         "generator=torch.Generator().manual_seed(seed)")
    return tokens, probs.gather(-1, tokens[..., None]).squeeze(-1)


def commit_dynamic(confidence: Tensor, masked: Tensor, threshold: float, k: Tensor) -> Tensor:
    """SDAR's low_confidence_dynamic rule. confidence, masked [R, W]; k [R] the step's transfer count.

    -> [R, W] bool: the masked positions with confidence > threshold if a row has at least k[r] of
    them, else that row's k[r] most confident masked positions (all of them if fewer are masked).
    Never a position that is not masked.
    """
    # Imported here: ddrl.sampling.commit wires this rule in and imports this module.
    from ddrl.sampling.commit import commit_top_k

    if confidence.shape != masked.shape or confidence.dim() != 2:
        raise ValueError(f"confidence and masked must both be [R, W], got {list(confidence.shape)} and "
                         f"{list(masked.shape)}")
    masked = masked.bool()
    confidence = confidence.masked_fill(~masked, float("-inf"))
    high = masked & (confidence > threshold)  # [R, W]
    k = k.to(device=confidence.device, dtype=torch.long).expand(confidence.shape[0])
    top = commit_top_k(confidence, k) & masked
    return torch.where((high.sum(dim=1) >= k)[:, None], high, top)
