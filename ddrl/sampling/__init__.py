"""Rollout generation, usable on its own (no trainer state). Importing registers the samplers."""

from ddrl.sampling import diffusion_gemma, drakes, dream, llada2, masked, maskgit, metric_path, uniform  # noqa: F401  (registration)
from ddrl.sampling.base import SampleOutput

__all__ = ["SampleOutput"]
