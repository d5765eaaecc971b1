"""`ddrl train CONFIG`: RL fine-tuning of a diffusion model, one readable loop.

Each step, in named and timed phases:

    rollout    G completions for each prompt: one sampler call for all of a rank's groups (or rollout.batch_rows
               rows a call), each group drawing from its own generator (any registered sampler)
    reward     the task's reward; None/NaN rewards are excluded from their group; a step whose rewards are
               all invalid (on every rank) makes no update, and train.max_invalid_steps of them in a row
               stop the run (a reward server that died must not train on nothing)
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
drops the groups it does not learn from (train.group_filter, train.skip_uninformative), then pads
each optimizer step with zero-weight micro-batches to the largest count of any rank, so that all
ranks run the same passes and collectives; the loss normalisers are the step's global counts, so
the gradient is the 1-process one. That plan is ddrl.training.update_plan's; the evaluations on
eval.split and eval.report_split are ddrl.training.evaluation's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from ddrl.config import RLConfig, load_config, save_config, task_kwargs
from ddrl.data import check_modality, is_stop, model_stop_ids
from ddrl.contract import model_view
from ddrl.objectives import AggregationCounts, compute_advantages
from ddrl.objectives.base import COUNTED_STATS
from ddrl.processes.draws import RowGenerators, make_generator
from ddrl.sampling.checks import check_sampler, resolve_sampler, speed_settings
from ddrl.sampling.engine import RolloutEngine
from ddrl.training import checkpoint as ckpt
from ddrl.training.common import (Clock, build_optimizer, build_scheduler, derive_seed, disable_dropout,
                                  finite_sum_count, pick_device)
from ddrl.training.distributed import (DistInfo, ModelHandle, RowSums, StepSums, all_reduce_sum, barrier,
                                       check_whole_groups, compute_context, copy_parameters, device_memory,
                                       gathered_parameters, gradient_sync, init_distributed, reduce_mean_dict, reshard,
                                       resolve_strategy, shard_model, wrap_model, zero_loss)
from ddrl.training.evaluation import TrainingEvaluation
from ddrl.rewards.composite import score_parts
from ddrl.training.logging import MetricsLogger, RunLog, eval_settings, plot_reward_curve, stat_name, step_line
from ddrl.training.memory import check_memory
from ddrl.training.method import Method, build_method
from ddrl.training.preemption import PreemptionGuard
from ddrl.training.reward_watch import DeadRewardError, RewardWatch  # noqa: F401 (DeadRewardError: the API's)
from ddrl.training.run_dir import RunDirectory
from ddrl.training.update_plan import UpdatePlanner, passes
from ddrl.types import EstimatorOutput, RolloutBatch


def _move(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """module.to(device), skipped when every parameter is there already: Module.to swaps each parameter
    even then, which a rehearsal's fake tensors refuse (ddrl.training.rehearse)."""
    if any(p.device != device for p in module.parameters()):
        module.to(device)
    return module


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass
class Provided:
    """What a caller hands the trainer instead of the trainer building it; None = the trainer's own.
    ddrl.training.rehearse passes a fake CUDA device, a stand-in task and a loader that builds the
    model at its real size on fake tensors (no weights), and leaves the fit to its memory tracker."""

    device: torch.device | None = None
    task: Any = None
    load_model: Callable[..., Any] | None = None  # called as ddrl.models.load_model(path, **kwargs)
    memory_check: bool = True  # ddrl.training.memory.check_memory before the model is placed


def _failed_start_leaves_nothing(init: Any) -> Any:
    """A Trainer that fails to start (a bad task, a model that does not load) removes the run
    directories it made while they are empty, and gives the console back."""

    @functools.wraps(init)
    def start(self: "Trainer", cfg: RLConfig, provided: "Provided | None" = None) -> None:
        try:
            init(self, cfg, provided)
        except BaseException:
            if getattr(self, "run_log", None) is not None:
                self.run_log.stop()
            if getattr(self, "run_directory", None) is not None:
                self.run_directory.abandon()
            raise

    return start


class Trainer:
    @_failed_start_leaves_nothing
    def __init__(self, cfg: RLConfig, provided: Provided | None = None):
        from ddrl.tasks import get_task

        self.cfg = cfg
        self.provided = provided or Provided()
        t = cfg.train
        self.device = self.provided.device or pick_device(cfg.device)
        self.dist: DistInfo = init_distributed(cfg.dist.backend, self.device, timeout_s=cfg.dist.timeout,
                                               one_rank_group=cfg.dist.cpu_offload, cpu_offload=cfg.dist.cpu_offload)
        check_whole_groups(t.prompts_per_step, self.dist.world_size)  # before the data and the model
        self.run_log = RunLog(enabled=self.dist.is_main)  # train.log: held in memory until the start succeeded
        self.run_log.start()
        # resume / overwrite refusals before any compute (ddrl.training.run_dir)
        self.run_directory = RunDirectory.open(cfg.output_dir, cfg.resume, cfg.overwrite)
        self.run_dir = self.run_directory.path
        barrier(self.dist)  # every rank has judged output_dir before rank 0 writes into it (metrics.jsonl)
        self.task = self.provided.task or get_task(cfg.task.name, **task_kwargs(cfg.task))
        self.method: Method = build_method(cfg)
        self.objective, self.estimator = self.method.objective, self.method.estimator
        self.strategy = resolve_strategy(cfg.dist.strategy, self.dist)
        self.pool: list[dict[str, Any]] = []
        self._pool_complete = False  # the task had fewer examples than asked: wrap around
        if not self.example(0):  # the data is read and checked before the model is loaded
            raise ValueError(f"task {self.task.name!r} returned no training examples; check task.args")
        self.model = self._load_model()  # on the CPU until the memory check passed
        check_modality(self.model, self.task)  # an image model on a text task (or the reverse) fails here
        self._resolve_sampler()
        # the rollouts' tokenize -> cut -> pad -> sample -> decode, the path evaluation takes too
        self.engine = RolloutEngine(self.model, cfg.rollout, sampler=cfg.rollout.name, task=self.task,
                                    device=self.device, context=self._sampling_context)
        self.max_prompt = self.engine.max_prompt  # prompt tokens the model takes beside rollout.gen_length
        self.truncated_prompts = 0  # prompts cut to rollout.max_prompt_length so far (announced once)
        self.ref_model = self._make_reference() if self.method.needs_ref else None
        self.wrapped = self._place_models(cfg.model.mixed_precision)
        self.policy = ModelHandle(self.wrapped, self.model)
        # what the method's loss terms record around each micro-batch's loss forwards (the routers' balance)
        self.balance = self.method.recorder(self.model)
        self.autocast = compute_context(self.device, cfg.model.mixed_precision, self.strategy)
        sharded = t.sharded_checkpoints
        self.sharded_checkpoints = self.strategy == "fsdp" if sharded == "auto" else bool(sharded)
        self.opt = build_optimizer(self.model.parameters(), t.lr, t.weight_decay, (t.betas[0], t.betas[1]))
        self.sched = build_scheduler(self.opt, schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                                     total_steps=t.steps * t.num_iterations * t.minibatches,
                                     min_lr_ratio=t.min_lr_ratio)
        self.step = 0  # rollout steps done (train.steps counts these)
        self.optimizer_steps = 0  # optimizer updates done: each rollout step makes up to mu x minibatches
        self.bad_steps = 0
        self.rewards = RewardWatch(t.max_invalid_steps)  # dead rewards: no update, stop, keep the valid checkpoint
        self.planner = UpdatePlanner(t, self.method, self.dist, self.device)
        self.evaluation = TrainingEvaluation(cfg, self.task, self.model, self.autocast, self.dist, self.run_dir)
        if self.run_directory.resume:
            self._resume()
        elif self.dist.is_main:
            self.run_directory.clear_previous_run()  # overwrite=true, now that the task and the model loaded
        self.logger = MetricsLogger(self.run_dir, tensorboard=t.tensorboard and self.dist.is_main, wandb=t.wandb,
                                    enabled=self.dist.is_main, start_step=self.step)
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
        self.run_log.attach(self.run_dir / "train.log")
        self.run_log.stop()  # run() starts it again

    # The run's evaluations (ddrl.training.evaluation), read by the demo and `ddrl compare`.
    @property
    def eval_history(self) -> list[dict[str, Any]]:
        return self.evaluation.history

    @property
    def report(self) -> dict[str, dict[str, Any]]:
        return self.evaluation.report

    @property
    def eval_split(self) -> str:
        return self.evaluation.split

    # ------------------------------------------------------------------ setup helpers
    def _resolve_sampler(self) -> None:
        """rollout.name=auto becomes the model's own sampler (config.yaml records which); an explicit
        one the model cannot run, or settings it refuses, fail here, before any compute."""
        r = self.cfg.rollout
        r.name = resolve_sampler(self.model, r.name, "rollout")
        check_sampler(r, "rollout", block_size=model_view(self.model).block_size)

    @contextlib.contextmanager
    def _sampling_context(self) -> Iterator[None]:
        """What the sampler's model calls run under: the step's autocast, and under FSDP2 the whole
        parameters gathered once for the many calls of a rollout."""
        with self.autocast, gathered_parameters(self.model):
            yield

    def _load_model(self) -> Any:
        from ddrl.models import load_model

        m = self.cfg.model
        if not m.path:
            raise ValueError("model.path is required for RL: point it at a pretrained model directory "
                             "(e.g. checkpoints/mini_sudoku-masked) or run `ddrl pretrain` first")
        kwargs: dict[str, Any] = dict(dtype=m.dtype, mask_token_id=m.mask_token_id, trust_remote_code=m.trust_remote_code,
                      block_size=m.block_size, require_tokenizer=True)
        if m.vq_path is not None:  # only image families take it (load_model says which)
            kwargs["vq_path"] = m.vq_path
        if m.t2i_attend_padding is not None:  # a text-to-image MMaDA only (load_model refuses it elsewhere)
            kwargs["t2i_attend_padding"] = m.t2i_attend_padding
        if self._rank0_loading:  # weights read once, on rank 0; the other ranks build on the meta device
            model = ckpt.load_model_on_rank0(m.path, self.dist, **kwargs)
        else:
            model = (self.provided.load_model or load_model)(m.path, **kwargs)
        if model_view(model).mask_token_id is None:
            raise ValueError(f"model {self.cfg.model.path!r} has no mask token; set model.mask_token_id")
        lora = self.cfg.model.lora
        if lora.rank > 0:
            from ddrl.models.lora import apply_lora

            model = apply_lora(model, lora, seed=self.cfg.seed)
        if self.cfg.model.gradient_checkpointing:
            # every DiffusionLM has it; a user's loader (provided.load_model) may return a module without it,
            # and a memory setting that silently does nothing is found out at the first OOM
            if not callable(getattr(model, "gradient_checkpointing_enable", None)):
                raise ValueError(f"model.gradient_checkpointing=true, but {type(model).__name__} has no "
                                 f"gradient_checkpointing_enable(); set model.gradient_checkpointing=false or "
                                 f"give the model that method")
            model.gradient_checkpointing_enable()
        if self.cfg.train.disable_dropout:
            disable_dropout(model)
        return model

    @property
    def _rank0_loading(self) -> bool:
        """Sharded runs read the checkpoint on rank 0 only (N ranks x 16 GB of host memory at 8B otherwise).
        Not with dist.cpu_offload: each rank reads it, and its shards stay in host memory."""
        return (self.strategy == "fsdp" and self.dist.enabled and not self.cfg.dist.cpu_offload
                and self.provided.load_model is None)

    def _place_models(self, precision: str) -> torch.nn.Module:
        """Policy (and reference) onto the device, wrapped or sharded; returns the wrapped policy.
        First the memory check: a model whose training state cannot fit the device under this
        strategy is refused before any of it is moved. Under FSDP the reference is sharded like the
        policy: 1/N of a copy per rank."""
        if self.provided.memory_check:
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
        place = torch.device("cpu" if offload else self.device)
        _move(self.model, place).train()
        wrapped = wrap_model(self.model, self.strategy, self.device, precision, cpu_offload=offload)
        if self.ref_model is not None:
            _move(self.ref_model, place)
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
        assert self.ref_model is not None  # called only when the method keeps a reference copy
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
        """Train to train.steps; returns the run directory. SIGTERM and Ctrl-C stop after a checkpoint
        (Ctrl-C then raises KeyboardInterrupt); dead rewards stop after one with DeadRewardError."""
        t, e = self.cfg.train, self.cfg.eval
        stopped: Exception | None = None
        with self.run_log:  # train.log: what the run prints, and a plain line per logged step
            # The model before RL: its scores ride on the first logged row (every row is a training step).
            before: dict[str, Any] = {}
            if e.before and self.step == 0:
                before = self.evaluation.before_training()
            bar = tqdm(total=t.steps, initial=self.step, desc=f"{self.cfg.method.objective} on {self.task.name}",
                       disable=not (t.progress and self.dist.is_main), dynamic_ncols=True, file=self.run_log.console)
            with PreemptionGuard() as preemption:  # SIGTERM, SIGINT: finish the step, checkpoint, stop
                while self.step < t.steps:
                    self.step += 1
                    metrics = self.train_step(self.step)
                    dead = self.rewards.record(self.step, bool(metrics.get("reward/all_invalid")))  # same on every rank
                    if t.sync_ref_every and self.step % t.sync_ref_every == 0 and self.ref_model is not None:
                        self.sync_reference()
                    logged = self.step % t.log_every == 0 or self.step == t.steps or dead
                    if logged:
                        metrics, before = {**metrics, **before}, {}
                    if e.every and self.step % e.every == 0 and self.step != t.steps and not dead:
                        metrics.update(self.evaluation.evaluate(self.step))
                    if self.step == t.steps and not dead:
                        metrics.update(self.evaluation.after_training(self.step))
                    row = self.logger.log(self.step, metrics) if logged else metrics
                    if logged:
                        self.run_log.line(step_line(self.step, t.steps, row))
                    bar.update(1)
                    bar.set_postfix(reward=f"{row.get('reward/mean') or 0:.3f}", step_s=f"{row.get('time/step') or 0:.1f}",
                                    acc=self.evaluation.last_accuracy())
                    stop = preemption.requested(self.dist, self.device)  # every rank stops after the same step
                    if (t.save_every and self.step % t.save_every == 0) or self.step == t.steps or stop or dead:
                        self.save()
                    if dead:
                        stopped = self.rewards.error(self.step)
                        break
                    if stop and self.step < t.steps:
                        if self.dist.is_main:
                            print(f"stopped by {preemption.name} after step {self.step}: checkpoint-{self.step} "
                                  f"written; resume=true continues from it", flush=True)
                        break
            bar.close()
            self.logger.close()
            if self.dist.is_main:
                plot_reward_curve(self.run_dir / "metrics.jsonl", self.run_dir / "reward_curve.png",
                                  title=f"{self.cfg.method.objective} on {self.task.name}",
                                  eval_label=eval_settings(self.evaluation.split, e.temperature))
            if stopped is not None:
                self.run_log.line(f"ddrl: error: {stopped}")
                raise stopped
        preemption.reraise()  # Ctrl-C: the KeyboardInterrupt it would have been, now that the step is saved
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
        dead = self._no_valid_reward(batch)
        kept = self.planner.filter_groups(batch)
        # all rewards invalid: no optimizer step (AdamW's momentum would move the weights on a zero gradient)
        plan = None if dead else self.planner.plan(batch, kept)
        stats: dict[str, Any] = {"update/skipped": 1.0}  # every group filtered out: nothing to learn from
        if plan is None and not dead:
            self.planner.report_no_update(step)
        elif plan is not None:
            old, ref = self.behaviour_passes(plan.micro, step, clock)
            with clock("update"):
                stats = self.update(plan.micro, old, ref, step, plan.counts)
        timings["step"] = sum(timings.values())
        metrics = self._rollout_metrics(batch)
        learned = 0 if plan is None else plan.rows
        metrics["update/rows_frac"] = RowSums(float(learned), float(len(batch)))
        metrics["update/groups_kept_frac"] = RowSums(kept.reward_valid.sum(), batch.reward_valid.sum())
        metrics.update(stats)
        metrics["reward/all_invalid"] = float(dead)
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
        prompts = self.engine.encode([self.example((step - 1) * t.prompts_per_step + i)["prompt"]
                                      for i in range(t.prompts_per_step)])  # [N, P]: the likelihood passes score them too
        self._announce_truncation(prompts.truncated, t.prompts_per_step)
        mine = slice(self.dist.rank * per_rank, (self.dist.rank + 1) * per_rank)
        # One sampler call for all of this rank's groups (or calls of rollout.batch_rows rows). Each group draws
        # from its own generator, on the model's device, seeded by (seed, step, the group's data position): its
        # completions are those of a call on that group alone, so 1 process and N processes draw the same rollouts.
        generators = RowGenerators([make_generator(derive_seed(self.cfg.seed, "rollout", step, first + i), self.device)
                                    for i in range(per_rank)], rows_per_generator=G)
        out = self.engine.generate(prompts.ids[mine], prompts.mask[mine], generators, rows_per_prompt=G,
                                   return_trajectory=self.needs_trajectory)
        K = t.num_iterations
        seeds = torch.tensor([derive_seed(self.cfg.seed, "mask", step, k) % 2**62 for k in range(K)])
        B = len(out.prompt_ids)
        return RolloutBatch(
            prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
            completion_mask=out.completion_mask,
            group_ids=torch.arange(per_rank, device=self.device).repeat_interleave(G),
            rewards=torch.zeros(B, device=self.device), advantages=torch.zeros(B, device=self.device),
            mask_seeds=seeds, completions=out.completions.texts, trajectory=out.trajectory,
            examples=[ex for ex in examples for _ in range(G)],
            reward_inputs=out.completions.reward_inputs(),  # images=[B, 3, H, W] for image tasks
            nfe=out.nfe, forward_tokens=out.forward_tokens or 0, truncated_prompts=prompts.truncated,
        )

    def score(self, batch: RolloutBatch) -> None:
        columns = {c: [ex.get(c) for ex in batch.examples] for c in batch.examples[0] if c != "prompt"}
        inputs: dict[str, Any] = {**columns, **batch.reward_inputs}
        batch.reward_inputs = {}  # read once: an image task's pixels need not live through the update
        # A reward set on the task instance (`task.reward = fn`, as a user wraps or replaces one) is
        # what scores, as before rewards returned parts; otherwise the task's own score and parts.
        replaced = vars(self.task).get("reward")
        scored = score_parts(replaced, batch.completions, **inputs) if replaced else self.task.score(batch.completions, **inputs)
        values = [float("nan") if r is None else float(r) for r in scored.scores]
        batch.rewards = torch.tensor(values, dtype=torch.float32, device=self.device)
        batch.reward_failed = ~torch.isfinite(batch.rewards)
        truncated = self.cfg.train.truncated_reward
        if truncated is not None:  # no stop token within gen_length: the answer was cut off
            cut = ~is_stop(batch.completion_ids, model_stop_ids(self.model)).any(dim=1)  # [B]
            margin = self.cfg.train.truncation_margin
            if margin > 0:  # dLLM-RL: length >= max_gen_length - 5 counts as cut off
                cut |= batch.completion_mask.sum(dim=1) >= batch.completion_ids.shape[1] - margin
            batch.rewards[cut] = float(truncated)
        invalid = ~torch.isfinite(batch.rewards)
        batch.reward_invalid = invalid  # for reward/invalid_frac, before "zero" makes them 0
        # "drop": excluded from the group, no loss; "zero": a reward of 0 like any other (d1, wd1)
        batch.rewards[invalid] = 0.0 if self.method.advantage.invalid == "zero" else float("nan")
        if scored.parts:
            batch.reward_parts = {k: finite_sum_count(v) for k, v in scored.parts.items()}

    def _no_valid_reward(self, batch: RolloutBatch) -> bool:
        """Whether the reward gave None/NaN for every completion of the step, on every rank (a
        collective: every rank gets the same answer, so all skip the update or none does)."""
        assert batch.reward_failed is not None  # score() ran
        valid = (~batch.reward_failed).sum().float().reshape(1)
        return all_reduce_sum(valid, self.dist).item() == 0

    def advantages(self, batch: RolloutBatch) -> None:

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
                for k, m, j, mb in passes(micro, K):
                    if self._old_pass_needed(k, m):
                        old[k][m][j] = self._estimate(self.policy, mb, step, k, "old").detach()
        if self.method.needs_ref:
            with clock("ref"), self.autocast, self.reference() as ref_model:
                for k, m, j, mb in passes(micro, K):
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

    def update(self, micro: list[list[RolloutBatch]], old: list, ref: list, step: int,
               counts: list[AggregationCounts]) -> dict[str, Any]:
        """mu inner iterations; in each, one optimizer step per minibatch share, its loss normalised
        by that share's global counts (a share is the whole step when train.minibatches = 1).

        Each optimizer step's loss is summed over ranks before its finite check, so every rank sees
        the same loss and gradient norm and skips the step (or raises) with the others; that check is
        the loop's one host read per optimizer step (estimators and objectives may add their own:
        tests/unit/test_host_syncs.py). The objective's statistics stay on the device, summed per
        optimizer step over the real micro-batches with their count (StepSums), so that the logged
        values are global means over the micro-batches of every rank, the 1-process values."""
        t = self.cfg.train
        n_updates = t.num_iterations * len(micro)
        stat_sums: dict[str, torch.Tensor] = {}  # name -> [U] sums over each optimizer step's real micro-batches
        real = torch.zeros(n_updates)  # [U] real micro-batches of each optimizer step on this rank (from the plan)
        loss_sum = grad_norm_sum = torch.zeros((), device=self.device)  # over the finite optimizer steps
        skipped = 0
        for k in range(t.num_iterations):
            for m, share in enumerate(micro):
                u = k * len(micro) + m
                self.opt.zero_grad(set_to_none=True)
                total = torch.zeros((), device=self.device)
                for j, mb in enumerate(share):
                    padding = mb.padding
                    # one all-reduce a step; DDP decides in forward whether the backward syncs: both inside
                    with gradient_sync(self.wrapped, enabled=j == len(share) - 1):
                        with self.autocast, self.balance:
                            new = self._estimate(self.policy, mb, step, k, "cur")
                            if padding:
                                loss, stats = zero_loss(new), {}
                            else:
                                o = old[k][m][j] if old[k][m][j] is not None else (
                                    new.detach() if self.objective.needs_old else None)
                                out = self.method.loss(mb, new, o, ref[k][m][j], counts[m])
                                loss, stats = out.loss, out.stats
                        (loss * self.dist.world_size).backward()  # DDP averages; we want the global sum
                    total = total + loss.detach().float()
                    real[u] += 0 if padding else 1
                    for name, v in stats.items():
                        row = stat_sums.setdefault(name, torch.zeros(n_updates, device=self.device))
                        row[u] += v.detach().float() if isinstance(v, torch.Tensor) else float(v)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm or float("inf"))
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                    grad_norm = grad_norm.full_tensor()
                total = all_reduce_sum(total, self.dist)  # the global loss: every rank decides on the same value
                if not bool(torch.isfinite(total) & torch.isfinite(grad_norm)):  # the loop's host read
                    self.opt.zero_grad(set_to_none=True)
                    self.bad_steps += 1
                    skipped += 1
                    if self.bad_steps >= t.max_bad_steps:
                        raise NonFiniteError(
                            f"{self.bad_steps} optimizer steps in a row had a non-finite loss or gradient (step {step}); "
                            f"lower train.lr, raise method.estimator_args.num_mc, or lower train.max_grad_norm")
                    continue
                self.bad_steps = 0
                self.opt.step()
                self.optimizer_steps += 1
                self.sched.step()
                loss_sum = loss_sum + total
                grad_norm_sum = grad_norm_sum + grad_norm.detach().float()
        # loss and grad_norm are the same on every rank (global values); a skipped step counts as 0
        sums: dict[str, Any] = {"loss/total": loss_sum / n_updates, "grad_norm": grad_norm_sum / n_updates}
        for name, row in stat_sums.items():  # row counts (COUNTED_STATS) are sums, the rest means
            sums[stat_name(name)] = StepSums(row, None if name in COUNTED_STATS else real)
        if skipped:
            sums["update/nonfinite_steps"] = float(skipped)
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
        for old/ref/current. Fresh masks: a new seed per pass role and micro-batch, keyed by the
        micro-batch's first global group (the planner's batch.groups), never by the rank: with one
        group per micro-batch (train.micro_batch_size = group_size, StableDRL's released setting)
        each group draws its own masks and 1 and N processes draw the same ones."""
        if self.method.fresh_masks:
            assert batch.groups, "the update planner names every micro-batch's groups"
            return derive_seed(self.cfg.seed, "fresh", step, k, role, batch.groups[0]) % 2**62
        return int(batch.mask_seeds[self.method.mask_seed_iteration(k)])

    def _rollout_metrics(self, batch: RolloutBatch) -> dict[str, Any]:
        """Device tensors (and floats) of this rank's rollouts; reduce_mean_dict copies them to the host
        once per step. Statistics of rows are sums and counts (RowSums), reduced over ranks and then
        divided: the 1-process values at any world size (the sampler's call count is every rank's own)."""
        r = batch.rewards
        valid = ~batch.reward_invalid if batch.reward_invalid is not None else torch.isfinite(r)
        valid_r = torch.where(valid, r, 0.0)
        rows = float(len(batch))
        m: dict[str, Any] = {
            "reward/mean": RowSums(valid_r.sum(), valid.sum()),  # NaN when no reward is valid
            "reward/std": RowSums(valid_r.sum(), valid.sum(), squares=(valid_r * valid_r).sum()),
            "reward/invalid_frac": RowSums((~valid).sum(), rows),
            "completions/mean_length": RowSums(batch.completion_mask.sum(), rows),
            "rollout/model_calls": float(batch.nfe),
            "rollout/forward_tokens": RowSums(float(batch.forward_tokens)),  # summed over ranks
            "rollout/truncated_prompts": float(batch.truncated_prompts),  # of the whole step's prompts
            "advantage/abs_mean": RowSums(batch.advantages.abs().sum(), rows),
        }
        for name, (total, n) in batch.reward_parts.items():
            m[f"reward/{name}"] = RowSums(total, n)
        return m

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """A checkpoint of the step (collective: every rank calls it). Sharded under FSDP by default
        (train.sharded_checkpoints): each rank writes its own shard, nothing is gathered. Rotation
        (train.keep_checkpoints) keeps the newest checkpoint made with valid rewards too."""
        state = {"step": self.step, "optimizer_steps": self.optimizer_steps, "scheduler": self.sched.state_dict(),
                 "bad_steps": self.bad_steps, "eval_history": self.evaluation.history, "data_position": self.step,
                 **self.rewards.checkpoint(self.step)}
        ckpt.save_training_checkpoint(self.run_dir, self.step, self.model, self.opt, state, dist=self.dist,
                                      sharded=self.sharded_checkpoints, keep=self.cfg.train.keep_checkpoints,
                                      pinned=self.rewards.valid_checkpoint)

    def _resume(self) -> None:
        """The newest checkpoint that loads (a corrupt one falls back to the one before, with a warning)."""
        found = ckpt.load_newest_training_checkpoint(self.run_dir, self.model, self.opt,  # full or sharded
                                                     trust_remote_code=self.cfg.model.trust_remote_code)
        if found is None:
            return  # resume=auto in a directory without a checkpoint: start fresh
        path, state = found
        self.sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.bad_steps = int(state.get("bad_steps", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.evaluation.history = list(state.get("eval_history", []))
        self.rewards.resume(state, self.step)
        if self.dist.is_main:
            print(f"resume: continuing from {path} (step {self.step} of {self.cfg.train.steps})")


def train(config: str | Path | dict | RLConfig, overrides: list[str] | None = None) -> Path:
    """Run RL fine-tuning from a config file (plus dotted overrides); returns the run directory."""
    cfg = config if isinstance(config, RLConfig) else load_config(config, overrides, RLConfig)
    return Trainer(cfg).run()
