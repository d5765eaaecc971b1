"""`ddrl train CONFIG`: RL fine-tuning of a diffusion model, one readable loop.

Each step, in named and timed phases:

    rollout    G completions for each prompt: one sampler call for all of a rank's groups (or rollout.batch_rows
               rows a call), each group drawing from its own generator (any registered sampler)
    reward     the task's reward; None/NaN rewards are excluded from their group
    advantage  group advantages (mean / z-score / leave-one-out, optional clip)
    old, ref   likelihood proxies without grad, only when the objective declares it needs them
    update     mu inner iterations on the same rollouts, each over `minibatches` shares of the groups,
               each share: estimate -> loss -> backward (micro-batches) -> clip -> step

What the method needs (old / reference passes, trajectories, advantages, mask seeds) is read from
one typed `Method` (ddrl.training.method), built once from the config.

Every random draw derives from (seed, step, ...) so a resumed run replays the draws of an
uninterrupted one. Mask seeds live on the batch: old, ref and current passes of inner iteration k
share seed k unless the method asks for fresh masks (StableDRL).

Several processes: minibatch shares are cut from the step's global groups (a share's groups may sit
on several ranks), so the optimizer steps do not depend on the number of processes. Every rank
drops the groups it does not learn from (train.group_filter,
train.skip_uninformative), then pads each optimizer step with zero-weight micro-batches to the
largest count of any rank, so that all ranks run the same passes and collectives; the loss
normalisers are the step's global counts, so the gradient is the 1-process one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from tqdm.auto import tqdm

from ddrl.config import RLConfig, SamplerConfig, load_config, save_config, task_kwargs
from ddrl.data import (completion_mask, is_stop, model_stop_ids, pad_prompts, prompt_budget, task_completions,
                       tokenize_prompts, truncate_prompts)
from ddrl.models.moe_balance import RouterBalance
from ddrl.processes.draws import RowGenerators
from ddrl.registry import SAMPLERS
from ddrl.sampling.base import sample_in_chunks
from ddrl.sampling.checks import check_sampler, resolve_sampler, speed_settings
from ddrl.training import checkpoint as ckpt
from ddrl.training.common import (Clock, build_optimizer, build_scheduler, check_writable, derive_seed,
                                  disable_dropout, make_generator, nanmean, pick_device)
from ddrl.training.distributed import (DistInfo, ModelHandle, all_reduce_max, all_reduce_sum, check_whole_groups,
                                       compute_context, copy_parameters, device_memory, gathered_parameters,
                                       gradient_sync, init_distributed, reduce_mean_dict, reshard, resolve_strategy, shard_model,
                                       wrap_model, zero_loss)
from ddrl.training.logging import MetricsLogger, plot_reward_curve
from ddrl.training.memory import check_memory
from ddrl.training.method import Method, build_method
from ddrl.training.preemption import PreemptionGuard
from ddrl.types import EstimatorOutput, RolloutBatch

log = logging.getLogger(__name__)

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
        self.dist: DistInfo = init_distributed(cfg.dist.backend, self.device, timeout_s=cfg.dist.timeout,
                                               one_rank_group=cfg.dist.cpu_offload)
        check_whole_groups(t.prompts_per_step, self.dist.world_size)  # before the data and the model
        self.run_dir = check_writable(cfg.output_dir)
        self.task = get_task(cfg.task.name, **task_kwargs(cfg.task))
        self.method: Method = build_method(cfg)
        self.objective, self.estimator = self.method.objective, self.method.estimator
        self.strategy = resolve_strategy(cfg.dist.strategy, self.dist)
        self.pool: list[dict[str, Any]] = []
        self._pool_complete = False  # the task had fewer examples than asked: wrap around
        if not self.example(0):  # the data is read and checked before the model is loaded
            raise ValueError(f"task {self.task.name!r} returned no training examples; check task.args")
        self.model = self._load_model()  # on the CPU until the memory check passed
        self._resolve_sampler()
        self.max_prompt = prompt_budget(self.model, cfg.rollout)
        self.truncated_prompts = 0  # prompts cut to rollout.max_prompt_length so far (announced once)
        self.ref_model = self._make_reference() if self.method.needs_ref else None
        self.wrapped = self._place_models(cfg.model.mixed_precision)
        self.policy = ModelHandle(self.wrapped, self.model)
        # the routers' balance loss, recorded around each micro-batch's loss forwards (method.moe_aux_loss_coef)
        self.balance = RouterBalance(self.model) if self.method.moe_aux_loss_coef else contextlib.nullcontext()
        self.autocast = compute_context(self.device, cfg.model.mixed_precision, self.strategy)
        sharded = t.sharded_checkpoints
        self.sharded_checkpoints = self.strategy == "fsdp" if sharded == "auto" else bool(sharded)
        self.opt = build_optimizer(self.model.parameters(), t.lr, t.weight_decay, tuple(t.betas))
        self.sched = build_scheduler(self.opt, schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                                     total_steps=t.steps * t.num_iterations * t.minibatches,
                                     min_lr_ratio=t.min_lr_ratio)
        self.step = 0  # rollout steps done (train.steps counts these)
        self.optimizer_steps = 0  # optimizer updates done: each rollout step makes up to mu x minibatches
        self.bad_steps = 0
        self.steps_without_update = 0  # rollout steps whose groups train.group_filter dropped, all of them
        self.eval_history: list[dict[str, Any]] = []  # eval.split's scores, for choices
        self.report: dict[str, dict[str, Any]] = {}  # eval.report_split's, before and after: for reporting
        self.eval_split = self._resolve_eval_split()
        if cfg.resume:
            self._resume()
        self.logger = MetricsLogger(self.run_dir, tensorboard=t.tensorboard and self.dist.is_main, wandb=t.wandb,
                                    enabled=self.dist.is_main, resume=cfg.resume and self.step > 0)
        self.needs_trajectory = self.method.needs_trajectory
        if self.dist.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
            r = cfg.rollout
            fast = speed_settings(r)
            updates = t.num_iterations * t.minibatches
            print(f"length: train.steps={t.steps} rollout steps x {updates} optimizer steps each (num_iterations="
                  f"{t.num_iterations} x minibatches={t.minibatches}) = {t.steps * updates} optimizer steps; "
                  f"{t.prompts_per_step} prompts x {t.group_size} completions per rollout")
            print(f"rollout: {r.name} sampler, cache={r.cache}, threshold={r.threshold}, early_exit={r.early_exit} "
                  f"({'fast path: ' + ', '.join(fast) if fast else 'reference path'}; rollout.cache=none "
                  f"rollout.threshold=null rollout.factor=null is the reference)")

    # ------------------------------------------------------------------ setup helpers
    def _resolve_sampler(self) -> None:
        """rollout.name=auto becomes the model's own sampler (config.yaml records which); an explicit
        one the model cannot run, or settings it refuses, fail here, before any compute."""
        r = self.cfg.rollout
        r.name = resolve_sampler(self.model, r.name, "rollout")
        check_sampler(r, "rollout", block_size=getattr(self.model, "block_size", None) or None)

    def _load_model(self) -> Any:
        from ddrl.models import load_model

        if not self.cfg.model.path:
            raise ValueError("model.path is required for RL: point it at a pretrained model directory "
                             "(e.g. checkpoints/mini_sudoku-masked) or run `ddrl pretrain` first")
        m = self.cfg.model
        kwargs = dict(dtype=m.dtype, mask_token_id=m.mask_token_id, trust_remote_code=m.trust_remote_code,
                      block_size=m.block_size, require_tokenizer=True)
        if m.vq_path is not None:  # only image families take it (load_model says which)
            kwargs["vq_path"] = m.vq_path
        if m.t2i_attend_padding is not None:  # a text-to-image MMaDA only (load_model refuses it elsewhere)
            kwargs["t2i_attend_padding"] = m.t2i_attend_padding
        if self._rank0_loading:  # weights read once, on rank 0; the other ranks build on the meta device
            model = ckpt.load_model_on_rank0(m.path, self.dist, **kwargs)
        else:
            model = load_model(m.path, **kwargs)
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
        return model

    @property
    def _rank0_loading(self) -> bool:
        """Sharded runs read the checkpoint on rank 0 only (N ranks x 16 GB of host memory at 8B otherwise).
        Not with dist.cpu_offload: each rank reads it, and its shards stay in host memory."""
        return self.strategy == "fsdp" and self.dist.enabled and not self.cfg.dist.cpu_offload

    def _place_models(self, precision: str) -> torch.nn.Module:
        """Policy (and reference) onto the device, wrapped or sharded; returns the wrapped policy.
        First the memory check: a model whose training state cannot fit the device under this
        strategy is refused before any of it is moved. Under FSDP the reference is sharded like the
        policy: 1/N of a copy per rank."""
        check_memory(self.cfg, self.model, self.dist.world_size, device_memory(self.device),
                     reference_copy=self.ref_model is not None, strategy=self.strategy)
        if self._rank0_loading:  # rank 0's weights go straight into every rank's shards
            ref_full = self.ref_model.state_dict() if self.ref_model is not None and self.dist.is_main else {}
            wrapped = ckpt.wrap_from_rank0(self.model, "fsdp", self.device, self.dist, mixed_precision=precision)
            self.model.train()
            if self.ref_model is not None:
                shard_model(self.ref_model, self.device, precision)
                ckpt.broadcast_to_shards(self.ref_model, ref_full, self.device)
            return wrapped
        offload = self.cfg.dist.cpu_offload  # the shards stay in host memory: shard on the CPU
        self.model.to("cpu" if offload else self.device).train()
        wrapped = wrap_model(self.model, self.strategy, self.device, precision, cpu_offload=offload)
        if self.ref_model is not None:
            self.ref_model.to("cpu" if offload else self.device)
            if self.strategy == "fsdp":
                shard_model(self.ref_model, self.device, precision, cpu_offload=offload)
        return wrapped

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
        recent policy instead of the initial one. Under FSDP2 both are sharded alike: shard to shard."""
        copy_parameters(self.ref_model, self.model)

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        if self.ref_model is not None:
            try:
                yield self.ref_model
            finally:
                reshard(self.ref_model)  # FSDP2 keeps a root's parameters gathered after a forward without backward
        else:
            with self.model.disable_adapter():
                yield self.policy

    # ------------------------------------------------------------------ the loop
    def run(self) -> Path:
        t, e = self.cfg.train, self.cfg.eval
        # The model before RL: its scores ride on the first logged row (every row is a training step).
        before: dict[str, Any] = {}
        if e.before and self.step == 0:
            before = {f"eval_before/{k.split('/')[1]}": v for k, v in self._evaluate(0).items()}
            before.update({f"report_before/{k.split('/')[1]}": v for k, v in self._report(0).items()})
        bar = tqdm(total=t.steps, initial=self.step, desc=f"{self.cfg.method.objective} on {self.task.name}",
                   disable=not (t.progress and self.dist.is_main), dynamic_ncols=True)
        with PreemptionGuard() as preemption:  # SIGTERM: finish the step, checkpoint, exit 0
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
                    metrics.update(self._report(self.step))
                row = self.logger.log(self.step, metrics) if logged else metrics
                bar.update(1)
                bar.set_postfix(reward=f"{row.get('reward/mean') or 0:.3f}", step_s=f"{row.get('time/step') or 0:.1f}",
                                acc=self._last_accuracy())
                stop = preemption.requested(self.dist, self.device)  # every rank stops after the same step
                if (t.save_every and self.step % t.save_every == 0) or self.step == t.steps or stop:
                    self.save()
                if stop and self.step < t.steps:
                    if self.dist.is_main:
                        print(f"preempted (SIGTERM) after step {self.step}: checkpoint-{self.step} written; "
                              f"resume=true continues from it", flush=True)
                    break
        bar.close()
        self.logger.close()
        if self.dist.is_main:
            plot_reward_curve(self.run_dir / "metrics.jsonl", self.run_dir / "reward_curve.png",
                              title=f"{self.cfg.method.objective} on {self.task.name}")
        return self.run_dir

    def train_step(self, step: int) -> dict[str, Any]:
        timings: dict[str, float] = {}
        clock = Clock(timings)
        with clock("rollout"):
            batch = self.rollout(step)
        with clock("reward"):
            self.score(batch)
        with clock("advantage"):
            self.advantages(batch)
        kept = self.filter_groups(batch)
        plan = self.plan_update(batch, kept)
        stats: dict[str, Any] = {"update/skipped": 1.0}  # every group filtered out: nothing to learn from
        if plan is None:
            self._report_no_update(step)
        else:
            old, ref = self.behaviour_passes(plan.micro, step, clock)
            with clock("update"):
                stats = self.update(plan.micro, old, ref, step, plan.counts)
        timings["step"] = sum(timings.values())
        metrics = self._rollout_metrics(batch)
        learned = 0 if plan is None else plan.rows
        metrics["update/rows_frac"] = learned / max(len(batch), 1)
        metrics["update/groups_kept_frac"] = kept.reward_valid.sum() / batch.reward_valid.sum().clamp(min=1)
        metrics.update(stats)
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        return reduce_mean_dict(metrics, self.dist, self.device)  # the step's one host transfer of metrics

    # ------------------------------------------------------------------ phases
    @torch.no_grad()
    def rollout(self, step: int) -> RolloutBatch:
        t = self.cfg.train
        G, per_rank = t.group_size, t.prompts_per_step // self.dist.world_size
        first = (step - 1) * t.prompts_per_step + self.dist.rank * per_rank  # data position = f(step)
        examples = [self.example(first + i) for i in range(per_rank)]
        # Padded to the widest prompt of the whole step (all ranks), so a row's tensors do not depend
        # on how the step is split over processes.
        step_prompts = [self.example((step - 1) * t.prompts_per_step + i)["prompt"]
                        for i in range(t.prompts_per_step)]
        tokenizer = self.model.tokenizer
        rows, truncated = truncate_prompts(tokenize_prompts(tokenizer, step_prompts), self.cfg.rollout.max_prompt_length)
        self._announce_truncation(truncated, len(rows))
        all_ids, all_mask = pad_prompts(rows, tokenizer.pad_token_id, max_length=self.max_prompt,
                                        device=self.device)  # [N, P]: the prompts the likelihood passes score too
        mine = slice(self.dist.rank * per_rank, (self.dist.rank + 1) * per_rank)
        prompt_ids, prompt_mask = all_ids[mine].repeat_interleave(G, 0), all_mask[mine].repeat_interleave(G, 0)
        # One sampler call for all of this rank's groups (or calls of rollout.batch_rows rows). Each group draws
        # from its own generator, on the model's device, seeded by (seed, step, the group's data position): its
        # completions are those of a call on that group alone, so 1 process and N processes draw the same rollouts.
        generators = RowGenerators([make_generator(derive_seed(self.cfg.seed, "rollout", step, first + i), self.device)
                                    for i in range(per_rank)], rows_per_generator=G)
        self.model.eval()
        with self.autocast, gathered_parameters(self.model):
            out = sample_in_chunks(SAMPLERS.get(self.cfg.rollout.name), self.model, prompt_ids, prompt_mask,
                                   self.cfg.rollout, generator=generators, return_trajectory=self.needs_trajectory)
        self.model.train()
        stop_ids = model_stop_ids(self.model)  # EOS and any end-of-turn id (a chat checkpoint's <|im_end|>)
        completions = task_completions(self.model, self.task, out.completion_ids)  # texts, or decoded images
        K = t.num_iterations
        seeds = torch.tensor([derive_seed(self.cfg.seed, "mask", step, k) % 2**62 for k in range(K)])
        B = len(prompt_ids)
        batch = RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out.completion_ids,
            completion_mask=completion_mask(out.completion_ids, stop_ids),
            group_ids=torch.arange(per_rank, device=self.device).repeat_interleave(G),
            rewards=torch.zeros(B, device=self.device), advantages=torch.zeros(B, device=self.device),
            mask_seeds=seeds, completions=completions.texts, trajectory=out.trajectory,
        )
        batch.extras["examples"] = [ex for ex in examples for _ in range(G)]
        batch.extras["reward_inputs"] = completions.reward_inputs()  # images=[B, 3, H, W] for image tasks
        batch.extras["nfe"] = out.nfe
        batch.extras["truncated_prompts"] = truncated
        batch.extras["forward_tokens"] = out.forward_tokens or 0  # rows x tokens fed (cost)
        return batch

    def score(self, batch: RolloutBatch) -> None:
        examples = batch.extras.pop("examples")
        columns = {c: [ex.get(c) for ex in examples] for c in examples[0] if c != "prompt"}
        rewards = self.task.reward(batch.completions, **columns, **batch.extras.pop("reward_inputs", {}))
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
            batch.extras["reward_parts"] = {k: nanmean(v) for k, v in parts.items()}

    def advantages(self, batch: RolloutBatch) -> None:
        from ddrl.objectives import compute_advantages

        a = self.method.advantage
        batch.advantages = compute_advantages(batch.rewards, batch.group_ids, a.kind, std=a.std, eps=a.eps,
                                              clip=a.clip)
        self.method.prepare(batch)  # per-rollout inputs of the loss (DACA's token weights)

    @torch.no_grad()
    def behaviour_passes(self, micro: list[list[RolloutBatch]], step: int, clock: Clock) -> tuple[list, list]:
        """old[k][m][j] / ref[k][m][j]: proxies of micro-batch j of minibatch m for inner iteration k,
        without grad. They run in the mode the current pass runs in (train), so that with dropout
        disabled (the default) the ratio is exactly 1 before the first update, and with dropout on
        every pass samples its own dropout masks, as d1 and TRL do. Padding micro-batches run too:
        under FSDP every forward is a collective."""
        K = self.cfg.train.num_iterations
        old: list[list[list[EstimatorOutput | None]]] = [[[None] * len(share) for share in micro] for _ in range(K)]
        ref = [[list(share) for share in row] for row in old]
        if self.method.needs_old:
            with clock("old"), self.autocast:
                for k, m, j, mb in self._passes(micro):
                    if self._old_pass_needed(k, m):
                        old[k][m][j] = self._estimate(self.policy, mb, step, k, "old").detach()
        if self.method.needs_ref:
            with clock("ref"), self.autocast, self.reference() as ref_model:
                for k, m, j, mb in self._passes(micro):
                    ref[k][m][j] = self._estimate(ref_model, mb, step, k, "ref").detach()
        return old, ref

    def _old_pass_needed(self, k: int, m: int) -> bool:
        """The first optimizer step (k = 0, share 0) runs on the rollout policy itself: with shared
        masks and no dropout its old pass IS its current pass, so old = sg(current) and no pass is
        made. So too with one update per rollout (TRL/d1's num_iterations = 1), dropout or not."""
        t = self.cfg.train
        if self.method.fresh_masks or (k, m) != (0, 0):
            return True
        return not (t.disable_dropout or (t.num_iterations == 1 and t.minibatches == 1))

    def _estimate(self, model: Any, mb: RolloutBatch, step: int, k: int, role: str) -> EstimatorOutput:
        mb.extras["inner_iteration"] = k  # the estimator may read which inner iteration it serves (MaskGRPO)
        return self.estimator(model, mb, self._seed(mb, step, k, role))

    def plan_update(self, batch: RolloutBatch, kept: RolloutBatch) -> "UpdatePlan | None":
        """The micro-batches of every optimizer step and their loss normalisers, or None when no rank
        has a group to learn from.

        A share's normalisers count the whole share (uninformative groups included) over all
        processes. Every rank cuts its share of the step into micro-batches, then pads them with
        zero-weight ones to the largest count of any rank (at least one, so a step whose gradient is
        zero still steps the optimizer), so all ranks run the same backward passes and collectives."""
        shares = self.minibatch_shares(kept)  # train.minibatches shares, some possibly empty
        cut = [self.micro_batches(share) for share in shares]
        local = [self._share_counts(share, len(pieces)) for share, pieces in zip(shares, cut)]
        totals = all_reduce_sum(torch.stack(local), self.dist).tolist()  # [M, 6], one collective
        informative = [self.informative_groups(share) for share in shares]
        learn = [self.micro_batches(share) for share in informative]
        widest = all_reduce_max(torch.tensor([len(pieces) for pieces in learn], device=self.device),
                                self.dist).tolist()
        from ddrl.objectives import AggregationCounts

        micro, counts, rows = [], [], 0
        for share, pieces, total, width in zip(informative, learn, totals, widest):
            size, tokens, sequences, groups, n_micro, trace_rows = total
            if size == 0:  # this share is empty on every rank
                continue
            rows += len(share)
            micro.append(pieces + [self._padding(batch)] * (max(int(width), 1) - len(pieces)))
            counts.append(AggregationCounts(tokens=tokens, sequences=sequences, world_size=self.dist.world_size,
                                            groups=groups, micro_batches=n_micro,
                                            rows=trace_rows if self.method.has_rows else None))
        return UpdatePlan(micro, counts, rows) if micro else None

    def _share_counts(self, share: RolloutBatch, n_micro: int) -> torch.Tensor:
        """[6] float64: rows, valid tokens, valid sequences, groups, micro-batches and training rows
        (TraceRL's trace states) of this rank's part of a share, to be summed over ranks."""
        if len(share) == 0:
            return torch.zeros(6, dtype=torch.float64, device=self.device)
        from ddrl.objectives import AggregationCounts

        c = AggregationCounts.from_batch(share, self.dist.world_size, micro_batches=n_micro)
        rows = self.method.count_rows(share) if self.method.has_rows else 0.0
        return torch.tensor([len(share), c.tokens, c.sequences, c.groups, c.micro_batches, rows],
                            dtype=torch.float64, device=self.device)

    def _padding(self, batch: RolloutBatch) -> RolloutBatch:
        """A zero-weight micro-batch: the rank's first micro-batch of the whole rollout, its rewards
        made valid so that it has rows to compute (TraceRL's state rows need them). Its loss is 0 x
        its log-probs: zero gradients, the same collectives as a real micro-batch."""
        full = batch.index(torch.arange(len(batch), device=batch.rewards.device))
        full.rewards = torch.zeros_like(full.rewards)
        full.advantages = torch.zeros_like(full.advantages)
        mb = self.micro_batches(full)[0]
        mb.extras["padding"] = True
        return mb

    def _report_no_update(self, step: int) -> None:
        """One line per step that learns nothing because train.group_filter dropped every group, on
        every rank's data (plan_update is None only then), with how often it happened so far."""
        self.steps_without_update += 1
        if self.dist.is_main:
            lo, hi = self.cfg.train.group_filter
            log.warning("step %d made no update: train.group_filter=[%g, %g] dropped every group (each group's "
                        "mean reward is outside the band, e.g. all completions right or all wrong); %d step(s) of "
                        "this run so far made no update. Widen train.group_filter, raise train.group_size, or "
                        "unset it", step, lo, hi, self.steps_without_update)

    def filter_groups(self, batch: RolloutBatch) -> RolloutBatch:
        """The groups train.group_filter keeps: mean valid reward within [lo, hi] (all when unset).
        A group left out is not trained on and not counted, as in dLLM-RL's data filter; each rank
        drops its own (plan_update pads the ranks left with fewer micro-batches)."""
        from ddrl.objectives.advantages import groups_in_band

        bounds = self.cfg.train.group_filter
        if bounds is None:
            return batch
        keep = groups_in_band(batch.rewards, batch.group_ids, bounds[0], bounds[1])
        return batch.index(keep.nonzero().squeeze(1))

    def informative_groups(self, batch: RolloutBatch) -> RolloutBatch:
        """The groups that carry a gradient: those with a non-zero advantage, when every loss term of
        the method is multiplied by A (no KL, no regulariser). With binary rewards most groups are
        all-right or all-wrong, so this removes most of the old/ref/update compute. The losses are
        still divided by the whole step's counts, so the gradient is the one the full batch gives
        (exactly, for estimators without random masks; in distribution otherwise, since a row's
        masks depend on its place in the batch)."""
        if not self.cfg.train.skip_uninformative or not self.method.skip_safe or len(batch) == 0:
            return batch
        groups = batch.group_ids
        n_groups = self.cfg.train.prompts_per_step // self.dist.world_size  # a rank's group ids: 0 .. n - 1
        signal = torch.zeros(n_groups, device=groups.device).index_add(0, groups, (batch.advantages != 0).float())
        keep = signal[groups] > 0  # [B]
        return batch.index(keep.nonzero().squeeze(1))

    def update(self, micro: list[list[RolloutBatch]], old: list, ref: list, step: int,
               counts: list["AggregationCounts"]) -> dict[str, Any]:
        """mu inner iterations; in each, one optimizer step per minibatch share, its loss normalised
        by that share's global counts (a share is the whole step when train.minibatches = 1). Stats
        stay tensors on the device; the one host sync of an optimizer step is the finite check."""
        t = self.cfg.train
        n_updates = t.num_iterations * len(micro)
        sums: dict[str, Any] = {}

        def add(name: str, value: Any, weight: float) -> None:
            value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
            sums[name] = sums.get(name, 0.0) + value * weight

        for k in range(t.num_iterations):
            for m, share in enumerate(micro):
                self.opt.zero_grad(set_to_none=True)
                total = torch.zeros((), device=self.device)
                real = max(1, sum(not mb.extras.get("padding") for mb in share))
                for j, mb in enumerate(share):
                    # one all-reduce a step; DDP decides in forward whether the backward syncs: both inside
                    with gradient_sync(self.wrapped, enabled=j == len(share) - 1):
                        with self.autocast, self.balance:
                            new = self._estimate(self.policy, mb, step, k, "cur")
                            if mb.extras.get("padding"):
                                loss, stats = zero_loss(new), {}
                            else:
                                o = old[k][m][j] if old[k][m][j] is not None else (
                                    new.detach() if self.objective.needs_old else None)
                                out = self.method.loss(mb, new, o, ref[k][m][j], counts[m])
                                loss, stats = out.loss, out.stats
                                if self.method.moe_aux_loss_coef:  # a mean over the step's micro-batches and ranks
                                    aux = self.balance.loss()
                                    coef = self.method.moe_aux_loss_coef / (len(share) * self.dist.world_size)
                                    loss, stats = loss + coef * aux, {**stats, "moe_aux_loss": aux}
                        (loss * self.dist.world_size).backward()  # DDP averages; we want the global sum
                    total = total + loss.detach().float()
                    for name, v in stats.items():
                        add(name, v, 1.0 / (n_updates * real))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm or float("inf"))
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                    grad_norm = grad_norm.full_tensor()
                if not bool(torch.isfinite(total) & torch.isfinite(grad_norm)):  # the step's one host sync
                    self.opt.zero_grad(set_to_none=True)
                    self.bad_steps += 1
                    add("nonfinite_steps", 1.0, 1.0)
                    if self.bad_steps >= t.max_bad_steps:
                        raise NonFiniteError(
                            f"{self.bad_steps} optimizer steps in a row had a non-finite loss or gradient (step {step}); "
                            f"lower train.lr, raise method.estimator_args.num_mc, or lower train.max_grad_norm")
                    continue
                self.bad_steps = 0
                self.opt.step()
                self.optimizer_steps += 1
                self.sched.step()
                add("loss", total, 1.0 / n_updates)
                add("grad_norm", grad_norm, 1.0 / n_updates)
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


    def _announce_truncation(self, truncated: int, prompts: int) -> None:
        """One line, the first time rollout.max_prompt_length cuts a prompt (each step's count is the
        metric rollout/truncated_prompts): a cut prompt loses its start, often the instructions."""
        if truncated and not self.truncated_prompts and self.dist.is_main:
            n = self.cfg.rollout.max_prompt_length
            print(f"rollout: {truncated} of this step's {prompts} prompts are longer than rollout.max_prompt_length="
                  f"{n} tokens and keep their last {n}, as TRL does (each step's count: rollout/truncated_prompts)")
        self.truncated_prompts += truncated

    def _seed(self, batch: RolloutBatch, step: int, k: int, role: str) -> int:
        """Shared masks: the batch's seed for iteration k (iteration 0's when the method reuses masks)
        for old/ref/current. Fresh masks: a new seed per pass role."""
        if self.method.fresh_masks:
            return derive_seed(self.cfg.seed, "fresh", step, k, role, self.dist.rank) % 2**62
        return int(batch.mask_seeds[self.method.mask_seed_iteration(k)])

    def minibatch_shares(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """train.minibatches shares of the step's GLOBAL groups, one optimizer step each: the groups
        kept on all ranks, in data order, cut into consecutive shares, and this rank's part of share m
        is its own groups among them (often none: plan_update pads it, and drops a share empty on
        every rank). So 1 process and N processes make the same optimizer steps on the same groups;
        cutting each rank's groups instead left most shares empty (4 groups per rank, 32 shares)."""
        t = self.cfg.train
        if t.minibatches == 1:
            return [batch]
        offset = self.dist.rank * (t.prompts_per_step // self.dist.world_size)  # a rank's first global group
        kept = torch.zeros(t.prompts_per_step, device=self.device)  # [N] global groups
        kept[batch.group_ids + offset] = 1.0
        kept_ids = all_reduce_sum(kept, self.dist).nonzero().squeeze(1).tolist()  # kept on any rank, in order
        bounds = [round(i * len(kept_ids) / t.minibatches) for i in range(t.minibatches + 1)]
        share_of = torch.full((t.prompts_per_step,), -1, device=self.device)  # [N] each global group's share
        for m, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            share_of[kept_ids[lo:hi]] = m
        row_share = share_of[batch.group_ids + offset]  # [B]
        return [batch.index((row_share == m).nonzero().squeeze(1)) for m in range(t.minibatches)]

    def _passes(self, micro: list[list[RolloutBatch]]) -> Iterator[tuple[int, int, int, RolloutBatch]]:
        """(k, m, j, micro-batch) of every inner iteration k, share m and micro-batch j."""
        for k in range(self.cfg.train.num_iterations):
            for m, share in enumerate(micro):
                for j, mb in enumerate(share):
                    yield k, m, j, mb

    def micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """Slices of whole groups (group-level normalisations need the full group); with
        train.micro_batch_rows, each slice cut again into the estimator's own row chunks: TraceRL's
        (sample, state) rows or UniGRPO's (sample, copy) rows, sample-major, every N rows as dLLM-RL
        does, each micro-batch with extras[estimator.row_selection] naming the rows to compute (a
        sample may span two micro-batches; its loss is per row, so nothing needs the whole group).
        A copy chunk holds its whole slice, so its masks are the uncut slice's (RandomRatio)."""
        t = self.cfg.train
        if len(batch) == 0:
            return []
        size = t.micro_batch_size or len(batch)
        rows = max(1, size // t.group_size) * t.group_size
        pieces = [batch.index(slice(lo, lo + rows)) for lo in range(0, len(batch), rows)]
        if t.micro_batch_rows:
            return [chunk for piece in pieces for chunk in self.method.row_chunks(piece, t.micro_batch_rows)]
        return pieces

    def _rollout_metrics(self, batch: RolloutBatch) -> dict[str, Any]:
        """Device tensors (and floats): reduce_mean_dict copies them to the host once per step."""
        r = batch.rewards
        valid = torch.isfinite(r)
        n_valid = valid.sum()
        mean = torch.where(valid, r, 0.0).sum() / n_valid  # NaN when no reward is valid
        var = torch.where(valid, (r - mean) ** 2, 0.0).sum() / (n_valid - 1).clamp(min=1)
        m: dict[str, Any] = {
            "reward/mean": mean,
            "reward/std": torch.where(n_valid > 1, var.sqrt(), 0.0),
            "reward/invalid_frac": 1 - valid.float().mean(),
            "completion/length": batch.completion_mask.float().sum(1).mean(),
            "rollout/model_calls": float(batch.extras.get("nfe", 0)),
            "rollout/forward_tokens": float(batch.extras.get("forward_tokens") or 0),
            "rollout/truncated_prompts": float(batch.extras.get("truncated_prompts", 0)),
            "advantage/abs_mean": batch.advantages.abs().mean(),
        }
        for name, v in batch.extras.get("reward_parts", {}).items():
            m[f"reward/{name}"] = v
        return m

    def _resolve_eval_split(self) -> str:
        """eval.split, or test with a notice when the task has no dev split (a user's task given only
        train and test lists): its periodic scores then come from the split it reports."""
        from ddrl.tasks.base import split_examples

        split = self.cfg.eval.split
        if split != "dev" or self.cfg.eval.n <= 0:
            return split
        try:
            split_examples(self.task, "dev", 1, self.cfg.seed)
        except (ValueError, NotImplementedError) as why:
            if self.dist.is_main:
                print(f"eval: {why}; evaluating on test instead (eval.split=test silences this)")
            return "test"
        return split

    def _report(self, step: int) -> dict[str, Any]:
        """The sealed split (eval.report_split), scored before and after training only: report/* and
        the dict self.report["before" | "after"] (n, accuracy, its 95% interval). Never used for a choice."""
        split = self.cfg.eval.report_split
        if split is None or self.cfg.eval.n <= 0:
            return {}
        metrics = self._evaluate(step, split=split, tag="report", n=self.cfg.eval.report_n)
        self.report["before" if step == 0 else "after"] = self._last_result
        return metrics

    def _evaluate(self, step: int, split: str | None = None, tag: str = "eval",
                  n: int | None = None) -> dict[str, Any]:
        from ddrl.eval import evaluate

        e = self.cfg.eval
        if e.n <= 0:
            return {}
        n = n or e.n
        split = split or self.eval_split
        sampler = SamplerConfig(**{**vars(self.cfg.rollout), "temperature": e.temperature,
                                   "steps": e.steps or self.cfg.rollout.steps})
        name = f"step-{step}.jsonl" if tag == "eval" else f"{tag}-step-{step}.jsonl"
        samples_path = self.run_dir / "eval" / name if self.dist.is_main else None
        with self.autocast, gathered_parameters(self.model):  # FSDP2: ranks make different numbers of calls
            # each rank evaluates its share of the examples; the results are gathered on every rank
            result = evaluate(self.model, self.task, n=n, sampler=sampler,
                              seed=self.cfg.seed if e.seed is None else e.seed,
                              output_jsonl=samples_path, split=split, shard=self.dist.enabled)
        self._last_result = {"step": step, "split": split,
                             **{k: result[k] for k in ("n", "accuracy", "accuracy_interval", "mean_reward")}}
        lo, hi = result["accuracy_interval"]  # 95% (ddrl.eval.stats.score_estimate)
        metrics = {f"{tag}/accuracy": result["accuracy"], f"{tag}/accuracy_lo": lo, f"{tag}/accuracy_hi": hi,
                   f"{tag}/mean_reward": result["mean_reward"]}
        if "breakdown" in result:  # a task's eval_breakdown (digits: per-class rate, diversity)
            self._last_result["breakdown"] = result["breakdown"]
            metrics.update({f"{tag}/{k}": v for k, v in result["breakdown"].items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if tag != "eval":
            return metrics
        self.eval_history.append(self._last_result)
        if self.dist.is_main and samples_path is not None and e.samples_to_log:
            lines = samples_path.read_text().splitlines()[: e.samples_to_log]
            with (self.run_dir / "samples.jsonl").open("a") as f:
                for line in lines:
                    f.write(f'{{"step": {step}, "sample": {line}}}\n')
        return metrics

    def _last_accuracy(self) -> str:
        return f"{self.eval_history[-1]['accuracy']:.2f}" if self.eval_history else "-"

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """A checkpoint of the step (collective: every rank calls it). Sharded under FSDP by default
        (train.sharded_checkpoints): each rank writes its own shard, nothing is gathered."""
        state = {"step": self.step, "optimizer_steps": self.optimizer_steps, "scheduler": self.sched.state_dict(),
                 "bad_steps": self.bad_steps, "eval_history": self.eval_history, "data_position": self.step}
        ckpt.save_training_checkpoint(self.run_dir, self.step, self.model, self.opt, state, dist=self.dist,
                                      sharded=self.sharded_checkpoints, keep=self.cfg.train.keep_checkpoints)

    def _resume(self) -> None:
        last = ckpt.latest_checkpoint(self.run_dir)
        if last is None:
            return  # nothing to resume: start fresh
        state = ckpt.load_training_checkpoint(last, self.model, self.opt,  # full or sharded, any strategy
                                              trust_remote_code=self.cfg.model.trust_remote_code)
        self.sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.bad_steps = int(state.get("bad_steps", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.eval_history = list(state.get("eval_history", []))


@dataclass
class UpdatePlan:
    """The update of one RL step, the same shape on every rank."""

    micro: list[list[RolloutBatch]]  # micro-batches of each optimizer-step share, padded to equal counts
    counts: list["AggregationCounts"]  # each share's loss normalisers, summed over ranks
    rows: int  # rows of this rank's real (not padding) micro-batches, for update/rows_frac


def train(config: str | Path | dict | RLConfig, overrides: list[str] | None = None) -> Path:
    """Run RL fine-tuning from a config file (plus dotted overrides); returns the run directory."""
    cfg = config if isinstance(config, RLConfig) else load_config(config, overrides, RLConfig)
    return Trainer(cfg).run()
