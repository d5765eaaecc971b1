"""Likelihood / ratio proxies for discrete diffusion policies: the dLLM-specific core of ddrl.

Every estimator is a dataclass registered in ESTIMATORS; its fields are the keys of
`method.estimator_args`, and `estimator(model, batch, seed) -> EstimatorOutput`. Importing this
package registers them all:

    mean_field          d1 / wd1 one-step mean-field log-probs               1 pass
    random_ratio        UniGRPO random-ratio masking                          copies
    coupled_elbo        ESPO coupled ELBO (weighted) / GDSD denoise log-prob  2*num_mc
    coupled_three_pass  coupled-GRPO (DiffuCoder)                             3
    spg                 SPG / StableDRL block-random ELBO + EUBO              num_t
    trace               TraceRL rollout states                                steps / shrink
    maskgrpo            MaskGRPO AR-like fading masks at ratio_k              1
    stratified          DACA-GRPO stratified pseudo-likelihood [INFERRED]     num_strata
    fpo_elbo            DiPOD-FPO 4-sample ELBO                               num_samples
    staircase           block models: SPG's per-token ELBO + EUBO in one pass  num_t of length 2T
    udm                 UDM-GRPO clean-sample log-prob at re-noised states    num_timesteps
    concrete_score      SEPO concrete scores on Hamming-1 neighbours          (see its module)

DACA's token weights are a helper, `ddrl.estimators.dps.denoising_progress_scores`.
"""

from ddrl.estimators import concrete_score  # noqa: F401  (registers SEPO's `concrete_score`)
from ddrl.estimators.coupled_elbo import CoupledELBO
from ddrl.estimators.coupled_three_pass import CoupledThreePass
from ddrl.estimators.dps import denoising_progress_scores
from ddrl.estimators.fpo_elbo import FPOElbo
from ddrl.estimators.maskgrpo import MaskGRPOEstimator
from ddrl.estimators.mean_field import MeanField
from ddrl.estimators.random_ratio import RandomRatio
from ddrl.estimators.spg import SPGBounds
from ddrl.estimators.staircase import Staircase
from ddrl.estimators.stratified import Stratified
from ddrl.estimators.trace import Trace
from ddrl.estimators.udm import UDM

__all__ = [
    "CoupledELBO", "CoupledThreePass", "FPOElbo", "MaskGRPOEstimator", "MeanField", "RandomRatio", "SPGBounds",
    "Staircase", "Stratified", "Trace", "UDM", "denoising_progress_scores",
]
