"""SEPO's DNA experiment in miniature, on the CPU (issue 26, item 6).

The paper (Zekri & Boullé, arXiv 2502.01384) fine-tunes DRAKES's MDLM DNA model (200 bp gosai enhancers)
with SEPO, KL-free, for gReLU's predicted HepG2 activity: median ~0.13 -> ~7.6. Here everything is made
by ddrl from a seed, so the story runs in minutes and its oracle is known exactly:

1. data: `ddrl.tasks.dna_motifs.write_motif_dataset` (32 bp, three motifs with preferred positions, a
   position-weighted motif-count oracle; gosai-format CSV, split by hash into train / dev / sealed test);
2. base: `ddrl pretrain configs/pretrain/dna_motifs_mdlm.yaml` (the released CNN at hidden 32, 1 stack);
3. RL: configs/rl/sepo_dna_motifs.yaml (SEPO's released path) and configs/rl/grpo_dna_motifs.yaml
   (diffu-GRPO) on the same budget (steps x rollouts x mu), each at every lr of the grid; the lr is
   chosen on the dev split (mean predicted activity, dev sampler seeds);
4. report, on the sealed test split (its own sampler seeds; the 3-mer reference is the data's top rows):
   predicted activity (mean with a bootstrap 95% interval, median), the paired gain over the base on the
   same sampler seeds, 3-mer Pearson, and the log-likelihood bound of the samples under the *base* model
   (the drift a KL-free run risks), with the data's own test sequences as the reference point.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sepo_dna_story.py --out bench/results/sepo_dna_story.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/sepo_dna_story.py --quick     # seconds: a smoke run

Times are the wall seconds of each phase on this machine (shared CPUs: compare ratios).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN = ROOT / "configs/pretrain/dna_motifs_mdlm.yaml"
METHODS = {"sepo": ROOT / "configs/rl/sepo_dna_motifs.yaml", "diffu_grpo": ROOT / "configs/rl/grpo_dna_motifs.yaml"}
DEV_SEED, TEST_SEED = 11, 22  # evaluation seeds: distinct sampler streams for dev and test


class Protocol(NamedTuple):
    """Sizes of one story; the full run and --quick differ only here. (A NamedTuple: the bench is also
    loaded as a bare file, where a dataclass cannot resolve its module.)"""

    n_data: int = 4000
    data_seed: int = 0
    pretrain_steps: int = 600
    rl_steps: int = 30
    lrs: tuple[float, ...] = (3e-4, 1e-3)
    dev_n: int = 128
    test_n: int = 256
    likelihood_steps: int = 32


QUICK = Protocol(n_data=400, pretrain_steps=4, rl_steps=1, lrs=(1e-3,), dev_n=8, test_n=16, likelihood_steps=4)


def sampler() -> Any:
    from ddrl.config import SamplerConfig

    return SamplerConfig(name="drakes", steps=32, gen_length=32, block_length=32, temperature=1.0)


def score(model: Any, base: Any, task: Any, split: str, n: int, seed: int, proto: Protocol, work: Path) -> dict:
    """Sample n sequences (the split's sampler seeds), score them with the oracle and under the base model."""
    import numpy as np
    import torch

    import ddrl
    from ddrl.stats import mean_estimate
    from ddrl.tasks.dna import BASES, mdlm_log_likelihood

    rows_path = work / f"rows-{split}-{time.monotonic_ns()}.jsonl"
    result = ddrl.evaluate(model, task, n=n, sampler=sampler(), split=split, seed=seed, output_jsonl=rows_path)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    seqs = [r["completions"][0] for r in rows]
    activity = [r["rewards"][0] for r in rows]
    ids = torch.tensor([[BASES.index(c) for c in s] for s in seqs], dtype=torch.long)
    loglik = mdlm_log_likelihood(base, ids, proto.likelihood_steps, generator=torch.Generator().manual_seed(seed))
    act, ll = mean_estimate(activity), mean_estimate(loglik.tolist())
    return {"n": len(seqs), "activity_mean": act.mean, "activity_interval": [act.lo, act.hi],
            "activity_median": float(np.median(activity)), "activity": activity,
            "kmer3_pearson": result["breakdown"].get("kmer3_pearson"),
            "loglik_mean": ll.mean, "loglik_interval": [ll.lo, ll.hi], "loglik_median": float(loglik.median()),
            "distinct": len(set(seqs)), "examples": seqs[:4]}


def data_reference(base: Any, task: Any, proto: Protocol) -> dict:
    """The base model's likelihood and the oracle on the sealed test split's own (data) sequences."""
    import torch

    from ddrl.stats import mean_estimate
    from ddrl.tasks.dna import BASES, mdlm_log_likelihood

    seqs = [ex["seq"] for ex in task.all_test_examples()][:proto.test_n]
    ids = torch.tensor([[BASES.index(c) for c in s] for s in seqs], dtype=torch.long)
    ll = mean_estimate(mdlm_log_likelihood(base, ids, proto.likelihood_steps,
                                           generator=torch.Generator().manual_seed(TEST_SEED)).tolist())
    act = mean_estimate(task.reward(seqs))
    return {"n": len(seqs), "activity_mean": act.mean, "activity_interval": [act.lo, act.hi],
            "loglik_mean": ll.mean, "loglik_interval": [ll.lo, ll.hi]}


def final_model(run: Path) -> Path:
    return max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    parser.add_argument("--work", default=None, help="directory for data, base and runs (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    proto = QUICK if args.quick else Protocol()

    import ddrl
    from ddrl.stats import gain_estimate
    from ddrl.tasks.dna import DNAEnhancerTask
    from ddrl.tasks.dna_motifs import write_motif_dataset

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        times: dict[str, float] = {}
        start = time.perf_counter()
        files = write_motif_dataset(work / "data", n=proto.n_data, seed=proto.data_seed)
        task_args = [f"task.args.path={files['path']}", f"task.args.oracle={files['oracle']}"]
        base_dir = ddrl.pretrain(str(PRETRAIN), overrides=task_args + [
            f"train.steps={proto.pretrain_steps}", f"train.eval_every={max(1, proto.pretrain_steps)}",
            "train.progress=false", f"output_dir={work / 'base'}"])
        times["pretrain_s"] = time.perf_counter() - start
        task = DNAEnhancerTask(path=str(files["path"]), split="hash", oracle=str(files["oracle"]))
        base = ddrl.load_model(base_dir).eval()

        t0 = time.perf_counter()
        result: dict[str, Any] = {"protocol": proto._asdict(), "data": data_reference(base, task, proto),
                                  "base": {"dev": score(base, base, task, "dev", proto.dev_n, DEV_SEED, proto, work),
                                           "test": score(base, base, task, "test", proto.test_n, TEST_SEED, proto,
                                                         work)}}
        times["eval_s"] = time.perf_counter() - t0
        for method, config in METHODS.items():
            sweep = {}
            for lr in proto.lrs:
                t0 = time.perf_counter()
                run = ddrl.train(str(config), overrides=task_args + [
                    f"model.path={base_dir}", f"train.steps={proto.rl_steps}", f"train.lr={lr}",
                    f"train.save_every={proto.rl_steps}", "train.progress=false", "train.tensorboard=false",
                    "eval.before=false", "eval.every=0", f"output_dir={work / f'{method}-lr{lr:g}'}"])
                train_s = time.perf_counter() - t0
                tuned = ddrl.load_model(final_model(Path(run))).eval()
                dev = score(tuned, base, task, "dev", proto.dev_n, DEV_SEED, proto, work)
                sweep[lr] = {"run": Path(run), "model": tuned, "dev": dev, "train_s": train_s}
            best = max(proto.lrs, key=lambda lr: sweep[lr]["dev"]["activity_mean"])
            test = score(sweep[best]["model"], base, task, "test", proto.test_n, TEST_SEED, proto, work)
            gain = gain_estimate(result["base"]["test"]["activity"], test["activity"])
            result[method] = {"lr": best, "train_s": sweep[best]["train_s"], "test": test,
                              "gain": {"value": gain.mean, "interval": [gain.lo, gain.hi]},
                              "dev_by_lr": {f"{lr:g}": {"activity_mean": s["dev"]["activity_mean"],
                                                        "loglik_mean": s["dev"]["loglik_mean"],
                                                        "train_s": s["train_s"]} for lr, s in sweep.items()}}
        times["total_s"] = time.perf_counter() - start
        result["times"] = times
    for part in ("base", "sepo", "diffu_grpo"):  # per-sample lists stay out of the printed JSON
        for split in ("dev", "test"):
            result[part].get(split, {}).pop("activity", None)
    print(report(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def report(result: dict[str, Any]) -> str:
    """A markdown table of the sealed-test numbers."""
    def interval(d: dict, key: str) -> str:
        lo, hi = d[f"{key}_interval"]
        return f"{d[f'{key}_mean']:.2f} [{lo:.2f}, {hi:.2f}]"

    lines = ["| model (sealed test) | n | activity mean [95%] | median | gain vs base [95%] | log-lik under base "
             "[95%] | 3-mer r | lr (dev) | train s |", "|---|---|---|---|---|---|---|---|---|"]
    data = result["data"]
    lines.append(f"| data (test rows) | {data['n']} | {interval(data, 'activity')} | | | {interval(data, 'loglik')} "
                 f"| | | |")
    for name in ("base", "sepo", "diffu_grpo"):
        part = result[name]
        test = part["test"]
        gain = (f"{part['gain']['value']:+.2f} [{part['gain']['interval'][0]:+.2f}, {part['gain']['interval'][1]:+.2f}]"
                if "gain" in part else "")
        lines.append(f"| {name} | {test['n']} | {interval(test, 'activity')} | {test['activity_median']:.2f} | {gain} "
                     f"| {interval(test, 'loglik')} | {test['kmer3_pearson']:.2f} | {part.get('lr', '')} "
                     f"| {part.get('train_s', 0):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
