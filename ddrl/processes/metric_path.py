"""URSA's metric-induced probability path (discrete flow matching over a codebook).

Shaul et al. 2024, "Flow matching with general discrete paths: a kinetic-optimal perspective", as URSA
(BAAI, 2025) uses it: diffnext/schedulers/scheduling_dfm.py (MetricDiscreteProbPath,
KineticOptimalScheduler) of Yovecent/UDM-GRPO @ d1bec49 (docs/diffusion.md#ursa-metric-path). Golden
outputs: tests/fixtures/make_ursa.py.

**Flow time.** URSA counts time the other way from ddrl's processes: flow time s = 0 is noise (the
uniform distribution) and s -> 1 is clean. The methods named `flow_*` and taking `s` are in flow time;
the ForwardProcess interface (sample_t, noise, pretrain_loss) keeps ddrl's t = 1 - s (t = 0 clean,
t = 1 noise), so estimators and trainers treat every process alike.

With ê_x the L2-normalised codebook vector of class x (eps 1e-5 on the norm) and d(x, y) = ||ê_x - ê_y||²:

    p_s(x | x1) = softmax_x( -beta(s) d(x, x1) ),    beta(s) = c (s / (1 - s))^alpha
    beta'(s) = c alpha s^(alpha - 1) / (1 - s)^(alpha + 1)          (0 at s = 0, as theirs)

alpha and c come from the pipeline's scheduler_config.json. The kinetic-optimal velocity towards a
clean class x1 from the current class x_t (`velocity`):

    v(x | x_t, x1) = beta'(s) p_s(x | x1) relu( d(x_t, x1) - d(x, x1) )     (only towards x closer to x1)

Times, with URSA's shift k (scheduler_config.json "shift"), flow_time(sigma) = 1 - k sigma / (1 + (k - 1) sigma):
  training:  sigma = 1 - 0.999 u, u ~ U[0, 1)       (KineticOptimalScheduler.sample_timesteps)
  inference: sigma = 1 - i / N for steps i = 0 .. N  (timestep_to_t; s(N) = 1 is the clean end)

The reverse CTMC that samples with this path is ddrl.sampling.metric_path.

Where this deviates from theirs: their distance writes into the logits tensor it is handed (in place);
here no argument is modified (`velocity` works in place on its own temporaries only). Their pipeline
keeps the codebook in float16 unless given a dtype; here it is float32 (the goldens compare with their
path in float32). There is no NELBO (URSA trains with plain cross-entropy, `ce_loss`) and no uniform posterior: the
process is a sibling of UniformProcess (ddrl.processes.uniform.ClassProcess), not a subclass, so it has
neither `nelbo` nor `posterior` nor a schedule alpha(t).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ddrl.processes.base import check_eligible, check_tokens
from ddrl.processes.draws import uniform_draw
from ddrl.processes.uniform import ClassProcess
from ddrl.registry import PROCESSES

TRAIN_SIGMA_SPAN = 0.999  # sample_timesteps: sigma = 1 - 0.999 u, so s stays below 1
# noise() draws this many [position, class] elements at a time (three float32 tensors of it alive):
# UDM-GRPO's 3 re-noised copies of 16 rows x 1,024 codes over URSA's 131,072 classes were three
# 25.8 GB tensors at once (issue 33: the rehearsal's 77 GB update peak); in chunks, 3 x 64 MB.
NOISE_CHUNK_ELEMENTS = 2**24


@PROCESSES.register("metric_path")
class MetricPathProcess(ClassProcess):
    """The metric path over the N classes offset .. offset + N - 1 (the image codes of an URSA model).

    codebook: [N, D] embedding of the classes (URSA: scheduler_model.pth "path.emb"), or nested lists
              (a process_spec in config.json); L2-normalised here, so a 1-D codebook collapses to +-1
              (every distance 0): give gray levels g at least two dimensions, e.g. (cos(pi g/2), sin(pi g/2)).
    alpha, c: the path's exponent and scale (scheduler_config.json); shift: the time shift k.

    A ForwardProcess, sibling of the uniform process (both ClassProcess): it has no schedule alpha(t)
    (`alpha` is the path's exponent), no closed-form NELBO and no uniform posterior, so it is never asked
    for them (a caller that needs them takes a ScheduledProcess / UniformProcess).
    """

    name = "metric_path"

    def __init__(self, num_classes: int, offset: int = 0, *, codebook: Tensor | Sequence[Sequence[float]],
                 alpha: float = 0.9, c: float = 3.0, shift: float = 1.0, eps: float = 1e-5):
        super().__init__(num_classes, offset)
        emb = torch.as_tensor(codebook, dtype=torch.float32)
        if emb.dim() != 2 or emb.shape[0] != num_classes:
            raise ValueError(f"codebook must be [num_classes={num_classes}, D], got shape {list(emb.shape)}")
        for name, value in (("alpha", alpha), ("c", c), ("shift", shift)):
            if not float(value) > 0:
                raise ValueError(f"{name} must be > 0, got {value!r} (scheduler_config.json)")
        self.alpha, self.c, self.shift, self.eps = float(alpha), float(c), float(shift), float(eps)
        self.emb = torch.nn.functional.normalize(emb, dim=-1, eps=self.eps)  # ê [N, D]
        self._sumsq = self.emb.square().sum(-1)  # ||ê||² [N]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_classes={self.num_classes}, offset={self.offset}, alpha={self.alpha}, "
                f"c={self.c}, shift={self.shift}, dim={self.emb.shape[1]})")

    def to(self, device: torch.device | str) -> "MetricPathProcess":
        self.emb, self._sumsq = self.emb.to(device), self._sumsq.to(device)
        return self

    # ---------------------------------------------------------------- the path (flow time s)
    def beta(self, s: Tensor | float) -> Tensor:
        s = torch.as_tensor(s, dtype=torch.float64)
        return self.c * (s / (1 - s)) ** self.alpha

    def beta_prime(self, s: Tensor | float) -> Tensor:
        s = torch.as_tensor(s, dtype=torch.float64)
        alpha = self.alpha
        return torch.where(s > 0, self.c * alpha * s.clamp_min(1e-300) ** (alpha - 1)
                           / (1 - s) ** (alpha + 1), torch.zeros_like(s))

    def distances(self, x1: Tensor) -> Tensor:
        """d(x1, x) for every class x: class indices [...] -> [..., N] (their get_dist against the codebook)."""
        e1 = torch.nn.functional.normalize(self._on(x1)[x1], dim=-1, eps=self.eps)  # [..., D]
        d = e1.square().sum(-1, keepdim=True) + self._sumsq  # [..., N]
        return d.sub_(e1 @ (2 * self.emb).T)  # in place: one [..., N] temporary (the product), not two

    def pair_distance(self, x: Tensor, y: Tensor) -> Tensor:
        """d(x, y) elementwise: class indices [...] x2 -> [..., 1]."""
        emb = self._on(x)
        ex = torch.nn.functional.normalize(emb[x], dim=-1, eps=self.eps)
        ey = torch.nn.functional.normalize(emb[y], dim=-1, eps=self.eps)
        return (ex - ey).square().sum(-1, keepdim=True)

    def path_probs(self, x1: Tensor, s: Tensor | float) -> Tensor:
        """p_s(x | x1): class indices [...] and flow time s (a float, or [B] for [B, ...] indices) -> [..., N]."""
        d = self.distances(x1)
        beta = self._per_row(self.beta(s), d)
        return torch.softmax(-beta * d, dim=-1)

    def velocity(self, x1: Tensor, xt: Tensor, s: float) -> Tensor:
        """v(x | x_t, x1) [..., N] for class indices x1, x_t [...] at flow time s (module docstring).

        At most three [..., N] tensors at once (the sampler's peak: ddrl.training.memory): the gain is
        taken from d before d is scaled in place into the softmax's input, and the products are in
        place. Each in-place op is the out-of-place one with the same operands, so the numbers are
        bit for bit those of the plain formula (tests/unit/test_ursa_seeded.py)."""
        d = self.distances(x1)  # [..., N]
        gain = torch.sub(self.pair_distance(xt, x1), d).relu_()  # [..., N]
        probs = torch.softmax(d.mul_(-self._per_row(self.beta(s), d)), dim=-1)  # d is not read again
        return probs.mul_(self._per_row(self.beta_prime(s), probs)).mul_(gain)

    # ---------------------------------------------------------------- times
    def flow_time(self, sigma: Tensor) -> Tensor:
        """URSA's shifted time s = 1 - k sigma / (1 + (k - 1) sigma)."""
        return 1 - self.shift * sigma / (1 + (self.shift - 1) * sigma)

    def training_flow_times(self, batch_size: int, *, generator: torch.Generator,
                            device: torch.device | str | None = None) -> Tensor:
        """Flow times [B] for training: sigma = 1 - 0.999 u, u ~ U[0, 1) from `generator` (one torch.rand)."""
        u = uniform_draw((batch_size,), generator=generator, device=device)
        return self.flow_time(1 - u * TRAIN_SIGMA_SPAN)

    def inference_flow_times(self, steps: int) -> Tensor:
        """The sampler's grid [steps + 1] (float64): s(i) for sigma = 1 - i / steps; s(steps) = 1 is the end."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        sigma = 1 - torch.arange(steps + 1, dtype=torch.float64) / steps
        return self.flow_time(sigma)

    # ---------------------------------------------------------------- ForwardProcess (ddrl time t = 1 - s)
    def sample_t(self, batch_size: int, *, generator: torch.Generator, device: torch.device | str | None = None,
                 eps: float = 1e-3, stratified: bool = False) -> Tensor:
        """ddrl times t = 1 - s [B] with s drawn as URSA trains (training_flow_times); eps and stratified
        do not apply (URSA's sigma floor is 0.001 of its own)."""
        if stratified:
            raise ValueError("the metric path draws URSA's training times; stratified=True does not apply")
        return 1 - self.training_flow_times(batch_size, generator=generator, device=device)

    def noise(self, x0: Tensor, t: Tensor, *, generator: torch.Generator,
              eligible: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x_t ~ p_{1-t}(. | x0) at every eligible position of x0 [B, L] (full-vocabulary ids); t [B] or [B, L]
        in ddrl time. Returns (xt, noised = eligible); other positions are copied.

        One uniform per position from `generator`, drawn at once as sample_categorical draws them; the
        path's [positions, N] probabilities are then made and inverted NOISE_CHUNK_ELEMENTS // N
        positions at a time (each position's row is computed alone: the draws are the unchunked ones)."""
        check_tokens(x0)
        eligible = check_eligible(eligible, x0)
        self._check_classes(x0, eligible, "x0")
        s = 1 - self.token_times(t.to(x0.device), x0.shape)  # [B, L]
        classes = (x0 - self.offset).clamp(0, self.num_classes - 1).reshape(-1)  # [B L]
        emb = self._on(x0)
        scale = -self.beta(s).to(device=emb.device, dtype=emb.dtype).reshape(-1, 1)  # [B L, 1]
        u = uniform_draw(tuple(x0.shape) + (1,), generator=generator, device=emb.device,
                         dtype=emb.dtype).reshape(-1, 1)  # [B, L, 1] as drawn (per-row generators), [B L, 1]
        step = max(1, NOISE_CHUNK_ELEMENTS // self.num_classes)
        drawn = torch.cat([self._invert(classes[a:a + step], scale[a:a + step], u[a:a + step])
                           for a in range(0, classes.shape[0], step)])  # [B L]
        return torch.where(eligible, self.offset + drawn.view(x0.shape).to(x0.device), x0), eligible

    def _invert(self, classes: Tensor, scale: Tensor, u: Tensor) -> Tensor:
        """Classes [n] drawn from softmax(scale d(., classes)) [n, N] by inverse CDF at uniforms u [n, 1]
        (sample_categorical's arithmetic, the cdf made in place)."""
        cdf = torch.softmax(scale * self.distances(classes), dim=-1).cumsum_(-1)  # [n, N]
        idx = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True)
        return idx.squeeze(-1).clamp_(max=self.num_classes - 1)

    def pretrain_loss(self, model: Any, x0: Tensor, eligible: Tensor, attention_mask: Tensor | None = None, *,
                      generator: torch.Generator, loss: str = "ce", eps: float = 1e-3,
                      num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """URSA's pretraining loss: cross-entropy of x0 at every eligible position of x_t ~ p_s(. | x0)."""
        if loss != "ce":
            raise ValueError(f"loss={loss!r}: the metric path trains with URSA's cross-entropy only (loss='ce')")
        return self._pretrain_loss(model, x0, eligible, attention_mask, generator=generator, loss="ce", eps=eps,
                                   num_tokens=num_tokens)

    # ---------------------------------------------------------------- helpers
    def _on(self, like: Tensor) -> Tensor:
        if self.emb.device != like.device:
            self.to(like.device)
        return self.emb

    @staticmethod
    def _per_row(value: Tensor, like: Tensor) -> Tensor:
        """A scalar or per-row [B] value -> broadcastable against like [B, ..., N], in like's dtype."""
        value = value.to(device=like.device, dtype=like.dtype)
        return value.reshape(value.shape + (1,) * (like.dim() - value.dim())) if value.dim() else value
