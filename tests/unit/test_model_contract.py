"""The model contract in code (ddrl.contract): every registered family's model, built from its
tiny test fixture, is a DiffusionModel with typed attributes and the explicit scoring entry; image
models are ImageCodecs; and outside ddrl/models nothing compares family names or probes a model or
process by attribute name without a comment saying why."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import ddrl
import ddrl.sampling  # noqa: F401  (registers the samplers)
from ddrl.contract import (SCORING_ARGUMENTS, CapabilityError, DiffusionModel, ImageCodec, ModelView,
                                  model_view)
from ddrl.models.families import FAMILIES
from ddrl.ops.logprobs import TargetRequest
from ddrl.processes.base import ForwardProcess, ScheduledProcess
from ddrl.registry import SAMPLERS

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def _built_in(tmp: Path) -> Any:
    return ddrl.load_model(ROOT / "checkpoints" / "mini_sudoku-masked")


def _generic(tmp: Path) -> Any:
    from tests.unit.test_hf_models import write_tiny_model

    return ddrl.load_model(write_tiny_model(tmp / "generic"), trust_remote_code=True)


def _diffusion_gemma(tmp: Path) -> Any:
    from tests.unit.test_hf_models import write_tiny_diffusion_gemma

    return ddrl.load_model(write_tiny_diffusion_gemma(tmp / "dg"))


def _fixture(*parts: str) -> Callable[[Path], Any]:
    return lambda tmp: ddrl.load_model(FIXTURES.joinpath(*parts))


# Every family ddrl knows (FAMILIES, and "ddrl" for the built-in model) -> its model from a tiny fixture.
FAMILY_MODELS: dict[str, Callable[[Path], Any]] = {
    "ddrl": _built_in,
    "generic": _generic,
    "llada": _fixture("llada", "model"),
    "mmada": _fixture("mmada", "model"),
    "dream": _fixture("dream", "model"),
    "sdar": _fixture("sdar", "model"),
    "llada2": _fixture("llada2", "model-2.1"),
    "diffusion_gemma": _diffusion_gemma,
    "ursa": _fixture("ursa", "model"),
    "mdlm_dna": _fixture("sepo_dna", "tiny_mdlm_dna.ckpt"),
}


def test_every_family_has_a_fixture_model_checked_here():
    assert set(FAMILY_MODELS) == set(FAMILIES) | {"ddrl"}


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_every_family_model_satisfies_the_contract(family, tmp_path):
    model = FAMILY_MODELS[family](tmp_path).eval()
    assert isinstance(model, DiffusionModel) and model.family == family
    assert model.scoring_arguments == SCORING_ARGUMENTS
    assert model.samplers and all(name in SAMPLERS for name in model.samplers), model.samplers
    assert isinstance(model.process, ForwardProcess) and model.process.name == model.process_spec["name"]
    assert isinstance(model.mask_token_id, int) and 0 <= model.mask_token_id < model.vocab_size
    assert model.block_size is None or (isinstance(model.block_size, int) and model.block_size > 0)
    assert isinstance(model.completion_suffix, tuple) and isinstance(model.stop_token_ids, tuple)
    assert isinstance(model.logits_shifted, bool) and isinstance(model.attention, str)
    assert model.max_seq_len is None or model.max_seq_len > 0
    # The scoring entry: its keyword arguments, explicitly (not read off a signature).
    T = 2 + (model.canvas_length or 4)
    ids = torch.arange(T).remainder(min(model.vocab_size, 5))[None]  # [1, T]
    with torch.no_grad():
        full = model(ids).logits  # [1, T, V]
        kept = model(ids, logits_to_keep=2).logits  # [1, 2, V]
        lp = model(ids, logits_to_keep=2, targets=TargetRequest(ids[:, -2:], None, None)).target_logprobs  # [1, 2]
    assert full.shape == (1, T, model.vocab_size) and kept.shape == (1, 2, model.vocab_size)
    torch.testing.assert_close(kept, full[:, -2:])
    assert lp.shape == (1, 2) and bool(torch.isfinite(lp).all())


@pytest.mark.parametrize("family", ["ursa", "llada", "sdar"])
def test_image_models_are_image_codecs_and_text_models_are_not(family, tmp_path):
    model = FAMILY_MODELS[family](tmp_path)
    view = model_view(model)
    if family == "ursa":
        assert isinstance(model, ImageCodec) and view.image_codec is model and view.image_grid is model
        assert not isinstance(model.process, ScheduledProcess)  # the metric path: no NELBO, no alpha(t)
    else:
        assert view.image_codec is None and view.image_grid is None
        with pytest.raises(CapabilityError, match=rf"this {family} model has no canvas_length; load a Diff"):
            view.require("canvas_length", "load a DiffusionGemma checkpoint")
        with pytest.raises(CapabilityError, match="an image task needs a model with an image decoder") as err:
            ddrl.data.decode_image_ids(model, torch.zeros(1, 4, dtype=torch.long), (2, 2))
        assert err.value.capability == "image_codec"


def test_a_bare_denoiser_reads_as_the_documented_empty_values():
    view = ModelView(torch.nn.Linear(2, 2))
    assert (view.block_size, view.completion_suffix, view.process, view.family) == (None, (), None, None)
    assert view.samplers == ("masked", "emerge", "maskgit") and view.image_codec is None


# ------------------------------------------------------------------------- the source stays clean

PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:self\.)?(?:model|process|trainer\.model|inner|backbone)\s*,"
                   r"|\b(?:getattr|hasattr)\([^,()]*\.process\b")
FAMILY_NAMES = "|".join(sorted(set(FAMILIES) - {"generic"}))
# `family == "dream"`, `model.family in (...)`, `"dream" == family`: a comparison with the family itself.
FAMILY_COMPARISON = re.compile(rf"\bfamily\)?\s*(?:==|!=|\bnot in\b|\bin\b)\s*[\"'(\[{{]"
                               rf"|\"(?:{FAMILY_NAMES})\"\s*(?:==|!=|\bin\b)\s*[\w.]*family\b")


def _library_sources() -> list[Path]:
    return [p for p in sorted((ROOT / "ddrl").rglob("*.py")) if "models" not in p.relative_to(ROOT / "ddrl").parts[:1]]


def test_no_model_or_process_probe_outside_the_model_layer_without_a_reason():
    found = []
    for path in _library_sources():
        if path.parent.name == "rewards":  # a reward's `model` is its own scorer (CLIP, HPS), not a denoiser
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            commented = "#" in line or (i > 0 and lines[i - 1].lstrip().startswith("#"))
            if PROBE.search(line) and not commented:
                found.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not found, "read the model through ddrl.contract.model_view, or say why:\n" + "\n".join(found)


def test_no_family_name_comparison_outside_the_model_layer():
    found = [f"{p.relative_to(ROOT)}:{i + 1}: {line.strip()}" for p in _library_sources()
             for i, line in enumerate(p.read_text().splitlines()) if FAMILY_COMPARISON.search(line)]
    assert not found, "a family's behaviour belongs in ddrl.models (FamilyFacts, the model's attributes):\n" + \
        "\n".join(found)


def test_scoring_arguments_are_declared_by_the_class_not_forwarded():
    """The trainer's ModelHandle passes every keyword to its DiffusionLM, so it declares its arguments; a
    wrapper that only forwards attribute reads declares none and gets full logits (sliced by the caller)."""
    from ddrl.contract import scoring_arguments
    from ddrl.training.distributed import ModelHandle

    lm = _built_in(Path("."))

    class Forwarding(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

        def forward(self, input_ids, attention_mask=None):
            return self.inner(input_ids, attention_mask)

    assert scoring_arguments(lm) == SCORING_ARGUMENTS
    assert scoring_arguments(ModelHandle(lm, lm)) == SCORING_ARGUMENTS
    assert scoring_arguments(Forwarding(lm)) == frozenset()


def test_processes_state_their_abstract_methods():
    from ddrl.processes import ClassProcess, MaskedProcess, MetricPathProcess, UniformProcess

    for abstract in (ForwardProcess, ScheduledProcess, ClassProcess):
        with pytest.raises(TypeError, match="abstract"):
            abstract()
    assert ForwardProcess.__abstractmethods__ == {"noise", "pretrain_loss"}
    assert ScheduledProcess.__abstractmethods__ == {"noise", "pretrain_loss", "nelbo"}
    assert issubclass(MaskedProcess, ScheduledProcess) and issubclass(UniformProcess, ScheduledProcess)
    # The metric path is the uniform process's sibling: never asked for a NELBO, a schedule or a posterior.
    assert issubclass(MetricPathProcess, ClassProcess) and not issubclass(MetricPathProcess, ScheduledProcess)
    assert not any(hasattr(MetricPathProcess, name) for name in ("nelbo", "posterior", "schedule"))
