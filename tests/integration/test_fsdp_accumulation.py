"""FSDP2 gradient accumulation reduce-scatters every micro-batch: after a non-final micro-batch's
backward each rank holds only its shard of every gradient (a Shard(0) DTensor in the parameter's
dtype). With set_requires_gradient_sync(False) FSDP2 instead keeps every gradient unsharded (and
upcast to fp32) until the last micro-batch: 8.0B x 4 B = 32 GB per rank at LLaDA-8B, the largest item
of a full fine-tuning step. DDP keeps no_sync (its gradients are full-size anyway)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT


@pytest.mark.parametrize("precision", ["bf16", "none"])
def test_fsdp_gradients_stay_sharded_across_micro_batches(precision, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.integration.fsdp_grad_worker", str(tmp_path), precision]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        grads = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert grads, "no parameters: test is void"
        for name, g in grads.items():
            assert g is not None, f"rank {rank}: {name}.grad is None after a non-final micro-batch (held unsharded)"
            assert g["dtensor"] and g["placements"] == ["Shard(0)"], (name, g)
            assert g["dtype"] == g["param_dtype"] == "torch.float32", (name, g)
            assert g["local_shape"] == g["param_local_shape"], (name, g)
