"""The emerge sampler's released RNG layout (rollout.rng=released, ddrl.sampling.released) against
MaskGRPO's own t2i_generate_emerge over its own MMaDA copy (tests/fixtures/methods/make_maskgrpo_emerge.py),
and model.t2i_attend_padding, the load option that lays prompts out as MaskGRPO's attended [iPAD] rows.

The tokens must be equal, not close: the same seed draws the same numbers in the same order."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import ddrl
import ddrl.sampling  # noqa: F401  (registers the samplers)
from ddrl.config import SamplerConfig
from ddrl.data import encode_prompts, pad_prompts, tokenize_prompts
from ddrl.processes.draws import RowGenerators
from ddrl.registry import SAMPLERS
from tests.fixtures.methods.method_common import load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = FIXTURES / "mmada_t2i" / "model"
G, META = load("maskgrpo_emerge")
S = META["settings"]
IPAD = 131


def magvit_dir(directory: Path) -> Path:
    """A MAGVIT-v2 directory (zero weights): loading needs one, these tests never decode."""
    from ddrl.models.native.magvit2 import MAGVITv2Decoder

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"_class_name": "MAGVITv2"}))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in MAGVITv2Decoder().state_dict().items()}
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, str(directory / "pytorch_model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def vq(tmp_path_factory) -> Path:
    return magvit_dir(tmp_path_factory.mktemp("magvit"))


@pytest.fixture(scope="module")
def model(vq):
    """The fixture's MMaDA as MaskGRPO runs it: [iPAD] padding attended (their LLaDA copy ignores the mask)."""
    m = ddrl.load_model(MODEL, dtype="float32", vq_path=vq, t2i_attend_padding=True).eval()
    m.tokenizer.max_text_len = S["max_text_len"]
    return m


def cfg(w: float, **kw) -> SamplerConfig:
    base = dict(name="emerge", steps=S["timesteps"], gen_length=S["image_tokens"], temperature=1.0, cfg_scale=w,
                cache="none", rng="released")
    return SamplerConfig(**{**base, **kw})


def emerge(model, config, generator):
    ids, mask = encode_prompts(model.tokenizer, S["prompts"])
    return SAMPLERS.get("emerge")(model, ids, mask, config, generator=generator).completion_ids


def test_prompt_rows_are_maskgrpo_s(model):
    ids, mask = encode_prompts(model.tokenizer, S["prompts"])
    assert mask.all() and torch.equal(ids, G["prompt_ids"][:, :ids.shape[1]])  # up to <|soi|>, padding real


@pytest.mark.parametrize("w", S["guidance"])
def test_released_tokens_equal_the_authors(model, w):
    got = emerge(model, cfg(w), torch.Generator().manual_seed(S["seed"]))
    assert torch.equal(got, G[f"tokens_w{w:g}"]), (got - 132).tolist()


@pytest.mark.parametrize("w", S["guidance"])
def test_each_row_generator_draws_what_their_call_on_its_rows_alone_draws(model, w):
    rows = RowGenerators([torch.Generator().manual_seed(S["seed"] + 1 + i) for i in range(2)], rows_per_generator=1)
    assert torch.equal(emerge(model, cfg(w), rows), G[f"alone_w{w:g}"])


def test_the_default_layout_is_ddrl_s_and_differs(model):
    assert SamplerConfig().rng == "ddrl"
    seed = torch.Generator().manual_seed(S["seed"])
    got = emerge(model, cfg(3.5, rng="ddrl"), seed)
    lo, hi = model.image_token_range
    assert ((got >= lo) & (got < hi)).all()
    assert not torch.equal(got, G["tokens_w3.5"])  # the option is what selects the authors' draws


def test_released_draws_follow_the_seed_at_other_temperatures(model):
    """Temperature 0: the argmax's one-hot, and the draws still decide which slots appear and when."""
    a = emerge(model, cfg(3.5, temperature=0.0), torch.Generator().manual_seed(1))
    b = emerge(model, cfg(3.5, temperature=0.0), torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="generator is required"):
        emerge(model, cfg(0.0, temperature=0.0), None)


def test_the_released_pace_is_their_float32_cosine():
    from ddrl.sampling.released import released_pace

    for s in range(12):  # cosine_schedule(torch.tensor(1.0 * s / 12)) = cos(t * pi * 0.5) in float32
        theirs = torch.cos(torch.tensor(1.0 * s / 12) * math.pi * 0.5)
        assert released_pace(s, 12).dtype == torch.float32 and torch.equal(released_pace(s, 12), theirs)


def test_a_t2i_mmada_emerges_at_maskgrpo_s_cosine_pace(model):
    from ddrl.sampling.commit import emerge_mask_fraction

    assert emerge_mask_fraction(model)(0.5) == pytest.approx(math.cos(math.pi / 4))
    text = ddrl.load_model(FIXTURES / "mmada" / "model", dtype="float32")
    assert emerge_mask_fraction(text)(0.5) == pytest.approx(0.5)  # a text MMaDA keeps its process's linear pace


@pytest.mark.parametrize("change, message", [
    (dict(name="masked"), "rng='released' is implemented by the emerge sampler only"),
    (dict(block_length=8), "one block"),
    (dict(noise_dtype="float64"), "noise_dtype applies to ddrl's layout"),
    (dict(rng="authors"), "rollout.rng='authors' is not a valid random-number layout"),
])
def test_released_settings_are_checked_before_compute(change, message):
    from ddrl.config import ConfigError, validate_sampler

    with pytest.raises(ConfigError, match=message):
        validate_sampler(cfg(0.0, **change))


def test_released_is_refused_on_text_completions():
    text = ddrl.load_model(FIXTURES / "mmada" / "model", dtype="float32")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="rollout.rng='released' reproduces MaskGRPO's text-to-image rollouts"):
        SAMPLERS.get("emerge")(text, ids, None, cfg(0.0, gen_length=4, steps=2),
                               generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------------
# model.t2i_attend_padding
# --------------------------------------------------------------------------------------------


def _trainer_load(path: Path, **model_keys):
    """The model `ddrl train` loads (Trainer._load_model) from a config with these model.* keys."""
    from ddrl.config import load_config
    from ddrl.training.trainer import Provided, Trainer

    overrides = [f"model.path={path}", "model.dtype=float32"] + [f"model.{k}={v}" for k, v in model_keys.items()]
    c = load_config(None, overrides)
    return Trainer._load_model(SimpleNamespace(cfg=c, _rank0_loading=False, provided=Provided()))


def _rollout_prompts(model):
    """The prompt ids and mask the trainer's rollout feeds the sampler (Trainer.rollout's tokenize + pad)."""
    rows = tokenize_prompts(model.tokenizer, ["a red cat", "dog"])
    return pad_prompts(rows, model.tokenizer.pad_token_id)


def test_the_key_chooses_the_prompt_mask_the_trainer_and_sampler_see(vq, tmp_path):
    masked = _trainer_load(MODEL, vq_path=vq)
    attended = _trainer_load(MODEL, vq_path=vq, t2i_attend_padding="true")
    ids, mask = _rollout_prompts(masked)
    assert not mask.all() and (ids[~mask] == IPAD).all()  # MMaDA's layout: the padding is masked
    ids, mask = _rollout_prompts(attended)
    width = attended.tokenizer.max_text_len + 2  # [iPAD].. <|t2i|> <bos> text <eos> <|soi|>
    assert mask.all() and ids.shape[1] == width and (ids[:, 0] == IPAD).all()  # MaskGRPO's rows, all attended
    attended.save_pretrained(tmp_path / "saved")  # a save records it, so a reload (ddrl eval) keeps it
    assert ddrl.load_model(tmp_path / "saved", dtype="float32").tokenizer.attend_padding is True
    again = ddrl.load_model(tmp_path / "saved", dtype="float32", t2i_attend_padding=False)
    assert again.tokenizer.attend_padding is False


@pytest.mark.parametrize("path, keys, where", [
    (FIXTURES / "mmada" / "model", {}, "'mmada' model loaded without vq_path"),
    (FIXTURES / "llada" / "model", {}, "'llada' model loaded without vq_path"),
    ("checkpoints/mini_sudoku-masked", {}, "built-in model"),
])
def test_the_key_is_refused_on_models_that_are_not_text_to_image_mmada(path, keys, where):
    root = Path(__file__).resolve().parents[2]
    path = path if Path(path).is_absolute() else root / path
    with pytest.raises(ValueError, match=f"model.t2i_attend_padding .*applies to a text-to-image MMaDA.*{where}"):
        _trainer_load(path, t2i_attend_padding="true", **keys)
