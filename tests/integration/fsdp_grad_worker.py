"""Run under `torchrun --nproc_per_node 2` by test_fsdp_accumulation: shard a toy model as the trainer
does (ddrl.training.distributed.shard_model, bf16 compute over fp32 shards), run a NON-final micro-batch
of gradient accumulation inside `gradient_sync(enabled=False)`, and write what each parameter's .grad
is to $OUT/rank{R}.json."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from ddrl.training.distributed import gradient_sync, shard_model


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))  # the "transformer blocks"
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Toy()
    shard_model(model, torch.device("cpu"), sys.argv[2] if len(sys.argv) > 2 else "bf16")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    with gradient_sync(model, enabled=False):  # micro-batch 0 of 2: not the last
        model(x).float().pow(2).mean().backward()
    report = {}
    for name, p in model.named_parameters():
        g = p.grad
        report[name] = None if g is None else {
            "dtensor": hasattr(g, "placements"), "placements": [f"Shard({pl.dim})" if isinstance(pl, Shard) else str(pl)
                                                          for pl in getattr(g, "placements", [])],
            "dtype": str(g.dtype), "param_dtype": str(p.dtype),
            "local_shape": list(getattr(g, "to_local", lambda: g)().shape),
            "param_local_shape": list(p.to_local().shape)}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from ddrl.training.distributed import exit_without_finalizing

    main(sys.argv[1])
    exit_without_finalizing(0)  # gloo's threads can abort the interpreter's exit (SIGABRT): its docstring
