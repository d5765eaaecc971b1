"""`ddrl train CONFIG`: RL fine-tuning of a diffusion model, one readable loop.

Each step, in named and timed phases:

    rollout    G completions for each prompt (any registered sampler, explicit generator)
    reward     the task's reward; None/NaN rewards are excluded from their group
    advantage  group advantages (mean / z-score / leave-one-out, optional clip)
    old, ref   likelihood proxies without grad, only when the objective declares it needs them
    update     mu inner iterations on the same rollouts, each over `minibatches` shares of the groups,
               each share: estimate -> loss -> backward (micro-batches of whole groups) -> clip -> step

What the method needs (old / reference passes, trajectories, advantages, mask seeds) is read from
one typed `Method` (ddrl.training.method), built once from the config.

Every random draw derives from (seed, step, ...) so a resumed run replays the draws of an
uninterrupted one. Mask seeds live on the batch: old, ref and current passes of inner iteration k
share seed k unless the method asks for fresh masks (StableDRL).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from tqdm.auto import tqdm

from ddrl.config import RLConfig, SamplerConfig, load_config, save_config, task_kwargs
from ddrl.data import completion_mask, decode_completions, encode_prompts, is_stop, model_stop_ids
from ddrl.registry import SAMPLERS
from ddrl.training import checkpoint as ckpt
from ddrl.training.common import (build_optimizer, build_scheduler, check_writable, derive_seed,
                                  make_generator, pick_device)
from ddrl.training.distributed import (DistInfo, GatheredModel, ModelHandle, all_reduce_sum, gather_full_state,
                                       gathered_parameters, gradient_sync, init_distributed, load_full_state,
                                       reduce_mean_dict, resolve_strategy, wrap_model)
from ddrl.training.logging import MetricsLogger, plot_reward_curve
from ddrl.training.method import Method, build_method
from ddrl.sampling.base import SampleOutput
from ddrl.types import EstimatorOutput, RolloutBatch, Trajectory

if TYPE_CHECKING:
    from ddrl.objectives.aggregation import AggregationCounts


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class Trainer:
    def __init__(self, cfg: RLConfig):
        from ddrl.objectives import compute_advantages  # noqa: F401  (fail early if missing)
        from ddrl.tasks import get_task

        self.cfg = cfg
        t = cfg.train
        self.device = pick_device(cfg.device)
        self.dist: DistInfo = init_distributed(cfg.dist.backend, self.device)
        if t.prompts_per_step % self.dist.world_size:
            raise ValueError(f"train.prompts_per_step={t.prompts_per_step} must be divisible by the number of "
                             f"processes ({self.dist.world_size}) so that every rank holds whole groups")
        self.run_dir = check_writable(cfg.output_dir)
        self.task = get_task(cfg.task.name, **task_kwargs(cfg.task))
        self.method: Method = build_method(cfg)
        self.objective, self.estimator = self.method.objective, self.method.estimator
        self.model = self._load_model()
        self.max_prompt = (self.model.max_seq_len - cfg.rollout.gen_length
                           if getattr(self.model, "max_seq_len", None) else None)
        self.pool: list[dict[str, Any]] = []
        self._pool_complete = False  # the task had fewer examples than asked: wrap around
        if not self.example(0):
            raise ValueError(f"task {self.task.name!r} returned no training examples; check task.args")
        self.ref_model = self._make_reference() if self.method.needs_ref else None
        strategy = resolve_strategy(cfg.dist.strategy, self.dist)
        self.wrapped = wrap_model(self.model, strategy, self.device)
        self.policy = ModelHandle(self.wrapped, self.model)
        self.opt = build_optimizer(self.model.parameters(), t.lr, t.weight_decay, tuple(t.betas))
        self.sched = build_scheduler(self.opt, schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                                     total_steps=t.steps * t.num_iterations * t.minibatches,
                                     min_lr_ratio=t.min_lr_ratio)
        self.step = 0  # rollout steps done (train.steps counts these)
        self.optimizer_steps = 0  # optimizer updates done: each rollout step makes up to mu x minibatches
        self.bad_steps = 0
        self.eval_history: list[dict[str, Any]] = []
        if cfg.resume:
            self._resume()
        self.logger = MetricsLogger(self.run_dir, tensorboard=t.tensorboard and self.dist.is_main, wandb=t.wandb,
                                    enabled=self.dist.is_main, resume=cfg.resume and self.step > 0)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if cfg.model.bf16_autocast else contextlib.nullcontext())
        self.needs_trajectory = self.method.needs_trajectory
        if self.dist.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
            r = cfg.rollout
            fast = r.cache != "none" or r.threshold is not None
            updates = t.num_iterations * t.minibatches
            print(f"length: train.steps={t.steps} rollout steps x {updates} optimizer steps each (num_iterations="
                  f"{t.num_iterations} x minibatches={t.minibatches}) = {t.steps * updates} optimizer steps; "
                  f"{t.prompts_per_step} prompts x {t.group_size} completions per rollout")
            print(f"rollout: {r.name} sampler, cache={r.cache}, threshold={r.threshold}, early_exit={r.early_exit} "
                  f"({'fast' if fast else 'reference'} path; rollout.cache=none rollout.threshold=null is the reference)")

    # ------------------------------------------------------------------ setup helpers
    def _load_model(self) -> Any:
        from ddrl.models import load_model

        if not self.cfg.model.path:
            raise ValueError("model.path is required for RL: point it at a pretrained model directory "
                             "(e.g. checkpoints/mini_sudoku-masked) or run `ddrl pretrain` first")
        model = load_model(self.cfg.model.path, dtype=self.cfg.model.dtype, mask_token_id=self.cfg.model.mask_token_id,
                           trust_remote_code=self.cfg.model.trust_remote_code, block_size=self.cfg.model.block_size,
                           require_tokenizer=True)
        if getattr(model, "mask_token_id", None) is None:
            raise ValueError(f"model {self.cfg.model.path!r} has no mask token; set model.mask_token_id")
        lora = self.cfg.model.lora
        if lora.rank > 0:
            from ddrl.models.lora import apply_lora

            model = apply_lora(model, lora, seed=self.cfg.seed)
        if self.cfg.model.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        if self.cfg.train.disable_dropout:
            disable_dropout(model)
        return model.to(self.device).train()

    def _make_reference(self) -> Any:
        if self.cfg.model.lora.rank > 0:
            if self.cfg.train.sync_ref_every:
                raise ValueError("train.sync_ref_every needs a separate reference copy, but with LoRA the reference is "
                                 "the policy with its adapter disabled (the base model); set train.sync_ref_every=0 "
                                 "or model.lora.rank=0")
            return None  # the reference is the policy with its adapter disabled: no second copy
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    @torch.no_grad()
    def sync_reference(self) -> None:
        """Copy the policy into the frozen reference (train.sync_ref_every): the KL then anchors to a
        recent policy instead of the initial one. Sharded (FSDP2) parameters are gathered first."""
        for ref_p, p in zip(self.ref_model.parameters(), self.model.parameters()):
            ref_p.copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.model.disable_adapter():
                yield self.policy

    # ------------------------------------------------------------------ the loop
    def run(self) -> Path:
        t, e = self.cfg.train, self.cfg.eval
        # The model before RL: its scores ride on the first logged row (every row is a training step).
        before = ({f"eval_before/{k.split('/')[1]}": v for k, v in self._evaluate(0).items()}
                  if e.before and self.step == 0 else {})
        bar = tqdm(total=t.steps, initial=self.step, desc=f"{self.cfg.method.objective} on {self.task.name}",
                   disable=not (t.progress and self.dist.is_main), dynamic_ncols=True)
        while self.step < t.steps:
            self.step += 1
            metrics = self.train_step(self.step)
            if t.sync_ref_every and self.step % t.sync_ref_every == 0 and self.ref_model is not None:
                self.sync_reference()
            logged = self.step % t.log_every == 0 or self.step == t.steps
            if logged:
                metrics, before = {**metrics, **before}, {}
            if e.every and self.step % e.every == 0 and self.step != t.steps:
                metrics.update(self._evaluate(self.step))
            if self.step == t.steps:
                metrics.update(self._evaluate(self.step))
            row = self.logger.log(self.step, metrics) if logged else metrics
            bar.update(1)
            bar.set_postfix(reward=f"{row.get('reward/mean') or 0:.3f}", step_s=f"{row.get('time/step') or 0:.1f}",
                            acc=self._last_accuracy())
            if (t.save_every and self.step % t.save_every == 0) or self.step == t.steps:
                self.save()
        bar.close()
        self.logger.close()
        if self.dist.is_main:
            plot_reward_curve(self.run_dir / "metrics.jsonl", self.run_dir / "reward_curve.png",
                              title=f"{self.cfg.method.objective} on {self.task.name}")
        return self.run_dir

    def train_step(self, step: int) -> dict[str, Any]:
        timings: dict[str, float] = {}
        clock = _Clock(timings)
        with clock("rollout"):
            batch = self.rollout(step)
        with clock("reward"):
            self.score(batch)
        with clock("advantage"):
            self.advantages(batch)
        kept = self.filter_groups(batch)
        stats: dict[str, Any] = {"update/skipped": 1.0}  # every group filtered out: nothing to learn from
        learn: list[RolloutBatch] = []
        if len(kept):
            shares = self.minibatch_shares(kept)  # one per optimizer step of an inner iteration
            counts = [self.global_counts(share) for share in shares]  # normalisers count each whole share
            learn = [self.informative_groups(share) for share in shares]
            old, ref = self.behaviour_passes(learn, step, clock)
            with clock("update"):
                stats = self.update(learn, old, ref, step, counts)
        timings["step"] = sum(timings.values())
        metrics = self._rollout_metrics(batch)
        metrics["update/rows_frac"] = sum(len(share) for share in learn) / max(len(batch), 1)
        metrics["update/groups_kept_frac"] = float(kept.reward_valid.sum()) / max(float(batch.reward_valid.sum()), 1.0)
        metrics.update(stats)
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        return reduce_mean_dict(metrics, self.dist, self.device)

    # ------------------------------------------------------------------ phases
    @torch.no_grad()
    def rollout(self, step: int) -> RolloutBatch:
        t = self.cfg.train
        G, per_rank = t.group_size, t.prompts_per_step // self.dist.world_size
        first = (step - 1) * t.prompts_per_step + self.dist.rank * per_rank  # data position = f(step)
        examples = [self.example(first + i) for i in range(per_rank)]
        prompts = [ex["prompt"] for ex in examples for _ in range(G)]
        # Padded to the widest prompt of the whole step (all ranks), so a row's tensors do not depend
        # on how the step is split over processes.
        step_prompts = [self.example((step - 1) * t.prompts_per_step + i)["prompt"]
                        for i in range(t.prompts_per_step)]
        all_ids, all_mask = encode_prompts(self.model.tokenizer, step_prompts, max_length=self.max_prompt,
                                           device=self.device)  # [N, P]
        mine = slice(self.dist.rank * per_rank, (self.dist.rank + 1) * per_rank)
        prompt_ids, prompt_mask = all_ids[mine].repeat_interleave(G, 0), all_mask[mine].repeat_interleave(G, 0)
        # One sampler call per prompt group, with the group's own generator and unpadded prompt: a
        # group's completions depend on (seed, step, group's data position) only, not on the other
        # groups nor on the number of processes (1 process and N processes draw the same rollouts).
        sampler, outs = SAMPLERS.get(self.cfg.rollout.name), []
        self.model.eval()
        with self.autocast, gathered_parameters(self.model):
            for i in range(per_rank):
                rows, real = slice(i * G, (i + 1) * G), all_mask[mine][i]
                g = make_generator(derive_seed(self.cfg.seed, "rollout", step, first + i))
                outs.append(sampler(self.model, prompt_ids[rows][:, real], prompt_mask[rows][:, real],
                                    self.cfg.rollout, generator=g, return_trajectory=self.needs_trajectory))
        self.model.train()
        out = SampleOutput(completion_ids=torch.cat([o.completion_ids for o in outs]), nfe=sum(o.nfe for o in outs),
                           trajectory=concat_trajectories([o.trajectory for o in outs]))
        stop_ids = model_stop_ids(self.model)  # EOS and any end-of-turn id (a chat checkpoint's <|im_end|>)
        completions = decode_completions(self.model.tokenizer, out.completion_ids, stop_ids)
        K = t.num_iterations
        seeds = torch.tensor([derive_seed(self.cfg.seed, "mask", step, k) % 2**62 for k in range(K)])
        B = len(prompts)
        batch = RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out.completion_ids,
            completion_mask=completion_mask(out.completion_ids, stop_ids),
            group_ids=torch.arange(per_rank, device=self.device).repeat_interleave(G),
            rewards=torch.zeros(B, device=self.device), advantages=torch.zeros(B, device=self.device),
            mask_seeds=seeds, completions=completions, trajectory=out.trajectory,
        )
        batch.extras["examples"] = [ex for ex in examples for _ in range(G)]
        batch.extras["nfe"] = out.nfe
        batch.extras["forward_tokens"] = sum(o.forward_tokens or 0 for o in outs)  # rows x tokens fed (cost)
        return batch

    def score(self, batch: RolloutBatch) -> None:
        examples = batch.extras.pop("examples")
        columns = {c: [ex.get(c) for ex in examples] for c in examples[0] if c != "prompt"}
        rewards = self.task.reward(batch.completions, **columns)
        values = [float("nan") if r is None else float(r) for r in rewards]
        batch.rewards = torch.tensor(values, dtype=torch.float32, device=self.device)
        truncated = self.cfg.train.truncated_reward
        if truncated is not None:  # no stop token within gen_length: the answer was cut off
            cut = ~is_stop(batch.completion_ids, model_stop_ids(self.model)).any(dim=1)  # [B]
            margin = self.cfg.train.truncation_margin
            if margin > 0:  # dLLM-RL: length >= max_gen_length - 5 counts as cut off
                cut |= batch.completion_mask.sum(dim=1) >= batch.completion_ids.shape[1] - margin
            batch.rewards[cut] = float(truncated)
        invalid = ~torch.isfinite(batch.rewards)
        # "drop": excluded from the group, no loss; "zero": a reward of 0 like any other (d1, wd1)
        batch.rewards[invalid] = 0.0 if self.method.advantage.invalid == "zero" else float("nan")
        parts = getattr(self.task, "reward_parts", None) or getattr(getattr(self.task, "reward", None), "last_parts", None)
        if isinstance(parts, dict):
            batch.extras["reward_parts"] = {k: _nanmean(v) for k, v in parts.items()}

    def advantages(self, batch: RolloutBatch) -> None:
        from ddrl.objectives import compute_advantages

        a = self.method.advantage
        batch.advantages = compute_advantages(batch.rewards, batch.group_ids, a.kind, std=a.std, eps=a.eps,
                                              clip=a.clip)
        self.method.prepare(batch)  # per-rollout inputs of the loss (DACA's token weights)

    @torch.no_grad()
    def behaviour_passes(self, shares: list[RolloutBatch], step: int, clock: "_Clock") -> tuple[list, list]:
        """old[k][m][j] / ref[k][m][j]: proxies of micro-batch j of minibatch m for inner iteration k,
        without grad. They run in the mode the current pass runs in (train), so that with dropout
        disabled (the default) the ratio is exactly 1 before the first update, and with dropout on
        every pass samples its own dropout masks, as d1 and TRL do."""
        t = self.cfg.train
        K = t.num_iterations
        old: list[list[list[EstimatorOutput | None]]] = [
            [[None] * len(self.micro_batches(share)) for share in shares] for _ in range(K)]
        ref = [[list(micro) for micro in row] for row in old]
        # One update on the rollout with shared masks: old = sg(current), no pass needed.
        single_update = K == 1 and t.minibatches == 1 and not self.method.fresh_masks
        if self.method.needs_old and not single_update:
            with clock("old"), self.autocast:
                for k, m, j, mb in self._passes(shares):
                    old[k][m][j] = self.estimator(self.policy, mb, self._seed(mb, step, k, "old")).detach()
        if self.method.needs_ref:
            with clock("ref"), self.autocast, self.reference() as ref_model:
                for k, m, j, mb in self._passes(shares):
                    ref[k][m][j] = self.estimator(ref_model, mb, self._seed(mb, step, k, "ref")).detach()
        return old, ref

    def global_counts(self, batch: RolloutBatch) -> "AggregationCounts":
        """Loss normalisers of the whole step: valid tokens, rows and groups over all processes."""
        from ddrl.objectives import AggregationCounts

        # micro-batches are counted before uninformative groups are skipped: d1's per-micro-batch mean
        # (aggregation "micro_batch_token_mean") averages over all of them, zero-gradient ones included
        local = AggregationCounts.from_batch(batch, self.dist.world_size,  # rows with a valid reward
                                             micro_batches=len(self.micro_batches(batch)))
        rows = self.method.count_rows(batch)  # TraceRL: one training row per trace state
        totals = all_reduce_sum(torch.tensor([local.tokens, local.sequences, local.groups or 0.0, local.micro_batches,
                                              rows or 0.0], dtype=torch.float64, device=self.device), self.dist).tolist()
        return AggregationCounts(tokens=totals[0], sequences=totals[1], world_size=self.dist.world_size,
                                 groups=totals[2], micro_batches=totals[3], rows=None if rows is None else totals[4])

    def filter_groups(self, batch: RolloutBatch) -> RolloutBatch:
        """The groups train.group_filter keeps: mean valid reward within [lo, hi] (all when unset).
        A group left out is not trained on and not counted, as in dLLM-RL's data filter. With one
        process its rows are dropped; with several they stay as rows without a valid reward (no loss,
        not counted), so that every rank runs the same passes and collectives."""
        from ddrl.objectives.advantages import groups_in_band

        bounds = self.cfg.train.group_filter
        if bounds is None:
            return batch
        keep = groups_in_band(batch.rewards, batch.group_ids, bounds[0], bounds[1])
        if self.dist.world_size == 1:
            return batch.index(keep.nonzero().squeeze(1))
        out = batch.index(torch.arange(len(batch), device=keep.device))  # a copy: metrics keep the rewards
        out.rewards = torch.where(keep, out.rewards, torch.full_like(out.rewards, float("nan")))
        out.advantages = torch.where(keep, out.advantages, torch.zeros_like(out.advantages))
        return out

    def informative_groups(self, batch: RolloutBatch) -> RolloutBatch:
        """The groups that carry a gradient: those with a non-zero advantage, when every loss term of
        the method is multiplied by A (no KL, no regulariser). With binary rewards most groups are
        all-right or all-wrong, so this removes most of the old/ref/update compute. The losses are
        still divided by the whole step's counts, so the gradient is the one the full batch gives
        (exactly, for estimators without random masks; in distribution otherwise, since a row's
        masks depend on its place in the batch). At least one group is kept: a step whose gradient
        is zero still steps the optimizer, as it would have on the full batch. One process only:
        with DDP every rank must run the same number of backward passes."""
        if not self.cfg.train.skip_uninformative or self.dist.world_size > 1 or not self.method.skip_safe:
            return batch
        groups = batch.group_ids
        n_groups = int(groups.max()) + 1
        signal = torch.zeros(n_groups, device=groups.device).index_add(0, groups, (batch.advantages != 0).float())
        keep = signal[groups] > 0  # [B]
        if not keep.any():
            keep = groups == groups[0]
        if keep.all():
            return batch
        return batch.index(keep.nonzero().squeeze(1))

    def update(self, shares: list[RolloutBatch], old: list, ref: list, step: int,
               counts: list["AggregationCounts"]) -> dict[str, Any]:
        """mu inner iterations; in each, one optimizer step per minibatch share, its loss normalised
        by that share's global counts (a share is the whole step when train.minibatches = 1)."""
        t = self.cfg.train
        n_updates = t.num_iterations * len(shares)
        sums: dict[str, float] = {}
        for k in range(t.num_iterations):
            for m, share in enumerate(shares):
                self.opt.zero_grad(set_to_none=True)
                total = 0.0
                micro = self.micro_batches(share, k)
                for j, mb in enumerate(micro):
                    with self.autocast:
                        new = self.estimator(self.policy, mb, self._seed(mb, step, k, "cur"))
                        o = old[k][m][j] if old[k][m][j] is not None else (
                            new.detach() if self.objective.needs_old else None)
                        out = self.method.loss(mb, new, o, ref[k][m][j], counts[m])
                    with gradient_sync(self.wrapped, enabled=j == len(micro) - 1):  # one all-reduce a step
                        (out.loss * self.dist.world_size).backward()  # DDP averages; we want the global sum
                    total += out.loss.detach().item()
                    for name, v in out.stats.items():
                        sums[name] = sums.get(name, 0.0) + float(v) / (n_updates * len(micro))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm or float("inf"))
                if not (math.isfinite(total) and torch.isfinite(grad_norm)):
                    self.opt.zero_grad(set_to_none=True)
                    self.bad_steps += 1
                    sums["nonfinite_steps"] = sums.get("nonfinite_steps", 0.0) + 1
                    if self.bad_steps >= t.max_bad_steps:
                        raise NonFiniteError(
                            f"{self.bad_steps} optimizer steps in a row had a non-finite loss or gradient (step {step}); "
                            f"lower train.lr, raise method.estimator_args.num_mc, or lower train.max_grad_norm")
                    continue
                self.bad_steps = 0
                self.opt.step()
                self.optimizer_steps += 1
                self.sched.step()
                sums["loss"] = sums.get("loss", 0.0) + total / n_updates
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm.item() / n_updates
        sums["lr"] = self.sched.get_last_lr()[0]
        sums["optimizer_steps"] = float(self.optimizer_steps)  # cumulative: the peers' unit of run length
        return sums

    # ------------------------------------------------------------------ small helpers
    def example(self, index: int) -> dict[str, Any]:
        """Training example number `index` of the run (data position = f(step), so resume is exact).

        Examples are generated lazily in chunks: a task's train_examples(n) is a prefix of
        train_examples(m) for n < m, so growing the pool never changes an earlier example.
        """
        if self.cfg.train.prompt_pool:
            index %= self.cfg.train.prompt_pool
        if index >= len(self.pool) and not self._pool_complete:
            want = (index // 256 + 1) * 256
            self.pool = self.task.train_examples(n=want, seed=self.cfg.seed)
            self._pool_complete = len(self.pool) < want
        if not self.pool:
            return {}
        return self.pool[index % len(self.pool)]


    def _seed(self, batch: RolloutBatch, step: int, k: int, role: str) -> int:
        """Shared masks: the batch's seed for iteration k (iteration 0's when the method reuses masks)
        for old/ref/current. Fresh masks: a new seed per pass role."""
        if self.method.fresh_masks:
            return derive_seed(self.cfg.seed, "fresh", step, k, role, self.dist.rank) % 2**62
        return int(batch.mask_seeds[self.method.mask_seed_iteration(k)])

    def minibatch_shares(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """train.minibatches consecutive shares of whole groups, one optimizer step each."""
        n = self.cfg.train.minibatches
        if n == 1:
            return [batch]
        G = self.cfg.train.group_size
        groups = len(batch) // G  # whole groups, in order (a filter may have left gaps in their ids)
        bounds = [round(i * groups / n) for i in range(n + 1)]
        return [batch.index(slice(lo * G, hi * G)) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]

    def _passes(self, shares: list[RolloutBatch]) -> Iterator[tuple[int, int, int, RolloutBatch]]:
        """(k, m, j, micro-batch) of every inner iteration k, share m and micro-batch j."""
        for k in range(self.cfg.train.num_iterations):
            for m, share in enumerate(shares):
                for j, mb in enumerate(self.micro_batches(share, k)):
                    yield k, m, j, mb

    def micro_batches(self, batch: RolloutBatch, k: int = 0) -> list[RolloutBatch]:
        """Slices of whole groups (group-level normalisations need the full group)."""
        t = self.cfg.train
        size = t.micro_batch_size or len(batch)
        rows = max(1, size // t.group_size) * t.group_size
        out = []
        for lo in range(0, len(batch), rows):
            mb = batch.index(slice(lo, lo + rows))
            mb.extras["inner_iteration"] = k
            out.append(mb)
        return out

    def _rollout_metrics(self, batch: RolloutBatch) -> dict[str, Any]:
        r = batch.rewards
        valid = torch.isfinite(r)
        rv = r[valid]
        m: dict[str, Any] = {
            "reward/mean": rv.mean().item() if rv.numel() else float("nan"),
            "reward/std": rv.std().item() if rv.numel() > 1 else 0.0,
            "reward/invalid_frac": 1 - valid.float().mean().item(),
            "completion/length": batch.completion_mask.float().sum(1).mean().item(),
            "rollout/model_calls": float(batch.extras.get("nfe", 0)),
            "rollout/forward_tokens": float(batch.extras.get("forward_tokens") or 0),
            "advantage/abs_mean": batch.advantages.abs().mean().item(),
        }
        for name, v in batch.extras.get("reward_parts", {}).items():
            m[f"reward/{name}"] = v
        return m

    def _evaluate(self, step: int) -> dict[str, Any]:
        from ddrl.eval import evaluate

        e = self.cfg.eval
        if e.n <= 0:
            return {}
        sampler = SamplerConfig(**{**vars(self.cfg.rollout), "temperature": e.temperature,
                                   "steps": e.steps or self.cfg.rollout.steps})
        samples_path = self.run_dir / "eval" / f"step-{step}.jsonl" if self.dist.is_main else None
        with gathered_parameters(self.model):  # FSDP2: ranks make different numbers of model calls
            result = evaluate(self.model, self.task, n=e.n, sampler=sampler, seed=self.cfg.seed,
                              output_jsonl=samples_path, split=e.split)
        self.eval_history.append({"step": step, **{k: result[k] for k in ("accuracy", "mean_reward")}})
        if self.dist.is_main and samples_path is not None and e.samples_to_log:
            lines = samples_path.read_text().splitlines()[: e.samples_to_log]
            with (self.run_dir / "samples.jsonl").open("a") as f:
                for line in lines:
                    f.write(f'{{"step": {step}, "sample": {line}}}\n')
        return {"eval/accuracy": result["accuracy"], "eval/mean_reward": result["mean_reward"]}

    def _last_accuracy(self) -> str:
        return f"{self.eval_history[-1]['accuracy']:.2f}" if self.eval_history else "-"

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        model_state, optimizer_state = gather_full_state(self.model, self.opt)  # collective under FSDP2
        if not self.dist.is_main:
            return
        state = {"step": self.step, "optimizer_steps": self.optimizer_steps, "optimizer": optimizer_state,
                 "scheduler": self.sched.state_dict(),
                 "bad_steps": self.bad_steps, "eval_history": self.eval_history, "data_position": self.step}
        ckpt.save_checkpoint(self.run_dir, self.step, GatheredModel(self.model, model_state), state,
                             keep=self.cfg.train.keep_checkpoints)

    def _resume(self) -> None:
        from ddrl.models import load_model

        last = ckpt.latest_checkpoint(self.run_dir)
        if last is None:
            return  # nothing to resume: start fresh
        state = ckpt.load_trainer_state(last)
        loaded = load_model(last, trust_remote_code=self.cfg.model.trust_remote_code)
        load_full_state(self.model, self.opt, loaded.state_dict(), state["optimizer"])  # any strategy
        self.sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.bad_steps = int(state.get("bad_steps", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.eval_history = list(state.get("eval_history", []))


# Attention layers apply dropout functionally (scaled_dot_product_attention's dropout_p) from a float
# attribute; these are the names the native families and the built-in Denoiser use.
_FUNCTIONAL_DROPOUT = ("attention_dropout", "dropout", "attn_dropout")


def disable_dropout(model: torch.nn.Module) -> None:
    """p = 0 in every dropout layer (LoRA's included) and every functional attention dropout, so the
    RL passes compute a deterministic function. Eval mode would do it too, but it would also switch
    off per-layer activation checkpointing, which keys on `training`."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name in _FUNCTIONAL_DROPOUT:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


class _Clock:
    """`with clock("rollout"):` adds the block's wall time to timings["rollout"]."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


def concat_trajectories(parts: list[Trajectory | None]) -> Trajectory | None:
    """Stack the trajectories of several sampler calls along the batch. Calls that stopped early
    (early exit, threshold decoding) have fewer steps S: their last step is repeated, which is what
    a batched call records for a row whose positions are all committed."""
    if not parts or parts[0] is None:
        return None
    S = max(p.token_probs.shape[1] for p in parts)

    def pad_steps(x: torch.Tensor | None) -> torch.Tensor | None:  # [b, s, L] -> [b, S, L]
        return None if x is None else torch.cat([x, x[:, -1:].expand(-1, S - x.shape[1], -1)], dim=1)

    longest = max(parts, key=lambda p: p.token_probs.shape[1])
    states = [pad_steps(p.states) for p in parts]
    return Trajectory(commit_step=torch.cat([p.commit_step for p in parts]),
                      token_probs=torch.cat([pad_steps(p.token_probs) for p in parts]),
                      states=None if states[0] is None else torch.cat(states), step_times=longest.step_times)


def _nanmean(values: list[Any]) -> float:
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(xs) / len(xs) if xs else float("nan")


def train(config: str | Path | dict | RLConfig, overrides: list[str] | None = None) -> Path:
    """Run RL fine-tuning from a config file (plus dotted overrides); returns the run directory."""
    cfg = config if isinstance(config, RLConfig) else load_config(config, overrides, RLConfig)
    return Trainer(cfg).run()
