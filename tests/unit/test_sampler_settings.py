"""Each sampler's settings dataclass (ddrl.sampling.settings) says which rollout keys it reads: a key set
for a sampler that does not read it is refused, naming the sampler, the key and why, at config load for
an explicit name and once the model is known for rollout.name=auto."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from ddrl.config import ConfigError, RLConfig, SamplerConfig, load_config, validate_sampler
from ddrl.registry import SAMPLERS
from ddrl.sampling.checks import check_sampler
from ddrl.sampling.dream import DreamSettings
from ddrl.sampling.masked import MaskedSettings
from ddrl.sampling.settings import OFF, SamplerSettings, known_settings, settings_class

KEYS = [f.name for f in dataclasses.fields(SamplerConfig) if f.name != "name"]
BASE = dict(steps=8, gen_length=8)  # sizes every sampler accepts
# A value of each key that is on (not its default) and valid on its own for a sampler that reads it.
ON = dict(steps=4, gen_length=4, block_length=4, temperature=0.5, cfg_scale=1.0, remasking="random", threshold=0.9,
          cache="prefix", compile=True, factor=1.0, early_exit=False, max_prompt_length=4, noise_dtype="float64",
          rng="released", batch_rows=2, alg="origin", alg_temp=0.5, top_p=0.9, top_k=5)


def test_every_sampler_declares_the_settings_it_reads():
    assert set(ON) == set(KEYS), "a new rollout key needs an 'on' value here"
    for name in SAMPLERS.names():
        cls = settings_class(name)
        assert cls is not None and issubclass(cls, SamplerSettings) and dataclasses.is_dataclass(cls), name
        assert cls.why_not != SamplerSettings.why_not, f"{name}: say why it reads no other setting (why_not)"


def test_every_key_is_read_by_a_sampler_with_the_yaml_default():
    """An unset YAML key is "off" for every sampler, and no key is read by none."""
    yaml_defaults = {f.name: f.default for f in dataclasses.fields(SamplerConfig)}
    readers: dict[str, list[str]] = {}
    for name in SAMPLERS.names():
        for f in dataclasses.fields(settings_class(name)):
            readers.setdefault(f.name, []).append(name)
            if f.name in yaml_defaults:
                assert f.default == yaml_defaults[f.name], f"{name}.{f.name}: default {f.default!r} is not the YAML's"
            shared = known_settings()[f.name]
            assert f.default == shared.default and f.metadata.get(OFF) is shared.metadata.get(OFF), f"{name}.{f.name}"
    assert not [k for k in KEYS if k not in readers], "rollout keys no sampler reads"


@pytest.mark.parametrize("name", sorted(SAMPLERS.names()))
def test_a_key_is_refused_exactly_by_the_samplers_that_do_not_read_it(name):
    cls = settings_class(name)
    read = {f.name for f in dataclasses.fields(cls)}
    for key in KEYS:
        cfg = SamplerConfig(name=name, **{**BASE, key: ON[key]})
        if key in read:
            validate_sampler(cfg)  # read: accepted at load
            continue
        with pytest.raises(ConfigError) as at_load:
            validate_sampler(cfg)
        with pytest.raises(ValueError) as checked:
            check_sampler(cfg, "rollout")
        message = str(at_load.value)
        assert message == str(checked.value) and f"rollout.{key}" in message and f"the {name} sampler" in message
        assert cls.why_not in message or key == "rng", message  # rng says it in its own words


def test_off_values_are_not_set():
    """What a sampler without the feature does is no setting: cache none, one block of the whole completion."""
    validate_sampler(SamplerConfig(name="dream", cache="none", block_length=8, **BASE))
    with pytest.raises(ConfigError, match="rollout.block_length does not apply to the dream sampler"):
        validate_sampler(SamplerConfig(name="dream", block_length=4, **BASE))


def test_auto_checks_values_at_load_and_keys_once_the_sampler_is_known():
    cfg = load_config({"rollout": {"alg_temp": 0.5, **BASE}}, cls=RLConfig)  # auto: a Dream model may read it
    with pytest.raises(ValueError, match=r"rollout.alg_temp does not apply to the masked sampler \(it commits by"):
        check_sampler(cfg.rollout, "rollout", name="masked")  # what the trainer runs once auto is resolved
    check_sampler(cfg.rollout, "rollout", name="dream")
    with pytest.raises(ConfigError, match="rollout.alg_temp does not apply to the masked sampler"):
        load_config({"rollout": {"name": "masked", "alg_temp": 0.5, **BASE}}, cls=RLConfig)
    with pytest.raises(ConfigError, match="rollout.alg_temp must be >= 0"):  # a bad value fails at load under auto
        load_config({"rollout": {"alg_temp": -1.0, **BASE}}, cls=RLConfig)


def test_a_sampler_reads_its_typed_settings_from_any_section():
    s = MaskedSettings.read(SamplerConfig(threshold=0.9, block_length=4, **BASE), name="masked")
    assert type(s) is MaskedSettings and (s.threshold, s.block_length, s.steps) == (0.9, 4, 8)
    duck = SimpleNamespace(steps=3, gen_length=3, eps=0.01, vocab_limit=7)  # missing fields take the defaults;
    d = DreamSettings.read(duck, "", name="dream")  # settings that are no YAML key come from the section
    assert (d.steps, d.eps, d.vocab_limit, d.alg, d.top_p) == (3, 0.01, 7, "entropy", None)
    with pytest.raises(ValueError, match="^eps does not apply to the masked sampler"):
        MaskedSettings.read(duck, "", name="masked")
