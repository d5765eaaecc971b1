"""UDM-GRPO's log-prob of the final clean sample, at states re-noised by the forward process.

Wang et al., "UDM-GRPO", arXiv 2604.18518 (Yovecent/UDM-GRPO @ d1bec49
diffnext/pipelines/ursa/pipeline_grpo.py process_latents :158-176, postprocess :236-256). See
docs/methods.md.

The action is the final clean completion x0 (all image tokens). For each of a few noise levels t,
a fresh noisy state is drawn from the model's own forward process, x~_t ~ q_t(. | x0)
(model.process.noise: URSA's metric path p_s(. | x0), or a uniform process's), and

    log pi(x0 | c; t) = (1/N) sum_i log p_theta(x0^i | x~_t, c)        (mean over the real tokens)
    seq_logp = mean over the timesteps;  extras["per_timestep"] = [B, n_t]

Logits are restricted to the process's classes, vocabulary ids [offset, offset + num_classes), before
the log-softmax. Time follows ddrl's processes: t = 0 clean, t = 1 pure noise (URSA's flow time is
s = 1 - t). Which levels (`states`):

  grid    as released (the default on a metric-path model, URSA): num_timesteps consecutive steps of
          the grid_steps-step rollout grid from a random start, start ~ U{grid_start[0] .. grid_start[1] - 1}
          (their sampling.train_start [0, 3): 3 of the 10 steps, 0 = pure noise). The grid is the
          process's inference_flow_times (URSA's shifted sigma = 1 - i / grid_steps), else t = 1 - i / grid_steps.
  levels  ddrl's earlier form (the default on other processes): num_timesteps levels drawn uniformly in
          [t_min, t_max], or t_values listed explicitly.
The start / the levels come from the seed, shared by the batch (so every micro-batch of one call
sees the same states' times); the re-noising draws from seed + 1. As released, each process (GPU)
draws its own start with numpy; here one start per seed serves all rows and ranks.

Ablations of the paper (naive GRPO on UDM):
  forward_process=False: use the rollout's own states, batch.trajectory.states [B, S, L], at the
      step whose time (trajectory.step_times, else 1 - s/S) is nearest to each t, instead of re-noising;
  clean_target=False: score what each step produced instead of the final sample: the paper's naive
      form, intermediate denoising states as actions. The action of step k is the state entering
      step k + 1 (the completion for the last step), Trajectory.step_outputs, at the same nearest
      step; batch.extras["step_predictions"] [B, S, L], when a caller records its own, takes its place.
Both need the sampler's records; the instance attribute `needs_trajectory` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ddrl.estimators.common import forward_logprobs, generator_from_seed, masked_mean
from ddrl.contract import model_view
from ddrl.processes.metric_path import MetricPathProcess
from ddrl.processes.uniform import ClassNoise
from ddrl.registry import ESTIMATORS
from ddrl.types import EstimatorOutput, RolloutBatch


@ESTIMATORS.register("udm")
@dataclass
class UDM:
    num_timesteps: int = 3  # states per call (UDM-GRPO's sampling.train_steps: 3)
    states: str | None = None  # "grid" (as released) | "levels"; None = grid on a metric-path model, else levels
    grid_steps: int = 10  # grid: the rollout grid the states sit on (their rollout num_inference_steps: 10)
    grid_start: list[int] = field(default_factory=lambda: [0, 3])  # grid: start ~ U{lo .. hi - 1} (train_start)
    t_min: float = 0.6  # levels: draw t uniformly in [t_min, t_max]; t = 1 is pure noise (the noisy early steps)
    t_max: float = 1.0
    t_values: list[float] | None = None  # levels: explicit noise levels; overrides the draw
    forward_process: bool = True  # re-noise x0 with the model's forward process; False = rollout states (naive)
    clean_target: bool = True  # score the final clean x0; False = each step's predicted x0 (naive)
    rows_per_call: int | None = None  # at most this many sequences per forward call (memory); None = one call

    name: ClassVar[str] = "udm"
    paper: ClassVar[str] = "UDM-GRPO (Wang et al. 2026, arXiv 2604.18518)"
    formula: ClassVar[str] = "log pi(x0; t) = mean_i log p(x0^i | x~_t ~ q_t(.|x0)), averaged over a few noisy t"
    passes: ClassVar[str] = "num_timesteps (or len(t_values))"
    STATES: ClassVar[tuple[str, ...]] = ("grid", "levels")
    needs_trajectory: ClassVar[bool] = False

    @property
    def copies_per_row(self) -> int:
        """Copies of a row in one call's forward and backward graph (ddrl.training.memory's k)."""
        return len(self.t_values) if self.t_values else self.num_timesteps

    def __post_init__(self) -> None:
        # the naive ablations read the sampler's recorded states / predictions
        self.needs_trajectory = not (self.forward_process and self.clean_target)  # type: ignore[misc]
        if self.states is not None and self.states not in self.STATES:
            raise ValueError(f"udm states={self.states!r}: choose one of {', '.join(self.STATES)} (or null: grid on "
                             f"a metric-path model, levels otherwise)")
        if self.states == "grid" and self.t_values is not None:
            raise ValueError("udm t_values lists levels, but states='grid' takes the rollout grid's steps; set "
                             "states='levels' (or drop t_values)")
        lo, hi = (list(self.grid_start) + [None, None])[:2]
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi
                and hi - 1 + self.num_timesteps <= self.grid_steps):
            raise ValueError(f"udm grid_start={list(self.grid_start)!r} must be [lo, hi) with 0 <= lo < hi and "
                             f"hi - 1 + num_timesteps <= grid_steps={self.grid_steps} (the states stay on the grid)")

    def resolved_states(self, process) -> str:
        """grid or levels for this process: `states`; else levels when t_values are listed, grid on a
        metric-path process, levels otherwise."""
        if self.states is not None:
            return self.states
        if self.t_values is not None:
            return "levels"
        return "grid" if isinstance(process, MetricPathProcess) else "levels"

    def grid_start_index(self, seed: int) -> int:
        """The grid's first state of this call: start ~ U{grid_start[0] .. grid_start[1] - 1} from the seed."""
        lo, hi = self.grid_start
        return lo + int(torch.randint(hi - lo, (1,), generator=generator_from_seed(seed)))

    def grid_times(self, process) -> Tensor:
        """ddrl times t = 1 - s of the grid's steps 0 .. grid_steps - 1, [grid_steps] float64."""
        steps = torch.arange(self.grid_steps, dtype=torch.float64)
        metric = isinstance(process, MetricPathProcess)
        s = process.inference_flow_times(self.grid_steps)[:-1] if metric else steps / self.grid_steps
        return 1 - s

    def timesteps(self, seed: int, process=None) -> Tensor:
        """The noise levels of this call (ddrl time), [n_t] float (CPU)."""
        if self.resolved_states(process) == "grid":
            start = self.grid_start_index(seed)
            return self.grid_times(process)[start:start + self.num_timesteps].float()
        if self.t_values is not None:
            return torch.tensor([float(t) for t in self.t_values])
        if not 0.0 <= self.t_min <= self.t_max <= 1.0:
            raise ValueError(f"udm needs 0 <= t_min <= t_max <= 1, got {self.t_min}, {self.t_max}")
        u = torch.rand(self.num_timesteps, generator=generator_from_seed(seed), dtype=torch.float64)
        return (self.t_min + (self.t_max - self.t_min) * u).float()

    def __call__(self, model, batch: RolloutBatch, seed: int) -> EstimatorOutput:
        process = model_view(model).process
        if not isinstance(process, ClassNoise):
            raise ValueError("the udm estimator needs a uniform-diffusion model: model.process with "
                             "noise(), num_classes and offset (a UniformProcess or MetricPathProcess)")
        offset, N = int(process.offset), int(process.num_classes)
        ts = self.timesteps(seed, process)  # [n_t]
        n_t, (B, L) = ts.shape[0], batch.completion_ids.shape
        real = batch.completion_mask.bool()
        states, targets = self._states_and_targets(process, batch, ts, seed)  # [n_t*B, L] each
        targets = torch.where(real.repeat(n_t, 1), targets, offset)  # unscored slots: any valid class
        lp = forward_logprobs(model, batch.prompt_ids.repeat(n_t, 1), batch.prompt_mask.repeat(n_t, 1), states,
                              targets, class_range=(offset, offset + N), rows_per_call=self.rows_per_call)
        lp = lp.view(n_t, B, L)
        per_timestep = masked_mean(lp, real[None], dim=-1).T  # [B, n_t]
        token_logp = (lp * real).mean(0)
        return EstimatorOutput(token_logp=token_logp, seq_logp=per_timestep.mean(1), mask=real,
                               extras={"per_timestep": per_timestep, "t": ts.to(lp.device)})

    def _states_and_targets(self, process, batch: RolloutBatch, ts: Tensor, seed: int) -> tuple[Tensor, Tensor]:
        """Noisy inputs and scored tokens, both [n_t*B, L], copies ordered timestep-major."""
        n_t, x0 = ts.shape[0], batch.completion_ids
        device, B = x0.device, x0.shape[0]
        steps = None if self.forward_process and self.clean_target else self._nearest_steps(batch, ts)
        if self.forward_process:
            eligible = batch.completion_mask.bool().repeat(n_t, 1)
            t = ts.to(device).repeat_interleave(B)  # [n_t*B]
            # a distinct stream from the t draw (seed + 1), so t_values=... and drawn levels noise alike
            states, _ = process.noise(x0.repeat(n_t, 1), t, generator=generator_from_seed(int(seed) + 1),
                                      eligible=eligible)
        else:
            if batch.trajectory is None or batch.trajectory.states is None:
                raise ValueError("udm with forward_process=False needs batch.trajectory.states [B, S, L] "
                                 "(a uniform sampler run with return_trajectory=True)")
            states = batch.trajectory.states.to(device)[:, steps].transpose(0, 1).reshape(n_t * B, -1)
        if self.clean_target:
            return states, x0.repeat(n_t, 1)
        if "step_predictions" in batch.extras:
            outputs = batch.extras["step_predictions"]  # [B, S, L]
        elif batch.trajectory is not None and batch.trajectory.states is not None:
            outputs = batch.trajectory.step_outputs(batch.completion_ids)  # [B, S, L]
        else:
            raise ValueError("udm with clean_target=False needs the rollout's states, batch.trajectory.states "
                             "[B, S, L] (a uniform sampler run with return_trajectory=True)")
        preds = outputs.to(device)[:, steps]  # [B, n_t, L]
        return states, preds.transpose(0, 1).reshape(n_t * B, -1)

    @staticmethod
    def _nearest_steps(batch: RolloutBatch, ts: Tensor) -> Tensor:
        """Index of the rollout step whose time is closest to each t, [n_t] long (CPU)."""
        traj = batch.trajectory
        S = traj.states.shape[1] if traj is not None and traj.states is not None else None
        if S is None and "step_predictions" in batch.extras:
            S = batch.extras["step_predictions"].shape[1]
        if S is None:
            raise ValueError("udm's naive ablations need the rollout's records: batch.trajectory.states "
                             "(forward_process=False) or batch.extras['step_predictions'] (clean_target=False)")
        times = traj.step_times.cpu().float() if traj is not None and traj.step_times is not None \
            else 1.0 - torch.arange(S, dtype=torch.float32) / S
        return (times[None, :] - ts[:, None]).abs().argmin(1)
