"""What each sampler reads: a settings dataclass, registered with the sampler.

    @register_sampler("masked", MaskedSettings)
    def sample_masked(model, prompt_ids, prompt_mask, cfg, *, generator, return_trajectory=False):
        s = MaskedSettings.read(cfg, "rollout", name="masked", block_size=...)   # checked, typed

A sampler's class declares exactly the settings the sampler reads, and checks their values:
SamplerSettings holds those every sampler takes (the sizes, the temperature, and the rollout's
early_exit, batch_rows and max_prompt_length), subclasses add their own. `read` builds it from a rollout
section (ddrl.config.SamplerConfig, which has every sampler's YAML keys, or anything with such
attributes; fields it lacks take the class's defaults) and refuses a key the class lacks when its value
is not "off": the setting's default, or what a sampler without the feature does (cache=none; a
block_length of the whole completion). The refusal names the sampler and says why: the class's
`why_not`, or the setting's own sentence (field metadata REFUSED). Which keys exist is the union of
the registered classes' fields (known_settings).

Messages name a setting as the caller spells it: p is "rollout." / "sampler." / "" (keywords).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

from ddrl.registry import SAMPLERS

OFF = "off"  # field metadata: (value, section) -> True when the value means "not used"; default: == the default
REFUSED = "refused"  # field metadata: the refusal in the setting's own words, a format string of p, name, value

S = TypeVar("S", bound="SamplerSettings")
F = TypeVar("F", bound=Callable[..., Any])


class NotRead(ValueError):
    """A setting is set that the sampler does not read."""


def one_block(value: Any, section: Any) -> bool:
    """block_length off: unset, or the whole completion (what a sampler without blocks decodes)."""
    return value is None or value == getattr(section, "gen_length", None)


def no_cache(value: Any, section: Any) -> bool:
    """cache off: the reference's none, or auto (the exact cache where there is one, else none)."""
    return value in ("auto", "none")


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_choice(p: str, name: str, value: Any, valid: tuple[str, ...], what: str = "valid") -> None:
    if value not in valid:
        raise ValueError(f"{p}{name}={value!r} is not {what}; choose one of: {', '.join(valid)}")


def check_block_length(p: str, block_length: int | None) -> None:
    if block_length is not None and not positive_int(block_length):
        raise ValueError(f"{p}block_length must be a positive integer or unset (one block), got {block_length!r}")


def check_threshold(p: str, threshold: float | None) -> None:
    """The confidence threshold's bound, the same for every sampler that reads one."""
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"{p}threshold must be in (0, 1] (0.9 is typical) or unset for fixed counts, got {threshold}")


@dataclass
class SamplerSettings:
    """The settings every sampler takes. Subclasses say, in `why_not`, why the sampler reads no other."""

    why_not: ClassVar[str] = "it does not read it"

    steps: int = 16  # model calls in total
    gen_length: int = 16  # completion tokens to generate
    temperature: float = 1.0  # 0 = greedy
    early_exit: bool = True  # stop spending compute on rows that produced a stop token (where the sampler can)
    batch_rows: int | None = None  # rows per sampler call (ddrl.sampling.base.sample_in_chunks)
    max_prompt_length: int | None = None  # the trainer and evaluation keep a longer prompt's last N tokens

    @classmethod
    def unread(cls, section: Any) -> list[tuple[str, Any]]:
        """(key, value) of the settings `section` sets that this class does not read."""
        declared = {f.name for f in dataclasses.fields(cls)}
        out = []
        for name, f in known_settings().items():
            value = getattr(section, name, f.default)
            off = f.metadata[OFF](value, section) if OFF in f.metadata else value == f.default
            if name not in declared and not off:
                out.append((name, value))
        return out

    @classmethod
    def read(cls: type[S], section: Any, key: str = "rollout", *, name: str, block_size: int | None = None) -> S:
        """The sampler's settings from a rollout section, checked: values, then keys it does not read.
        block_size: the model's block size when known (the block samplers check their blocks with it)."""
        p = f"{key}." if key else ""
        given = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if hasattr(section, f.name)}
        settings = cls(**given)
        settings.check(p, name, block_size)
        for setting, value in cls.unread(section):
            refused = known_settings()[setting].metadata.get(REFUSED)
            raise NotRead(refused.format(p=p, name=name, value=value) if refused else
                          f"{p}{setting} does not apply to the {name} sampler ({cls.why_not}); unset it")
        return settings

    def check(self, p: str, name: str, block_size: int | None) -> None:
        """The values' checks; each subclass checks the fields it adds (after super().check)."""
        for size in ("steps", "gen_length"):
            if not positive_int(getattr(self, size)):
                raise ValueError(f"{p}{size} must be a positive integer, got {getattr(self, size)!r}")
        if self.batch_rows is not None and not positive_int(self.batch_rows):
            raise ValueError(f"{p}batch_rows must be a positive number of rows per sampler call (1 = one row at a "
                             f"time, as MaskGRPO's generation_batch_size) or unset for all rows in one call, "
                             f"got {self.batch_rows!r}")
        if self.temperature < 0:
            raise ValueError(f"{p}temperature must be >= 0 (0 = greedy), got {self.temperature}")
        n = self.max_prompt_length
        if n is not None and not positive_int(n):
            raise ValueError(f"{p}max_prompt_length must be a positive number of tokens (each longer prompt keeps "
                             f"its last N), or null for no truncation; got {n!r}")


@dataclass
class GuidedSettings(SamplerSettings):
    """A sampler with classifier-free guidance."""

    cfg_scale: float = 0.0  # guidance weight w (0 = off)

    def check(self, p: str, name: str, block_size: int | None) -> None:
        super().check(p, name, block_size)
        if self.cfg_scale < 0:
            raise ValueError(f"{p}cfg_scale must be >= 0 (0 = no guidance), got {self.cfg_scale}")


@dataclass
class TokenFilters(SamplerSettings):
    """A sampler that filters the token distribution (Dream's sample_tokens, SDAR's dynamic rule)."""

    top_p: float | None = None  # nucleus filter; None = off
    top_k: int | None = None  # top-k filter; None = off

    def check(self, p: str, name: str, block_size: int | None) -> None:
        super().check(p, name, block_size)
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{p}top_p must be in (0, 1] or unset, got {self.top_p}")
        if self.top_k is not None and not positive_int(self.top_k):
            raise ValueError(f"{p}top_k must be a positive integer or unset, got {self.top_k!r}")


def register_sampler(name: str, settings: type[SamplerSettings]) -> Callable[[F], F]:
    """@register_sampler("name", ItsSettings): SAMPLERS.register, with the class of the settings it reads."""
    def add(fn: F) -> F:
        fn.settings = settings  # type: ignore[attr-defined]
        return SAMPLERS.register(name)(fn)

    return add


def settings_class(name: str) -> type[SamplerSettings] | None:
    """The settings class registered with a sampler; None for one registered without (SAMPLERS.register),
    whose settings go to it unchecked."""
    return getattr(SAMPLERS.get(name), "settings", None)


def known_settings() -> dict[str, dataclasses.Field]:
    """Every registered sampler's settings by name (the first class's field where several declare one;
    they share its default and off rule: tests/unit/test_sampler_settings.py)."""
    out: dict[str, dataclasses.Field] = {}
    for name in SAMPLERS.names():
        for f in dataclasses.fields(settings_class(name) or SamplerSettings):
            out.setdefault(f.name, f)
    return out
