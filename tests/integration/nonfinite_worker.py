"""Run under `torchrun --nproc_per_node 2` by test_world_size: `ddrl train CONFIG OVERRIDES...` with
GRPO's loss made NaN on rank 1 only, its gradient left finite (a NaN constant added to the value), so
that only the ranks' own view of the loss differs: the non-finite decision must still be the same on
every rank (all skip the optimizer step, or all raise NonFiniteError)."""

from __future__ import annotations

import sys

import torch.distributed as dist

from ddrl.objectives.grpo import GRPO
from ddrl.training.trainer import train


def nan_on_rank_one(call):
    def loss(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        if dist.is_initialized() and dist.get_rank() == 1:
            out.loss = out.loss + float("nan")  # the value only: d(loss + c) = d loss
        return out
    return loss


if __name__ == "__main__":
    from ddrl.training.distributed import end_process_group, exit_without_finalizing

    GRPO.__call__ = nan_on_rank_one(GRPO.__call__)
    train(sys.argv[1], sys.argv[2:])
    end_process_group()
    exit_without_finalizing(0)  # gloo's threads can abort the interpreter's exit (SIGABRT): its docstring
