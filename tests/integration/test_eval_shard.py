"""Evaluation batched and sharded: each rank samples its share of the examples, many per sampler call,
and every rank gets the whole result, the same as one process evaluating everything.

Example i draws from its own generator (seed, i), so the batch or rank it lands in changes nothing,
also when sampling (temperature > 0). Two gloo processes on the CPU, started here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.integration.conftest import ROOT

MODEL = ROOT / "checkpoints/mini_sudoku-masked"
N, K = 7, 2


def _evaluate(out: Path, batch_size: int, temperature: float, shard: bool = False) -> tuple[dict, list, list[int]]:
    """(result, rows written, rows per sampler call)."""
    from ddrl.eval import runner
    from ddrl.models import load_model
    from ddrl.sampling import engine
    from ddrl.tasks import get_task

    calls: list[int] = []
    samplers = engine.SAMPLERS

    class Counted:  # the sampler registry of the rollout engine evaluation samples through, counting rows per call
        def get(self, name):
            sampler = samplers.get(name)

            def call(model, prompt_ids, *args, **kwargs):
                calls.append(prompt_ids.shape[0])
                return sampler(model, prompt_ids, *args, **kwargs)
            return call

    engine.SAMPLERS = Counted()
    try:
        task = get_task("mini_sudoku", min_empty=8, max_empty=12)  # 2-step decoding errs: runs can differ
        result = runner.evaluate(load_model(MODEL), task, n=N, sampler={"steps": 2, "temperature": temperature},
                                 seed=3, k=K, batch_size=batch_size, shard=shard, output_jsonl=out)
    finally:
        engine.SAMPLERS = samplers
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return result, [(r["prompt"], r["completions"]) for r in rows], calls


def _rank(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        report = {}
        for temperature in (0.0, 1.0):
            result, rows, calls = _evaluate(Path(out) / f"rank{rank}-{temperature}.jsonl", 2, temperature, shard=True)
            report[str(temperature)] = {"accuracy": result["accuracy"], "n": result["n"], "rows": rows,
                                        "calls": calls}
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    from ddrl.training.distributed import exit_without_finalizing

    exit_without_finalizing(0)  # gloo's threads can abort the interpreter's exit (SIGABRT): its docstring


def test_two_ranks_evaluate_their_shares_and_agree_with_one_process(tmp_path):
    mp.start_processes(_rank, args=(f"file://{tmp_path}/process-group", str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for temperature in (0.0, 1.0):
        one, rows, calls = _evaluate(tmp_path / f"one-{temperature}.jsonl", 2, temperature)
        assert calls == [4, 4, 4, 2]  # 2 examples x k = 2 per call: batched, not a row per call
        for part in ranks:  # every rank holds the whole result, in example order
            got = part[str(temperature)]
            assert got["n"] == N and got["accuracy"] == one["accuracy"]
            assert [tuple(r) for r in got["rows"]] == [tuple(r) for r in json.loads(json.dumps(rows))]
        # rank 0 sampled examples 0, 2, 4, 6 and rank 1 examples 1, 3, 5: each its share only
        assert [ranks[r][str(temperature)]["calls"] for r in (0, 1)] == [[4, 4], [4, 2]]


def test_batching_changes_no_sample(tmp_path):
    seen = []
    for temperature in (0.0, 1.0):  # greedy: the earlier results; sampling: the same draws per example
        _, whole, _ = _evaluate(tmp_path / f"a-{temperature}.jsonl", 64, temperature)
        _, small, _ = _evaluate(tmp_path / f"b-{temperature}.jsonl", 3, temperature)
        assert whole == small
        seen.append(whole)
    assert seen[0] != seen[1], "sampling gave the greedy completions: the sampled comparison is void"
