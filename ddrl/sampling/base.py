"""What every sampler returns, and the one signature the trainer and evaluator call.

    out = SAMPLERS.get(cfg.name)(model, prompt_ids, prompt_mask, cfg, generator=g, return_trajectory=True)

`model` is a DiffusionLM (or anything with the same attributes: mask_token_id, vocab_size,
eos_token_id, pad_token_id, process, block_size, and `model(input_ids, attention_mask).logits`).
`g` is a torch.Generator, or a ddrl.processes.draws.RowGenerators (one generator per chunk of rows,
e.g. per prompt group): then each chunk gets the completions a call on that chunk alone would get,
so one batched call can serve every group of a rank. The settings are checked by
ddrl.sampling.checks.check_sampler (the same check config validation runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ddrl.types import Trajectory


@dataclass
class SampleOutput:
    completion_ids: Tensor  # [B, L] long, the generated completion (prompt excluded)
    trajectory: Trajectory | None  # filled when return_trajectory=True
    nfe: int  # model forward calls made (a batched call counts once)
    forward_tokens: int | None = None  # rows x tokens fed to the model, summed over calls (cost; None = not counted)


def model_mask_id(model, fix: str = "set mask_token_id in the model config") -> int:
    """The model's mask token, which every masked-diffusion sampler needs; `fix` says where to set it."""
    mask_id = getattr(model, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(f"model.mask_token_id is None; masked-diffusion samplers need the model's mask token ({fix})")
    return int(mask_id)
