"""rollout.compile: the decode step's model call under torch.compile gives the eager tokens, and
compiles a bounded number of graphs (issue 27, item 5).

The sampler keeps every call's shapes fixed per block (ddrl.sampling.masked "Static shapes"), so a
compiled step is compiled once per call shape: no cache and the dual cache have two shapes at most
(a block's first call and its later ones) whatever the number of blocks; the exact block cache's
past grows block by block and is compiled with dynamo's automatic dynamic shapes (recompiled with
symbolic sizes, then no more as blocks go by). The prefix cache feeds a shorter suffix every block
and kept recompiling per block, so compile refuses it. A second generation compiles nothing.

Backend: aot_eager (dynamo's graph capture and AOTAutograd's functionalisation, run eagerly). The
default inductor backend gave the same tokens on the LLaDA fixture (greedy; none, prefix and
dual, checked by hand), but compiling C++ kernels on this CPU takes 30-100 s per cache mode, too
long for the unit suite. On CUDA the sampler asks for mode="reduce-overhead" (CUDA graphs).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import ddrl
from ddrl.config import SamplerConfig
from ddrl.sampling.masked import sample_block, sample_masked

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture
def compile_calls(monkeypatch):
    """torch.compile with the aot_eager backend; records the options the sampler asked for."""
    torch._dynamo.reset()
    counters.clear()
    calls: list[dict] = []
    real = torch.compile

    def recording(model, **options):
        calls.append(options)
        return real(model, **{**options, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", recording)
    yield calls
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def prompts(model) -> tuple[torch.Tensor, torch.Tensor]:
    pad = model.pad_token_id
    ids = torch.tensor([[pad, pad, 5, 6, 7], [8, 9, 10, 11, 12]])
    return ids, ids != pad


@pytest.mark.parametrize("family, sampler, cache, most_graphs", [
    ("llada", sample_masked, "none", 1),
    ("llada", sample_masked, "dual", 2),
    # The exact block cache: block 0's call without past, the first calls of later blocks (with past and
    # use_cache) and the other calls, each compiled static, then once with dynamic sizes (7 with 8 blocks too).
    ("sdar", sample_block, "auto", 7),
])
def test_compiled_steps_give_the_eager_tokens_and_compile_a_few_graphs(compile_calls, family, sampler, cache,
                                                                      most_graphs):
    model = ddrl.load_model(FIXTURES / family / "model", dtype=torch.float32).eval()
    ids, mask = prompts(model)
    block = 4  # 4 blocks (SDAR's fixture: block_size 4; its padded row decodes 5): a per-block compile would show
    for temperature in (0.0, 1.0):  # greedy, then seeded sampling
        cfg = SamplerConfig(steps=16, gen_length=16, block_length=block, temperature=temperature, cache=cache,
                            early_exit=False)
        eager = sampler(model, ids, mask, cfg, generator=torch.Generator().manual_seed(3))
        before = graphs()
        compiled = sampler(model, ids, mask, SamplerConfig(**{**vars(cfg), "compile": True}),
                           generator=torch.Generator().manual_seed(3))
        assert torch.equal(compiled.completion_ids, eager.completion_ids), (temperature, cache)
        assert compiled.nfe == eager.nfe
        if temperature == 0.0:
            assert 0 < graphs() - before <= most_graphs, graphs() - before  # compiled, and a few graphs only
        else:
            assert graphs() == before  # a second generation of the same shapes compiles nothing
    assert compile_calls and all(c.get("mode") is None for c in compile_calls)  # CPU: the default mode
    static = cache != "auto"  # the exact block cache's past grows block by block
    assert all(c["dynamic"] is (False if static else None) for c in compile_calls)


def test_compile_is_refused_where_no_step_is_compiled():
    from ddrl.sampling.checks import check_sampler

    with pytest.raises(ValueError, match="rollout.compile does not apply to the dream sampler"):
        check_sampler(SamplerConfig(name="dream", compile=True), "rollout")
    with pytest.raises(ValueError, match="rollout.cache='prefix' feeds a shorter suffix every block"):
        check_sampler(SamplerConfig(name="masked", compile=True, cache="prefix"), "rollout")
    with pytest.raises(ValueError, match="rollout.compile must be true or false"):
        check_sampler(SamplerConfig(name="masked", compile="yes"), "rollout")  # type: ignore[arg-type]
