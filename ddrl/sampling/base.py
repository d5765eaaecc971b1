"""What every sampler returns, and the one signature the trainer and evaluator call.

    out = SAMPLERS.get(cfg.name)(model, prompt_ids, prompt_mask, cfg, generator=g, return_trajectory=True)

`model` is a DiffusionLM (or anything with the same attributes: mask_token_id, vocab_size,
eos_token_id, pad_token_id, process, block_size, and `model(input_ids, attention_mask).logits`).
`g` is a torch.Generator, or a ddrl.processes.draws.RowGenerators (one generator per chunk of rows,
e.g. per prompt group): then each chunk gets the completions a call on that chunk alone would get,
so one batched call can serve every group of a rank. `cfg` is the rollout section; each sampler reads
it into its own settings class (ddrl.sampling.settings: the check config validation runs). The
trainer, `ddrl eval` and `ddrl sample` call it through the rollout engine (ddrl.sampling.engine),
which calls sample_in_chunks: the rows cut into calls of at most rollout.batch_rows rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.processes.draws import RowGenerators, chunk_seeds, row_chunks
from ddrl.sampling.utils import keyed_seed
from ddrl.types import Trajectory


@dataclass
class SampleOutput:
    completion_ids: Tensor  # [B, L] long, the generated completion (prompt excluded)
    trajectory: Trajectory | None  # filled when return_trajectory=True
    nfe: int  # model forward calls made (a batched call counts once)
    forward_tokens: int | None = None  # rows x tokens fed to the model, summed over calls (cost; None = not counted)


def model_mask_id(model, fix: str = "set mask_token_id in the model config") -> int:
    """The model's mask token, which every masked-diffusion sampler needs; `fix` says where to set it."""
    mask_id = model_view(model).mask_token_id
    if mask_id is None:
        raise ValueError(f"model.mask_token_id is None; masked-diffusion samplers need the model's mask token ({fix})")
    return int(mask_id)


def sample_in_chunks(sampler: Callable[..., SampleOutput], model, prompt_ids: Tensor, prompt_mask: Tensor | None,
                     cfg: Any, *, generator: Any, return_trajectory: Any = False) -> SampleOutput:
    """`sampler` on at most cfg.batch_rows rows per call (rollout.batch_rows; None = all rows in one call).

    A call holds its rows' logits, [rows, W, V] (twice under guidance), so the rows per call bound the
    rollout's memory: an image of 1,024 tokens over MMaDA's vocabulary is 0.5 GB of bf16 logits a row
    per step. The generator is split along its own chunks (one generator per prompt group in the
    trainer, per example in ddrl eval; ddrl.processes.draws.RowGenerators):
      * batch_rows >= a group: each call takes whole groups, at most batch_rows rows; every sampler
        gives a group what a call on it alone gives (module doc), so the tokens are those of one call;
      * batch_rows < a group (a plain torch.Generator is one group of every row): each row of the group
        draws from its own generator, seeded from the group's generator (one draw), so the tokens do
        not depend on batch_rows below the group size, but differ from those of an unchunked call.
    nfe and forward_tokens add up over the calls; trajectories are joined along the rows.
    """
    B = prompt_ids.shape[0]
    rows = getattr(cfg, "batch_rows", None)
    record = {"return_trajectory": return_trajectory} if return_trajectory else {}  # a user's sampler may lack it
    if rows is None or rows >= B:
        return sampler(model, prompt_ids, prompt_mask, cfg, generator=generator, **record)
    outs = [sampler(model, prompt_ids[lo:hi], None if prompt_mask is None else prompt_mask[lo:hi], cfg,
                    generator=g, **record) for lo, hi, g in _call_chunks(generator, B, int(rows))]
    forward = [o.forward_tokens for o in outs]
    return SampleOutput(completion_ids=torch.cat([o.completion_ids for o in outs]),
                        trajectory=_cat_trajectories([o.trajectory for o in outs]), nfe=sum(o.nfe for o in outs),
                        forward_tokens=None if None in forward else sum(f for f in forward if f is not None))


def _call_chunks(generator: Any, batch_size: int, rows: int) -> list[tuple[int, int, Any]]:
    """(first row, end row, generator) of each sampler call of at most `rows` rows (sample_in_chunks)."""
    if generator is None:  # a greedy call draws nothing
        return [(lo, min(lo + rows, batch_size), None) for lo in range(0, batch_size, rows)]
    groups = row_chunks(generator, batch_size)  # [(lo, hi, generator)]: checks that it covers the batch
    size = groups[0][1] - groups[0][0]
    if rows >= size:  # whole groups per call
        per_call = rows // size
        return [(groups[i][0], groups[min(i + per_call, len(groups)) - 1][1],
                 RowGenerators([g for _, _, g in groups[i:i + per_call]], size))
                for i in range(0, len(groups), per_call)]
    seeds = chunk_seeds(generator, batch_size)  # one draw from each group's generator
    calls = []
    for (lo, hi, g), (_, _, seed) in zip(groups, seeds):
        row_gens = [torch.Generator(device=g.device).manual_seed(keyed_seed(seed, j)) for j in range(hi - lo)]
        calls += [(lo + a, lo + min(a + rows, hi - lo), RowGenerators(row_gens[a:a + rows], 1))
                  for a in range(0, hi - lo, rows)]
    return calls


def _cat_trajectories(parts: list[Trajectory | None]) -> Trajectory | None:
    """The trajectories of consecutive row chunks as one. A chunk that took fewer steps (threshold decoding,
    early exit) is padded with its last step: a committed position keeps its commit-step value."""
    if parts[0] is None:
        return None
    recorded = [p for p in parts if p is not None]  # a sampler records on every chunk or on none
    S = max(0 if p.token_probs is None else p.token_probs.shape[1] for p in recorded)

    def pad(t: Tensor) -> Tensor:  # [b, s, L] -> [b, S, L]
        return torch.cat([t, t[:, -1:].expand(-1, S - t.shape[1], -1)], dim=1) if t.shape[1] < S else t

    times = [p.step_times for p in recorded]
    if any(t is not None and (times[0] is None or not torch.equal(t, times[0])) for t in times):
        raise ValueError("rollout.batch_rows: the row chunks' samplers ran different step schedules; unset "
                         "rollout.batch_rows or rollout.threshold")
    states = [p.states for p in recorded if p.states is not None]
    if states and (len(states) < len(recorded) or any(s.shape[1] != states[0].shape[1] for s in states)):
        raise ValueError("rollout.batch_rows: the row chunks recorded different numbers of states; unset "
                         "rollout.batch_rows")
    probs = [pad(p.token_probs) for p in recorded if p.token_probs is not None]  # the chunks' samplers are alike
    return Trajectory(commit_step=torch.cat([p.commit_step for p in recorded]),
                      token_probs=torch.cat(probs) if probs else None,  # [B, S, L]
                      states=torch.cat(states) if states else None, step_times=times[0])
