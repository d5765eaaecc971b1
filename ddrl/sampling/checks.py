"""Sampler settings are validated once, here: config validation (ddrl.config.validate_sampler) and every
sampler entry point (generate, the registry samplers, dream_generate) call the same check_sampler, so
a bad value gives the same message wherever it is caught, before any model call. The choice lists
come from the modules that own them.

Checks that need the model (its vocabulary, block size, maximum length) run in the samplers, with
the model at hand; check_sampler takes the block size when it is known. Which sampler fits which
model is decided here too (`resolve_sampler`): rollout.name=auto picks the family's own, and an
explicit one the model cannot run is refused with the right name, where the trainer, `ddrl eval`
and `ddrl sample` pick their sampler.

Messages name a setting as the caller spells it: key "rollout" gives "rollout.block_length",
key "" the bare field, and key FLAGS ("--") the command line's "--block-length".
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from ddrl.contract import model_view
from ddrl.registry import SAMPLERS
from ddrl.sampling.cache import CACHE_MODES
from ddrl.sampling.commit import REMASKING
from ddrl.sampling.dream import ALGS
from ddrl.sampling.released import RELEASED, RNG_LAYOUTS
from ddrl.sampling.utils import NOISE_DTYPES

AUTO = "auto"  # rollout.name: the model's own sampler (resolve_sampler)
FLAGS = "--"  # check_sampler's key for `ddrl eval` / `ddrl sample`: settings named as flags
SEMI_AR = ("masked", "block", "emerge")  # the block-by-block samplers of ddrl.sampling.masked
# Settings a sampler does not read, refused when set (so a config never silently ignores one).
NOT_APPLICABLE: dict[str, tuple[str, ...]] = {
    "emerge": ("threshold", "factor"),
    "dream": ("block_length", "threshold", "factor", "cfg_scale", "cache"),
    "diffusion_gemma": ("threshold", "factor", "cfg_scale", "cache"),
    "metric_path": ("block_length", "threshold", "factor", "cache"),
}
WHY_NOT = {
    "emerge": "the emerge sampler unmasks at random by its schedule",
    "dream": "it decodes the whole completion each step, without cache or guidance",
    "diffusion_gemma": "it denoises one canvas by its own schedule, without cache or guidance",
    "metric_path": "URSA's CTMC updates every image token at every step, without blocks or cache",
}


# What a field a duck-typed config lacks means (SamplerConfig's defaults, where they are "off").
DEFAULTS: dict[str, Any] = {"block_length": None, "temperature": 0.0, "cfg_scale": 0.0, "remasking": "low_confidence",
                            "threshold": None, "factor": None, "cache": "auto", "alg": "entropy", "alg_temp": None,
                            "top_p": None, "top_k": None, "noise_dtype": "float32", "compile": False, "rng": "ddrl",
                            "batch_rows": None}


def _get(cfg: Any, field: str) -> Any:
    return getattr(cfg, field, DEFAULTS.get(field))


def _is_set(cfg: Any, field: str) -> bool:
    """Whether an optional setting is on (cache: anything but the reference's none/auto)."""
    value = _get(cfg, field)
    if field in ("cfg_scale", "compile"):
        return bool(value)
    if field == "cache":
        return value not in (None, "none", "auto")
    return value is not None


def speed_settings(cfg: Any) -> list[str]:
    """The settings that make a sampler decode faster than its reference (cache=none, one commit rule
    without threshold or factor): a prefix/dual cache, threshold or factor decoding; empty = the reference.
    cache=auto is not one: it is the exact cache on block-causal models and none elsewhere."""
    return [f"{f}={_get(cfg, f)}" for f in ("cache", "threshold", "factor") if _is_set(cfg, f)]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_sampler(cfg: Any, key: str = "rollout", *, name: str | None = None, block_size: int | None = None) -> None:
    """Validate sampler settings: choices, bounds, and the combinations the sampler accepts.

    cfg         a SamplerConfig, or anything with its fields (generate() passes its keywords);
                optional fields it lacks (factor, alg, top_k, noise_dtype ...) take their defaults.
    key         the config section the messages name ("rollout", "sampler"); "" for keywords.
    name        the sampler (default cfg.name, checked against the registry).
    block_size  the model's block size when it is known and block-causal: the block sampler's block
                length; the completion need not be whole blocks; prefix/dual need whole model blocks.
    Raises ValueError with the key and the fix.
    """
    if key == FLAGS:  # the same checks, the settings named as the command line's flags
        try:
            check_sampler(cfg, _FLAG_MARK, name=name, block_size=block_size)
        except ValueError as e:
            raise ValueError(_as_flags(str(e))) from None
        return
    p = f"{key}." if key else ""
    if name is None:
        name = cfg.name
        if name not in SAMPLERS and name != AUTO:
            raise ValueError(f"{p}name={name!r} is not valid; choose one of: {AUTO}, {', '.join(SAMPLERS.names())}")
    for field in ("steps", "gen_length"):
        if not _positive_int(getattr(cfg, field)):
            raise ValueError(f"{p}{field} must be a positive integer, got {getattr(cfg, field)!r}")
    batch_rows = _get(cfg, "batch_rows")
    if batch_rows is not None and not _positive_int(batch_rows):
        raise ValueError(f"{p}batch_rows must be a positive number of rows per sampler call (1 = one row at a "
                         f"time, as MaskGRPO's generation_batch_size) or unset for all rows in one call, "
                         f"got {batch_rows!r}")
    block_length = _get(cfg, "block_length")
    if block_length is not None and not _positive_int(block_length):
        raise ValueError(f"{p}block_length must be a positive integer or unset (one block), got {block_length!r}")
    if _get(cfg, "temperature") < 0:
        raise ValueError(f"{p}temperature must be >= 0 (0 = greedy), got {_get(cfg, 'temperature')}")
    if _get(cfg, "cfg_scale") < 0:
        raise ValueError(f"{p}cfg_scale must be >= 0 (0 = no guidance), got {_get(cfg, 'cfg_scale')}")
    if not isinstance(_get(cfg, "compile"), bool):
        raise ValueError(f"{p}compile must be true or false, got {_get(cfg, 'compile')!r}")
    if _get(cfg, "compile") and _get(cfg, "cache") == "prefix":  # ddrl.sampling.cache "Compiled steps"
        raise ValueError(f"{p}compile needs call shapes that do not change block by block, but {p}cache='prefix' "
                         f"feeds a shorter suffix every block (a recompile per block); use {p}cache=dual or auto")
    _check_choices(cfg, p)
    _check_released(cfg, p, name)
    _check_parallel_decoding(cfg, p, name)
    top_p, top_k, alg_temp = _get(cfg, "top_p"), _get(cfg, "top_k"), _get(cfg, "alg_temp")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"{p}top_p must be in (0, 1] or unset, got {top_p}")
    if top_k is not None and not _positive_int(top_k):
        raise ValueError(f"{p}top_k must be a positive integer or unset, got {top_k!r}")
    if alg_temp is not None and alg_temp < 0:
        raise ValueError(f"{p}alg_temp must be >= 0 or unset, got {alg_temp}")
    for field in NOT_APPLICABLE.get(name, ()):
        if _is_set(cfg, field):
            raise ValueError(f"{p}{field} does not apply to the {name} sampler ({WHY_NOT[name]}); unset it")
    if _is_set(cfg, "compile") and name not in (*SEMI_AR, AUTO):  # the samplers that run ddrl.sampling.cache
        raise ValueError(f"{p}compile does not apply to the {name} sampler (only the masked, block and emerge "
                         f"samplers compile their decode step); unset it")
    if name == "dream" and _get(cfg, "alg") == "origin" and alg_temp:
        raise ValueError(f"{p}alg_temp applies to the confidence orderings; alg='origin' commits at random by the "
                         f"schedule, so unset {p}alg_temp")
    # auto with a block_length: the semi-AR samplers' checks (a Dream or uniform model that resolves to
    # another sampler is refused its block_length by that sampler's own check)
    if name in SEMI_AR or (name == AUTO and _get(cfg, "block_length") is not None):
        _check_blocks(cfg, p, name, block_size)


def _check_choices(cfg: Any, p: str) -> None:
    choices = (("remasking", REMASKING, "valid"), ("cache", CACHE_MODES, "valid"),
               ("alg", ALGS, "one of Dream's orderings"), ("noise_dtype", tuple(NOISE_DTYPES), "valid"),
               ("rng", RNG_LAYOUTS, "a valid random-number layout"))
    for field, valid, what in choices:
        value = _get(cfg, field)
        if value not in valid:
            raise ValueError(f"{p}{field}={value!r} is not {what}; choose one of: {', '.join(valid)}")


def _check_released(cfg: Any, p: str, name: str) -> None:
    """rng=released (ddrl.sampling.released): MaskGRPO's t2i emerge draws, one block, torch.multinomial in
    the probabilities' dtype. Which model may run it is checked by the sampler (check_released_model)."""
    if _get(cfg, "rng") != RELEASED:
        return
    if name not in ("emerge", AUTO):  # auto: refused here after resolve_sampler, if it picks another
        raise ValueError(f"{p}rng='released' is implemented by the emerge sampler only (MaskGRPO's text-to-image "
                         f"rollouts); the {name} sampler draws with ddrl's layout. Set {p}rng=ddrl or {p}name=emerge")
    block_length = _get(cfg, "block_length")
    if block_length is not None and block_length != cfg.gen_length:
        raise ValueError(f"{p}rng='released' decodes the completion as one block, as MaskGRPO's t2i_generate_emerge; "
                         f"{p}block_length={block_length} splits it: unset {p}block_length")
    if _get(cfg, "noise_dtype") != "float32":
        raise ValueError(f"{p}noise_dtype applies to ddrl's layout; rng='released' draws with torch.multinomial in "
                         f"the probabilities' dtype, as the authors do: unset {p}noise_dtype")


def _check_parallel_decoding(cfg: Any, p: str, name: str) -> None:
    """threshold in (0, 1] (the same bound everywhere), factor > 0, one of them; the masked and block
    samplers' sdar_dynamic rule needs a threshold (the others do not read remasking)."""
    threshold, factor = _get(cfg, "threshold"), _get(cfg, "factor")
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"{p}threshold must be in (0, 1] (0.9 is typical) or unset for fixed counts, got {threshold}")
    if factor is not None and not factor > 0:
        raise ValueError(f"{p}factor must be > 0 (Fast-dLLM's f, e.g. 1.0) or unset, got {factor}")
    sdar = name in ("masked", "block", AUTO) and _get(cfg, "remasking") == "sdar_dynamic"
    if sdar and (threshold is None or factor is not None):
        raise ValueError(f"{p}remasking='sdar_dynamic' needs {p}threshold (SDAR's confidence_threshold, e.g. 0.9) "
                         f"and no {p}factor, got threshold={threshold}, factor={factor}")
    if threshold is not None and factor is not None:
        raise ValueError(f"{p}threshold={threshold} and {p}factor={factor} are two parallel-decoding rules; set only "
                         f"one of them")


def _check_blocks(cfg: Any, p: str, name: str, block_size: int | None) -> None:
    """Block length, divisibility and steps per block of the block-by-block samplers."""
    block_length, gen_length, steps, cache = _get(cfg, "block_length"), cfg.gen_length, cfg.steps, _get(cfg, "cache")
    if name == "block":
        if block_size is None:
            return  # the model's block size decides; checked when the sampler runs
        if block_length is not None and block_length != block_size:
            raise ValueError(f"{p}block_length={block_length} differs from the model's block size {block_size} "
                             f"(the block sampler decodes the model's blocks); set {p}block_length={block_size} "
                             f"or leave it unset")
        block = block_size
    else:
        block = block_length or gen_length
    # A block model's blocks follow positions (ddrl.processes.block), so its completion need not be
    # whole blocks: SDAR decodes up to a block boundary of prompt + completion.
    if not block_size and gen_length % block:
        raise ValueError(f"{p}gen_length={gen_length} is not divisible by {p}block_length={block}; "
                         f"pick a block_length that divides gen_length")
    # The rules that divide steps over blocks: fixed counts, SDAR's dynamic rule and emerge.
    counts_steps = name == "emerge" or _get(cfg, "remasking") == "sdar_dynamic" or (
        _get(cfg, "threshold") is None and _get(cfg, "factor") is None)
    num_blocks = -(-gen_length // block)
    if counts_steps and steps % num_blocks:
        raise ValueError(f"{p}steps={steps} is not divisible by the number of blocks ({p}gen_length/"
                         f"{p}block_length = {num_blocks}); use a multiple of {num_blocks}")
    if block_size and cache in ("prefix", "dual") and block % block_size:
        raise ValueError(f"{p}cache={cache!r} on a block-causal model needs sampler blocks made of whole model "
                         f"blocks, but block_length={block} is not a multiple of model.block_size={block_size}; "
                         f"use block_length={block_size} (the 'block' sampler) or {p}cache=none")


_FLAG_MARK = "\x00flag"  # an internal key: its "\x00flag.<field>" names become "--<field>" (_as_flags)
_FLAG_NAMES = {"name": "sampler"}  # fields whose flag is not the field's own name (cli._sampler_args)


def _as_flags(message: str) -> str:
    """check_sampler's message with every "\x00flag.<field>" written as the flag: --block-length."""
    def flag(m: re.Match) -> str:
        return "--" + _FLAG_NAMES.get(m.group(1), m.group(1)).replace("_", "-")

    return re.sub(re.escape(_FLAG_MARK) + r"\.(\w+)", flag, message)


def setting(key: str, field: str) -> str:
    """How the caller spells a sampler setting: rollout.threshold, threshold or --threshold."""
    if key == FLAGS:
        return "--" + _FLAG_NAMES.get(field, field).replace("_", "-")
    return f"{key}.{field}" if key else field


# --------------------------------------------------------------------------------------------
# Which sampler fits the model (rollout.name=auto and explicit names)
# --------------------------------------------------------------------------------------------


def model_samplers(model: Any) -> tuple[str, ...]:
    """The samplers that decode this model as it was trained, its family's own first (the one
    rollout.name=auto picks): the model's own `samplers` (ddrl.models.families.FamilyFacts.samplers,
    else its process's: ddrl.contract.PROCESS_SAMPLERS); a bare denoiser's by its layout."""
    return model_view(model).samplers


def resolve_sampler(model: Any, name: str, key: str = "rollout") -> str:
    """The sampler to run: `name`, or the model's own for "auto". A registered sampler the model
    cannot run is an error that names the one it can (before any compute); key as in check_sampler."""
    fits = model_samplers(model)
    if name == AUTO:
        return fits[0]
    if name in SAMPLERS and name not in fits:
        family = model_view(model).family or "this"
        spell = setting(key, "name")
        options = " or ".join(repr(n) for n in (AUTO,) + fits)
        raise ValueError(f"{spell}={name!r} does not fit this {family} model, which decodes with the "
                         f"{fits[0]!r} sampler; set {spell} to {options}")
    return name


# --------------------------------------------------------------------------------------------
# Inputs (prompts, generator): shared by the samplers
# --------------------------------------------------------------------------------------------


def check_prompts(prompt_ids: Tensor, attention_mask: Tensor | None) -> None:
    """prompt_ids must be a [B, P] integer tensor and attention_mask None or of the same shape."""
    integer = isinstance(prompt_ids, Tensor) and prompt_ids.dtype in (torch.int64, torch.int32)
    if not integer or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be a [B, P] integer tensor of token ids, got "
                         f"{getattr(prompt_ids, 'dtype', type(prompt_ids))} {list(getattr(prompt_ids, 'shape', []))}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(prompt_ids.shape):
        raise ValueError(f"attention_mask must have prompt_ids' shape {list(prompt_ids.shape)} (1 = real token, "
                         f"0 = left padding), got {list(attention_mask.shape)}")


def check_generator_given(generator: Any, needed: bool, why: str) -> None:
    """A sampler that draws needs an explicit generator (ddrl never uses the global RNG)."""
    if needed and generator is None:
        raise ValueError(f"generator is required when {why} (ddrl never uses the global RNG); "
                         f"pass generator=torch.Generator(device).manual_seed(seed)")
