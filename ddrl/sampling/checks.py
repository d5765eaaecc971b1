"""Sampler settings are validated once, by the sampler's own settings class (ddrl.sampling.settings):
config validation (ddrl.config.validate_sampler), `ddrl eval` / `ddrl sample` and every sampler entry
point read the section into that class, so a bad value or a key the sampler does not read gives the same
message wherever it is caught, before any model call.

Checks that need the model (its vocabulary, block size, maximum length) run in the samplers, with
the model at hand; check_sampler takes the block size when it is known. Which sampler fits which
model is decided here too (`resolve_sampler`): rollout.name=auto picks the family's own, and an
explicit one the model cannot run is refused with the right name, where the trainer, `ddrl eval`
and `ddrl sample` pick their sampler; the section is then checked against that sampler's class.

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
from ddrl.sampling.settings import settings_class

AUTO = "auto"  # rollout.name: the model's own sampler (resolve_sampler)
FLAGS = "--"  # check_sampler's key for `ddrl eval` / `ddrl sample`: settings named as flags


def speed_settings(cfg: Any) -> list[str]:
    """The settings that make a sampler decode faster than its reference (cache=none, one commit rule
    without threshold or factor): a prefix/dual cache, threshold or factor decoding; empty = the reference.
    cache=auto is not one: it is the exact cache on block-causal models and none elsewhere."""
    on = {"cache": getattr(cfg, "cache", None) not in (None, "none", "auto"),
          "threshold": getattr(cfg, "threshold", None) is not None, "factor": getattr(cfg, "factor", None) is not None}
    return [f"{f}={getattr(cfg, f)}" for f, is_on in on.items() if is_on]


def check_sampler(cfg: Any, key: str = "rollout", *, name: str | None = None, block_size: int | None = None) -> None:
    """Validate sampler settings with the sampler's settings class: its values, and no key set that it
    does not read (ddrl.sampling.settings).

    cfg         a SamplerConfig, or anything with its fields (fields it lacks take the class's defaults).
    key         the config section the messages name ("rollout", "sampler"); "" for keywords.
    name        the sampler (default cfg.name, checked against the registry). auto: the model is not known
                yet, so every sampler that reads all the keys set checks their values; the keys are checked
                against the model's own sampler once resolve_sampler has picked it.
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
    if name is None:
        name = cfg.name
        if name not in SAMPLERS and name != AUTO:
            p = f"{key}." if key else ""
            raise ValueError(f"{p}name={name!r} is not valid; choose one of: {AUTO}, {', '.join(SAMPLERS.names())}")
    for sampler in SAMPLERS.names() if name == AUTO else [name]:
        settings = settings_class(sampler)
        if settings is not None and (name != AUTO or not settings.unread(cfg)):
            settings.read(cfg, key, name=sampler, block_size=block_size)


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
