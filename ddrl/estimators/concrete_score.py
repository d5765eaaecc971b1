"""Concrete scores of a masked denoiser on Hamming-1 neighbours, for SEPO.

Paper: Zekri & Boullé, "Fine-Tuning Discrete Diffusion Models with Policy Gradient Methods" (SEPO),
arXiv 2502.01384, NeurIPS 2025. Code: ozekri/SEPO @ 4a4a40f (GRPO_MDLM_DNA/diffusion_gosai_update_new.py).

SEPO's policy gradient goes through the concrete score s_θ(x)_y = π_θ(y)/π_θ(x):
    log π_θ(x) = -log Σ_y s_θ(x)_y,     ∇ log π_θ(x) = -Σ_y π_θ(y) ∇ log s_θ(x)_y.

Definition used here. For a completion x (prompt c), position i and value v, y = x[i←v]:

    log s_θ(x)_{i,v} := log p_θ(v | x^{-i}, c) - log p_θ(x^i | x^{-i}, c)

where p_θ(· | x^{-i}, c) is the denoiser's distribution at position i when exactly position i is
masked (everything else visible; the mask token's own logit is excluded). If the denoiser's single-
site conditionals are those of a joint π_θ (an exact model), s_θ(x)_{i,v} = π_θ(y)/π_θ(x) exactly,
and on the neighbourhood N_i(x) = {x[i←v] : v ∈ V} (which contains x itself, with score 1):

    log π_θ(x^i | x^{-i}) = -log Σ_v s_θ(x)_{i,v}
    ∇ log π_θ(x^i | x^{-i}) = -Σ_v π̂(y_{i,v}) ∇ log s_θ(x)_{i,v},
    π̂(y_{i,v}) = π_θ(y) / Σ_{y'∈N_i(x)} π_θ(y') = p_θ(v | x^{-i})

i.e. SEPO's identity with self-normalised (SNIS) weights over N_i(x). For a one-token completion
N_i(x) is the whole space and this is SEPO's identity verbatim (tests/unit/test_sepo.py checks both
on an exact tiny model). Summed over positions it is the gradient of the pseudo-log-likelihood
Σ_i log π_θ(x^i|x^{-i}); the estimator samples `num_positions` positions per sequence (one masked
position per forward row, B·K rows in one batched call) so it fits real vocabularies and lengths.

Weights π̂: exact (`snis_samples=0`, free: they come from the same logits), or SEPO's Monte-Carlo
SNIS with M neighbour values per position drawn from the model's own detached conditional
(`snis_samples=M`; proposal = target, so the self-normalised weights are count/M).

`states="trace"` conditions each probed cell on the state in which the sampler committed it (the
cells committed at the same or a later step are masked too), the states TraceRL trains: the identity
above then holds for log p_θ(x^i | that state), whose sum over cells is the log-likelihood of the
decoding path. For few-step decoding this is the policy actually sampled (docs/methods.md).

Deviation from the released code: it feeds the clean sequence to a time-conditioned MDLM at
t ≈ 1/128, reads its normalised logits as scores, and estimates π(y) for all L·d neighbours with an
M-sample SNIS (≈ L·d·M extra forward passes). For an LLM-style masked denoiser the output at a visible
position is not a prediction, so the scores are read at a masked position instead, as defined above.

The released code also differs in its SNIS weights: `compute_expression` takes the diagonal over
(sample m, position j) of the M draws instead of over positions, so sample m contributes its
position j = m only. Those weights carry no gradient; the golden test (tests/unit/test_golden_sepo.py)
records them and injects them into the objective.

Output: token_logp [B, L] = log p_θ(x^i|x^{-i}) at the probed positions (mask), seq_logp [B] = the
pseudo-log-likelihood estimated from them (scaled by len/K), extras["score_surrogate"] [B, L] =
S_i = -Σ_v π̂(y_{i,v}) log s_θ(x)_{i,v} (with grad; weights detached), whose gradient is ∇ log p_θ(x^i|x^{-i}).
With `neighbour_extras=True` also the per-neighbour tensors that sepo's clip="released" reads, at the K
probed positions only (a [B, L, V] tensor would not fit for an LLM vocabulary): extras["log_scores"]
[B, K, V] (with grad), extras["neighbour_weights"] [B, K, V] (π̂, detached), extras["probe_positions"]
[B, K] long and extras["probe_valid"] [B, K] bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import generator_from_seed, uniform
from ddrl.logits import kept_logits
from ddrl.processes.draws import sample_categorical
from ddrl.registry import ESTIMATORS
from ddrl.types import COMMIT_ORDER, EstimatorOutput, RolloutBatch


def score_surrogate(log_scores: Tensor, weights: Tensor) -> Tensor:
    """SEPO's surrogate S = -Σ_y sg(π̂(y)) log s(x)_y over the last dim; its gradient is ∇ log π(x)
    when the weights are the (normalised) probabilities of the neighbourhood. [..., N] -> [...]

    Neighbours of weight 0 are skipped (the mask token's log-score is -inf, and 0·(-inf) is NaN).
    """
    weights = weights.detach()
    zero = torch.zeros((), dtype=log_scores.dtype, device=log_scores.device)
    terms = torch.where(weights > 0, weights * log_scores, zero)
    return -terms.sum(-1)


def pick_positions(completion_mask: Tensor, k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """k distinct positions per row, uniformly among completion tokens (seeded).

    Returns positions [B, k] long and valid [B, k] bool (False where a row has fewer than k tokens;
    those probes point at distinct non-completion positions and are ignored).
    """
    b, length = completion_mask.shape
    k = min(k, length)
    keys = uniform((b, length), generator, completion_mask.device)
    keys = keys + 2.0 * (~completion_mask.bool()).to(keys.dtype)  # completion tokens sort first
    positions = keys.argsort(dim=1)[:, :k]  # distinct within a row
    valid = torch.arange(k, device=completion_mask.device)[None, :] < completion_mask.sum(1, keepdim=True)
    return positions, valid


def masked_position_log_probs(model: Any, batch: RolloutBatch, positions: Tensor,
                              commit_step: Tensor | None = None) -> Tensor:
    """log p_θ(· | x^{-i}, c) at each probed completion position i, one masked position per row.

    positions [B, K] (completion indices) -> [B, K, V] log-probs, at least float32 (mask token excluded).
    commit_step [B, L] (the rollout's trajectory): condition instead on the sampler's state when i was
    committed -- i and every cell committed at the same or a later step (or never) masked too.
    """
    b, k = positions.shape
    prompt_len = batch.prompt_ids.shape[1]
    ids = batch.input_ids.repeat_interleave(k, dim=0)  # [B*K, T]
    attn = batch.attention_mask.repeat_interleave(k, dim=0)
    target = prompt_len + positions.reshape(-1)  # [B*K] absolute positions
    rows = torch.arange(b * k, device=ids.device)
    if commit_step is not None:
        order = commit_step.to(ids.device).repeat_interleave(k, dim=0)  # [B*K, L]
        own = order.gather(1, positions.reshape(-1, 1))  # [B*K, 1]; -1 (no record): only i is masked
        later = ((order >= own) | (order < 0)) & (own >= 0)
        ids[:, prompt_len:] = torch.where(later, model.mask_token_id, ids[:, prompt_len:])
    ids[rows, target] = model.mask_token_id
    # Only what is read goes through the LM head: each row's own probed position.
    logits = kept_logits(model, ids, attn, logits_to_keep=target[:, None])[:, 0]  # [B*K, V]; Dream realigned
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32; float64 stays
    if model.mask_token_id < logits.shape[-1]:
        logits[:, model.mask_token_id] = float("-inf")
    return torch.log_softmax(logits, dim=-1).reshape(b, k, -1)


def neighbour_weights(log_probs: Tensor, snis_samples: int, generator: torch.Generator) -> Tensor:
    """π̂(y_{i,v}) [B, K, V], detached: exact p(v|x^{-i}), or SNIS counts/M from M draws of it."""
    probs = log_probs.detach().exp()
    if snis_samples == 0:
        return probs
    flat = probs.reshape(-1, probs.shape[-1]).cpu()
    draws = torch.multinomial(flat, snis_samples, replacement=True, generator=generator)  # [B*K, M]
    counts = torch.zeros_like(flat).scatter_add_(1, draws, torch.ones_like(draws, dtype=flat.dtype))
    return (counts / snis_samples).reshape(probs.shape).to(probs.device)


SNIS_CHUNK = 1024  # neighbour rows per forward pass (compute_pi_z_given_y's chunk_size)


def raw_logits(model: Any, ids: Tensor) -> Tensor:
    """Logits over every class, the mask's too (no subs suppression): the backbone's own. [B, L, V] float32.
    Through the model's forward, wrapped or not: calling the backbone itself skips FSDP2's unshard of
    the root's parameters (an error on more than one GPU) and DDP's gradient sync (silently unsynced)."""
    return model(ids, raw=True).logits.float()


def hamming_neighbours(x: Tensor, vocab: int) -> Tensor:
    """[B, L] -> [B, L, V, L]: x with position l set to v (x itself included), their
    generate_all_hamming_distance_0_and_1."""
    b, length = x.shape
    y = x[:, None, None, :].expand(b, length, vocab, length).clone()
    pos = torch.arange(length, device=x.device)
    y[:, pos, :, pos] = torch.arange(vocab, device=x.device)  # [L, B, V] view of the diagonal
    return y


@torch.no_grad()
def released_neighbour_weights(model: Any, x: Tensor, move_chance_t: float, snis_samples: int, *,
                               generator: torch.Generator | None = None, draws: Tensor | None = None) -> Tensor:
    """π̂(y) for every Hamming-1 neighbour y of the clean x, as the released `_compute_pi_y` computes it:
    [B, L] -> [B, L, V] (detached). ozekri/SEPO @ 4a4a40f diffusion_gosai_update_new.py:848-905.

        π(z | y)  = m_t · softmax(raw logits at y) over all classes, the mask class set to 0 (m_s = 0)
        z^(m)     ~ π(· | y) per position, m = 1..M                 (their torch.multinomial; or `draws`)
        w_m       = 1e8 / (π(z^(m)_m | y) + 1e-8)
        π̂(y)      = Σ_m π(z^(m)_m | y) w_m / (Σ_m w_m + 1e-8)

    As released: their "π(z_i) = 1 / score" divides by log-probs clamped at 1e-8, i.e. the constant 1e8 (so
    that forward pass is skipped here), and the diagonal over (sample m, position j) keeps position j = m of
    draw m only. draws: their recorded draws [B, L, V, M, L] (golden test), else drawn from `generator`.
    """
    if draws is None and generator is None:  # never the global RNG (randomness is explicit)
        raise ValueError("released_neighbour_weights needs generator= (or the recorded draws=)")
    b, length = x.shape
    vocab, mask_id = int(model.vocab_size), int(model.mask_token_id)
    m = min(snis_samples, length)
    y = hamming_neighbours(x, vocab).reshape(-1, length)  # [B*L*V, L]
    pi = torch.cat([torch.softmax(raw_logits(model, y[i:i + SNIS_CHUNK]), -1)[:, :m]  # only positions j < M are read
                    for i in range(0, y.shape[0], SNIS_CHUNK)]) * move_chance_t  # [B*L*V, M, V]
    pi[..., mask_id] = 0.0
    pi = pi.reshape(b, length, vocab, m, vocab)  # [B, L, V, j, V]
    if draws is not None:
        z = draws[..., :m, :m].diagonal(dim1=3, dim2=4)  # [B, L, V, M]: draw m at position m
    else:
        assert generator is not None  # checked above
        z = sample_categorical(pi, generator=generator)  # [B, L, V, j]: one draw per (m = j) is all that is read
    pi_z = pi.gather(-1, z[..., None].to(pi.device)).squeeze(-1)  # [B, L, V, M]
    w = 1e8 / (pi_z + 1e-8)
    return (pi_z * w).sum(-1) / (w.sum(-1) + 1e-8)


def released_log_scores(model: Any, x: Tensor) -> Tensor:
    """log s_θ(x)_y for all L·V neighbours, as released: log_softmax of the logits at the clean x over every
    class (the mask class a neighbour too). [B, L] -> [B, L, V], with grad."""
    return torch.log_softmax(raw_logits(model, x), dim=-1)


@ESTIMATORS.register("concrete_score")
@dataclass
class ConcreteScore:
    """Hamming-1 concrete scores of a masked denoiser at sampled positions (SEPO)."""

    name: ClassVar[str] = "concrete_score"
    paper: ClassVar[str] = "SEPO, Zekri & Boullé, arXiv 2502.01384"
    formula: ClassVar[str] = "log s(x)_{i,v} = log p(v|x^{-i}) - log p(x^i|x^{-i}); S_i = -Σ_v π̂(v) log s(x)_{i,v}"
    passes: ClassVar[str] = "1 (of B*num_positions rows)"
    needs_trajectory: ClassVar[bool] = False

    num_positions: int = 4  # positions probed per sequence (each one masked alone in its own forward row)
    snis_samples: int = 0  # M: 0 = exact neighbour weights; M > 0 = SEPO's SNIS with M draws per position
    states: str = "single"  # single: only the probed cell masked (SEPO's Hamming-1 scores); trace: the
    # sampler's state when the cell was committed (later cells masked too), for few-step decoding;
    # clean: SEPO's released path for its MDLM DNA model (scores at the clean input, every neighbour, SNIS)
    released_steps: int = 128  # clean: the sampler's steps; π(z|y) is scaled by m(dt), dt = (1 - 1e-5) / steps
    neighbour_extras: bool = False  # also return per-neighbour log-scores and weights [B, K, V] (sepo clip="released")

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k):
        one whole sequence per probed position; states='clean' has one graph row, the clean sequence
        (its neighbours' passes are no_grad, num_positions is not read)."""
        return 1 if self.states == "clean" else self.num_positions

    def __post_init__(self) -> None:
        if self.states not in ("single", "trace", "clean"):
            raise ValueError(f"concrete_score: states must be 'single', 'trace' or 'clean', got {self.states!r}")
        if self.states == "clean" and self.snis_samples < 1:
            raise ValueError("concrete_score states='clean' is SEPO's released SNIS path: set snis_samples >= 1 (M=2)")
        self.needs_trajectory = self.states == "trace"  # type: ignore[misc]
        self.trajectory_record = COMMIT_ORDER  # the trace states read commit_step only

    def __call__(self, model: Any, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        generator = generator_from_seed(seed)
        if self.states == "clean":
            return self.released(model, batch, generator)
        completion_mask = batch.completion_mask.bool()
        positions, valid = pick_positions(completion_mask, self.num_positions, generator)  # [B, K]
        commit_step = None
        if self.states == "trace":
            if batch.trajectory is None:
                raise ValueError("concrete_score with states='trace' needs the rollout's trajectory")
            commit_step = batch.trajectory.commit_step
        log_probs = masked_position_log_probs(model, batch, positions, commit_step)  # [B, K, V]
        tokens = batch.completion_ids.gather(1, positions)  # [B, K]
        token_lp = log_probs.gather(-1, tokens[..., None]).squeeze(-1)  # [B, K] = -logsumexp_v log s
        log_scores = log_probs - token_lp[..., None]  # [B, K, V], log s(x)_{i,v}; 0 at v = x^i
        weights = neighbour_weights(log_probs, self.snis_samples, generator)  # [B, K, V]
        surrogate = score_surrogate(log_scores, weights)

        zero = torch.zeros((), dtype=token_lp.dtype, device=token_lp.device)
        token_lp, surrogate = torch.where(valid, token_lp, zero), torch.where(valid, surrogate, zero)
        shape = completion_mask.shape
        token_logp = torch.zeros(shape, dtype=token_lp.dtype, device=token_lp.device).scatter(1, positions, token_lp)
        surrogate_full = torch.zeros_like(token_logp).scatter(1, positions, surrogate)
        mask = torch.zeros(shape, dtype=torch.bool, device=token_lp.device).scatter(1, positions, valid)
        scale = completion_mask.sum(1) / valid.sum(1).clamp(min=1)  # len / K: pseudo-likelihood estimate
        seq_logp = token_logp.sum(1) * scale
        extras = {"score_surrogate": surrogate_full}
        if self.neighbour_extras:
            extras.update(log_scores=log_scores, neighbour_weights=weights, probe_positions=positions,
                          probe_valid=valid)
        return EstimatorOutput(token_logp, seq_logp, mask, extras)

    def released(self, model: Any, batch: RolloutBatch, generator: torch.Generator,
                 draws: Tensor | None = None) -> EstimatorOutput:
        """states='clean': every position and value of the completion, SEPO's released scores and weights
        (released_log_scores, released_neighbour_weights). The model sees the completion alone (the MDLM DNA
        model is unconditional). token_logp [B, L] = log p_θ(x^i | clean x) (no gradient use in SEPO)."""
        x = batch.completion_ids
        log_scores = released_log_scores(model, x)  # [B, L, V], with grad
        m_t = float(1.0 - model.process.alpha(torch.tensor((1 - 1e-5) / self.released_steps, dtype=torch.float64)))
        weights = released_neighbour_weights(model, x, m_t, self.snis_samples, generator=generator, draws=draws)
        mask = batch.completion_mask.bool()
        token_logp = log_scores.gather(-1, x[..., None]).squeeze(-1).masked_fill(~mask, 0.0)
        extras = {"log_scores": log_scores, "neighbour_weights": weights.to(log_scores.dtype),
                  "probe_positions": torch.arange(x.shape[1], device=x.device).expand_as(x), "probe_valid": mask,
                  "score_surrogate": score_surrogate(log_scores, weights).masked_fill(~mask, 0.0)}
        return EstimatorOutput(token_logp, token_logp.sum(1), mask, extras)
