"""DiPOD's stabilisation, measured exactly: the gap between the ELBO and the true log-likelihood
through RL, FPO against DiPOD, on a masked model small enough to enumerate (issue 17;
docs/seed_claims.md).

DiPOD (Jiang et al., arXiv 2606.13795) says that optimising FPO's ELBO ratio lets the ELBO drift away
from the true log-likelihood of the policy ("double drift"), and that adding lambda * mean(-ELBO) of
the policy's own samples (ddrl/objectives/dipod.py) keeps the bound tight.

The setting. A tiny task of three-token completions over the symbols a, b, c, prompted by one symbol;
reward 1 when the completion is a permutation of abc that starts with the prompted symbol. A tiny
built-in masked denoiser (ddrl.models, `ddrl pretrain`'s own loop) is pretrained on completions that
are a random permutation half of the time and three uniform symbols otherwise, so it is neither
uniform nor solved. RL then runs with the project's trainer, FPO and DiPOD each from the same base,
seeds and prompts, with the rollout sampler whose distribution is exactly enumerable:

    the policy pi(x | c): L = 3 steps, one token per step, the position uniformly random among the
    masked ones (rollout.remasking=random), the token drawn from the model's softmax at temperature 1.

Definitions, for a completion x of length L under prompt c, with lp(S, i) = log p_theta(x^i | x with
the positions S masked, c):

    log pi(x)  = log (1/L!) sum_sigma prod_j p_theta(x^{sigma_j} | x^{sigma_<j} revealed)     (every order)
    ELBO(x)    = sum_{k=1..L} (1/k) mean_{|S|=k} sum_{i in S} lp(S, i)  = E_sigma[log prod_j ...]
    gap(x)     = log pi(x) - ELBO(x) >= 0                          (Jensen over orders; 0 iff they agree)
    FPO proxy  = sum_{k=1..L-1} (1/k) mean_{|S|=k} sum_{i in S} lp(S, i)
                 (what the fpo_elbo estimator averages to: no fully-masked term; an EOS-free x)

All exact: 2^L masked subsets per completion, every completion over the model's vocabulary (the
mask token excluded) for the on-policy expectations E_pi[gap], E_pi[reward]. Tracked every few steps:
E_pi[reward] (the exact expected reward, no sampling noise), E_pi[gap], and the mean gap over the
fixed set of the 18 (prompt, permutation) completions. The bench checks sum_x pi(x) = 1 and that the
trainer's own rollout sampler draws from pi (total-variation distance of its samples).

    OMP_NUM_THREADS=1 .venv/bin/python bench/dipod_elbo_gap.py            # the study (~6 CPU-min)
    OMP_NUM_THREADS=1 .venv/bin/python bench/dipod_elbo_gap.py --quick    # a smoke run (< 20 s)
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _claims import Clock, picture_path, write_json  # noqa: E402

from ddrl.registry import TASKS  # noqa: E402
from ddrl.tasks.base import Task  # noqa: E402

TASK_NAME = "claims_perm3"
SYMBOLS = ("a", "b", "c")
L = len(SYMBOLS)


class Perm3Task(Task):
    """Prompt: one symbol. Correct completion: a permutation of abc that starts with it (2 of 27)."""

    name = TASK_NAME
    gen_length = L

    def _examples(self, n: int, key: str) -> list[dict[str, Any]]:
        rng = random.Random(key)
        return [{"prompt": s, "first": s} for s in (rng.choice(SYMBOLS) for _ in range(n))]

    # Prompts are the three symbols by nature (as digits' class labels): the splits differ by draw only.
    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples(n, f"{TASK_NAME}-train-{seed}")

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples(n, f"{TASK_NAME}-dev-{seed}")

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples(n, f"{TASK_NAME}-test-{seed}")

    def symbols(self) -> list[str]:
        return list(SYMBOLS)

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """Half random permutations, half uniform strings, independent of the prompt."""
        rng = random.Random(f"{TASK_NAME}-pretrain-{seed}")
        pairs = []
        for _ in range(n):
            perm = rng.random() < 0.5
            text = "".join(rng.sample(SYMBOLS, L) if perm else rng.choices(SYMBOLS, k=L))
            pairs.append({"prompt": rng.choice(SYMBOLS), "completion": text})
        return pairs

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        firsts = columns["first"]
        return [float(sorted(c) == sorted(SYMBOLS) and c[:1] == f) for c, f in zip(completions, firsts)]

    def correct(self, completions: list[str], **columns: Any) -> list[bool]:
        return [r == 1.0 for r in self.reward(completions, **columns)]


if TASK_NAME not in TASKS:
    TASKS.register(TASK_NAME)(Perm3Task)


@dataclass
class Setup:
    pretrain_steps: int = 300
    rl_steps: int = 100
    measure_every: int = 10
    prompts: int = 8
    group: int = 8
    lr: float = 3e-4
    seeds: tuple[int, ...] = tuple(range(10))
    sampler_check_n: int = 4000  # rollout-sampler draws compared with the exact pi (per prompt)


QUICK = Setup(pretrain_steps=10, rl_steps=2, measure_every=1, prompts=2, group=4, seeds=(0,), sampler_check_n=200)

# arm -> (objective, objective_args). FPO as released has a k1 term (beta 0.04) that, used as a loss,
# pushes the ELBO of the policy's own samples down; the beta = 0 arms separate that from the ratio.
ARMS = {"fpo": ("fpo", {}), "dipod": ("dipod", {}), "fpo_beta0": ("fpo", {"beta": 0.0}),
        "dipod_beta0": ("dipod", {"beta": 0.0})}


def rollout_sampler() -> dict[str, Any]:
    """The sampler whose distribution pi the bench enumerates (the module docstring)."""
    return {"name": "masked", "gen_length": L, "steps": L, "block_length": L, "temperature": 1.0,
            "remasking": "random", "cache": "none", "threshold": None, "early_exit": False}


def pretrain_base(out: Path, steps: int) -> Path:
    from ddrl.training.pretrain import pretrain

    cfg = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16},
           "task": {"name": TASK_NAME}, "data": {"n_train": 2000, "n_heldout": 64},
           "train": {"steps": steps, "batch_size": 64, "lr": 1e-3, "warmup_steps": 5, "eval_every": max(1, steps),
                     "progress": False},
           "sampler": rollout_sampler(), "seed": 0, "output_dir": str(out / "pretrain"), "device": "cpu"}
    return pretrain(cfg)


# --------------------------------------------------------------------------- exact enumeration


def subsets() -> list[tuple[int, ...]]:
    """Every non-empty set of masked positions, as sorted tuples."""
    return [s for k in range(1, L + 1) for s in itertools.combinations(range(L), k)]


@torch.no_grad()
def masked_logprobs(model: Any, prompts: list[str], completions: torch.Tensor) -> dict[tuple[int, ...], torch.Tensor]:
    """lp(S, i) for every prompt, completion, non-empty S and i in S: {S: [N_prompts, N_x, L]} (0 off S).

    completions: [N_x, L] token ids. One forward per S over all (prompt, completion) rows."""
    from ddrl.data import encode_prompts

    p_ids, p_mask = encode_prompts(model.tokenizer, prompts)  # [C, P]
    C, P = p_ids.shape
    X = completions.shape[0]
    out = {}
    model.eval()
    for S in subsets():
        x = completions.clone()
        x[:, list(S)] = model.mask_token_id
        ids = torch.cat([p_ids.repeat_interleave(X, 0), x.repeat(C, 1)], 1)  # [C*X, P+L]
        attn = torch.cat([p_mask.repeat_interleave(X, 0), torch.ones(C * X, L, dtype=torch.bool)], 1)
        logp = torch.log_softmax(model(ids, attention_mask=attn).logits[:, P:].double(), -1)  # [C*X, L, V]
        lp = logp.gather(-1, completions.repeat(C, 1)[..., None])[..., 0].view(C, X, L)
        keep = torch.zeros(L, dtype=torch.bool)
        keep[list(S)] = True
        out[S] = torch.where(keep, lp, torch.zeros_like(lp))
    return out


def order_logprobs(lp: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
    """log prod_j p(x^{sigma_j} | x^{sigma_<j} revealed) for every order sigma: [L!, N_prompts, N_x]."""
    orders = []
    for sigma in itertools.permutations(range(L)):
        masked, total = list(range(L)), 0.0
        for pos in sigma:  # reveal sigma_j given the still-masked set
            total = total + lp[tuple(masked)][..., pos]
            masked.remove(pos)
        orders.append(total)
    return torch.stack(orders)


def exact_quantities(lp: dict[tuple[int, ...], torch.Tensor]) -> dict[str, torch.Tensor]:
    """log pi, ELBO and the FPO proxy target, each [N_prompts, N_x], from masked_logprobs. The ELBO
    is computed from the subsets (its definition), not as the mean over orders it equals."""
    log_pi = torch.logsumexp(order_logprobs(lp), 0) - math.log(math.factorial(L))
    by_k: dict[int, list[torch.Tensor]] = {}
    for S, v in lp.items():
        by_k.setdefault(len(S), []).append(v.sum(-1))
    term = {k: torch.stack(vs).mean(0) / k for k, vs in by_k.items()}  # (1/k) mean_{|S|=k} sum_{i in S}
    elbo = sum(term.values())
    proxy = sum(v for k, v in term.items() if k < L)
    return {"log_pi": log_pi, "elbo": elbo, "fpo_proxy": proxy}


def vocabulary(model: Any) -> list[int]:
    """The ids the policy can emit: the vocabulary without the suppressed (mask) token."""
    suppressed = model.suppressed_vocab(model.vocab_size, "cpu")
    return [i for i in range(model.vocab_size) if suppressed is None or not bool(suppressed[i])]


def all_completions(model: Any) -> torch.Tensor:
    return torch.tensor(list(itertools.product(vocabulary(model), repeat=L)), dtype=torch.long)  # [N_x, L]


def fixed_completions(model: Any) -> torch.Tensor:
    ids = [model.tokenizer.convert_tokens_to_ids(s) for s in SYMBOLS]
    return torch.tensor(list(itertools.permutations(ids)), dtype=torch.long)  # [6, L]


def measure(model: Any) -> dict[str, float]:
    """The exact on-policy and fixed-set numbers of one model (module docstring)."""
    from ddrl.data import decode_completions, model_stop_ids

    prompts = list(SYMBOLS)
    xs = all_completions(model)
    q = exact_quantities(masked_logprobs(model, prompts, xs))
    pi = q["log_pi"].exp()  # [3, N_x]
    texts = decode_completions(model.tokenizer, xs, model_stop_ids(model))  # as the trainer reads a rollout
    task = Perm3Task()
    rewards = torch.tensor([task.reward(texts, first=[p] * len(texts)) for p in prompts], dtype=torch.float64)
    fixed = exact_quantities(masked_logprobs(model, prompts, fixed_completions(model)))
    gap_fixed = fixed["log_pi"] - fixed["elbo"]  # [3, 6]
    return {"pi_total_max_error": float((pi.sum(1) - 1).abs().max()),
            "reward": float((pi * rewards).sum(1).mean()),
            "gap_on_policy": float((pi * (q["log_pi"] - q["elbo"])).sum(1).mean()),
            "gap_fixed": float(gap_fixed.mean()),
            "proxy_gap_fixed": float((fixed["log_pi"] - fixed["fpo_proxy"]).mean()),
            "log_pi_fixed": float(fixed["log_pi"].mean()), "elbo_fixed": float(fixed["elbo"].mean()),
            "entropy": float(-(pi * q["log_pi"]).sum(1).mean())}


@torch.no_grad()
def sampler_check(model: Any, n: int, seed: int = 0) -> dict[str, float]:
    """Total-variation distance between the rollout sampler's n draws per prompt and the exact pi,
    and the TV that n exact draws would show (the same pi resampled), so the two can be compared."""
    from ddrl.config import SamplerConfig
    from ddrl.data import encode_prompts
    from ddrl.registry import SAMPLERS

    xs = all_completions(model)
    index = {tuple(r): j for j, r in enumerate(xs.tolist())}
    pi = exact_quantities(masked_logprobs(model, list(SYMBOLS), xs))["log_pi"].exp()  # [3, N_x]
    g = torch.Generator().manual_seed(seed)
    tv, tv_null = [], []
    for c, prompt in enumerate(SYMBOLS):
        ids, mask = encode_prompts(model.tokenizer, [prompt] * n)
        out = SAMPLERS.get("masked")(model, ids, mask, SamplerConfig(**rollout_sampler()), generator=g)
        counts = torch.zeros(len(xs), dtype=torch.float64)
        for row in out.completion_ids.tolist():
            counts[index[tuple(row)]] += 1
        tv.append(float(0.5 * (counts / n - pi[c]).abs().sum()))
        null = torch.bincount(torch.multinomial(pi[c], n, replacement=True, generator=g), minlength=len(xs))
        tv_null.append(float(0.5 * (null / n - pi[c]).abs().sum()))
    return {"tv_sampler": max(tv), "tv_exact_resample": max(tv_null), "n_per_prompt": n}


# --------------------------------------------------------------------------- the study


def rl_trainer(base: Path, arm: str, seed: int, setup: Setup, out: Path) -> Any:
    from ddrl.config import RLConfig, load_config
    from ddrl.training.trainer import Trainer

    cfg = {"model": {"path": str(base)}, "task": {"name": TASK_NAME}, "rollout": rollout_sampler(),
           "method": {"objective": ARMS[arm][0], "objective_args": dict(ARMS[arm][1])},
           "train": {"steps": setup.rl_steps, "prompts_per_step": setup.prompts, "group_size": setup.group,
                     "num_iterations": 2, "lr": setup.lr, "max_grad_norm": 1.0, "save_every": 0,
                     "progress": False, "tensorboard": False},
           "eval": {"n": 0}, "seed": seed, "output_dir": str(out / f"{arm}-seed{seed}"), "device": "cpu"}
    return Trainer(load_config(cfg, None, RLConfig))


def run_one(base: Path, arm: str, seed: int, setup: Setup, out: Path) -> dict[str, Any]:
    """RL with the trainer's own steps; the exact numbers every measure_every steps."""
    trainer = rl_trainer(base, arm, seed, setup, out)
    curve = [{"step": 0, **measure(trainer.model)}]
    rewards, grads = [], []
    for step in range(1, setup.rl_steps + 1):
        trainer.step = step
        m = trainer.train_step(step)
        rewards.append(m.get("reward/mean"))
        grads.append(m.get("grad_norm"))
        if step % setup.measure_every == 0 or step == setup.rl_steps:
            curve.append({"step": step, **measure(trainer.model)})
    return {"arm": arm, "seed": seed, "curve": curve, "rollout_reward": rewards, "grad_norm": grads}


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n_seeds": len(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and measured step: mean and [min, max] over training seeds of each quantity."""
    out: dict[str, Any] = {}
    for arm in [a for a in ARMS if any(r["arm"] == a for r in runs)]:
        mine = [r for r in runs if r["arm"] == arm]
        steps = [p["step"] for p in mine[0]["curve"]]
        out[arm] = {"steps": steps}
        for key in ("reward", "gap_on_policy", "gap_fixed", "proxy_gap_fixed", "entropy"):
            out[arm][key] = [spread([r["curve"][i][key] for r in mine]) for i in range(len(steps))]
    return out


PAIRS = (("dipod", "fpo"), ("dipod_beta0", "fpo_beta0"))  # (with the ELBO term, its base without it)


def paired_over_seeds(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """DiPOD minus its FPO base at the last step, paired by training seed (same base model, same
    prompts): mean difference and 95% percentile bootstrap over seeds (ddrl.stats.gain_estimate)."""
    from ddrl.stats import gain_estimate

    out: dict[str, dict[str, Any]] = {}
    for arm, base in PAIRS:
        mine = {r["seed"]: r["curve"][-1] for r in runs if r["arm"] == arm}
        theirs = {r["seed"]: r["curve"][-1] for r in runs if r["arm"] == base}
        seeds = sorted(set(mine) & set(theirs))
        if len(seeds) < 2:
            continue
        out[f"{arm} - {base}"] = {}
        for key in ("reward", "gap_on_policy", "gap_fixed"):
            est = gain_estimate([theirs[s][key] for s in seeds], [mine[s][key] for s in seeds], seed=0)
            out[f"{arm} - {base}"][key] = {**est.as_dict(), "n_seeds": len(seeds), "excludes_zero": est.excludes_zero}
    return out


def plot(summary: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "exact E_pi[reward]"), ("gap_on_policy", "E_pi[log pi - ELBO] (nats)"),
              ("gap_fixed", "log pi - ELBO, 18 fixed completions")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for c, (arm, s) in enumerate(summary.items()):
        for ax, (key, title) in zip(axes, panels):
            mean = [p["mean"] for p in s[key]]
            ax.plot(s["steps"], mean, "--" if arm.endswith("beta0") else "-", color=f"C{c}", marker="o", ms=3,
                    label=arm)
            ax.fill_between(s["steps"], [p["min"] for p in s[key]], [p["max"] for p in s[key]], color=f"C{c}",
                            alpha=0.15)
            ax.set_title(title, fontsize=9)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    n_seeds = len({r["seed"] for r in runs})
    axes[0].legend(fontsize=8)
    fig.suptitle(f"FPO vs DiPOD on an enumerable masked model: mean and min-max over {n_seeds} seeds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def table(summary: dict[str, Any]) -> str:
    head = ["arm", "E_pi[reward]: base -> last", "E_pi[gap]: base -> last", "fixed-set gap: base -> last",
            "fixed-set FPO-proxy gap: last", "entropy: last"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def cell(points: list[dict[str, float]], i: int) -> str:
        p = points[i]
        return f"{p['mean']:.3f} [{p['min']:.3f}, {p['max']:.3f}]"

    for arm, s in summary.items():
        lines.append(f"| {arm} | {cell(s['reward'], 0)} -> {cell(s['reward'], -1)} | {cell(s['gap_on_policy'], 0)} -> "
                     f"{cell(s['gap_on_policy'], -1)} | {cell(s['gap_fixed'], 0)} -> {cell(s['gap_fixed'], -1)} | "
                     f"{cell(s['proxy_gap_fixed'], -1)} | {cell(s['entropy'], -1)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps, one seed (smoke test)")
    p.add_argument("--steps", type=int, default=Setup.rl_steps)
    p.add_argument("--lr", type=float, default=Setup.lr)
    p.add_argument("--seeds", default=",".join(map(str, Setup.seeds)))
    p.add_argument("--arms", default=",".join(ARMS), help=f"any of {', '.join(ARMS)}")
    p.add_argument("--out", default="runs/seed_claims/dipod")
    p.add_argument("--png", default=None, help="picture path (default docs/dipod_elbo_gap.png; --quick: in --out)")
    args = p.parse_args(argv)
    setup = QUICK if args.quick else Setup(rl_steps=args.steps, lr=args.lr,
                                           seeds=tuple(int(s) for s in args.seeds.split(",")))
    out = Path(args.out)
    arms = args.arms.split(",") if not args.quick else ["fpo", "dipod"]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; valid: {', '.join(ARMS)}")
    result: dict[str, Any] = {"setup": vars(setup) | {"seeds": list(setup.seeds)}, "sampler": rollout_sampler()}
    with Clock() as clock:
        base = pretrain_base(out, setup.pretrain_steps)
        from ddrl.models import load_model

        base_model = load_model(base)
        result["base"] = measure(base_model)
        result["sampler_check"] = sampler_check(base_model, setup.sampler_check_n)
        print(f"base: {result['base']}\nsampler vs exact pi: {result['sampler_check']}", flush=True)
        runs = []
        for seed in setup.seeds:
            for arm in arms:
                runs.append(run_one(base, arm, seed, setup, out))
                last = runs[-1]["curve"][-1]
                print(f"{arm} seed {seed}: reward {last['reward']:.3f}, on-policy gap {last['gap_on_policy']:.4f}, "
                      f"fixed gap {last['gap_fixed']:.4f}", flush=True)
                result["runs"] = runs
                write_json(out / "results.json", result)
    result["summary"] = summarize(runs)
    result["paired"] = paired_over_seeds(runs)
    result["wall_s"], result["cpu_s"] = round(clock.wall, 1), round(clock.cpu, 1)
    write_json(out / "results.json", result)
    png = picture_path(args.png, args.quick, out, "dipod_elbo_gap.png")
    plot(result["summary"], runs, png)
    print(table(result["summary"]))
    for name, diffs in result["paired"].items():
        parts = [f"{k} {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" for k, d in diffs.items()]
        print(f"{name}: {', '.join(parts)} (last step, paired over {len(setup.seeds)} seeds)")
    print(f"{result['cpu_s']} CPU-s, {result['wall_s']} wall-s")
    return result


if __name__ == "__main__":
    main()
