"""The masked samplers at GPU scale (issue 16), checked on the CPU.

What must hold:
  * the per-step noise is drawn where the model is, in float32, from generators seeded by the
    caller's; no [B, W, V] float64 tensor is made in a step (the reference's float64 softmax and
    uniforms are gone); rollout.noise_dtype=float64 brings float64 uniforms back;
  * one batched call over several groups with RowGenerators gives each group exactly what a call on
    that group alone gives, also when threshold decoding and early exit finish rows at different
    steps (the trainer's one sampler call per rank relies on it);
  * the model is asked for the current block's logits only, on the no-cache path too;
  * every call of a block sees the same rows and input shapes, finished rows included;
  * with fixed counts the loop reads nothing from the device per step (host syncs do not grow with
    the number of steps);
  * a bad setting gives the same message from config validation and from the sampler.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ddrl.config import SamplerConfig
from ddrl.models import Denoiser, DenoiserConfig, DiffusionLM
from ddrl.processes.draws import RowGenerators
from ddrl.sampling import masked as masked_module
from ddrl.sampling.masked import generate, sample_block, sample_emerge, sample_masked
from tests.toy_models import Output, ToyDiffusionLM

V, MASK, PAD, EOS = 24, 23, 0, 1
GROUPS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]  # one prompt per group, G rows each
G = 2


def left_pad(prompts: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    P = width or max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    return ids, mask


def builtin(block_size: int | None = None, seed: int = 1, init_std: float = 0.4) -> DiffusionLM:
    """A random built-in model; init_std 0.4 makes it confident enough for threshold decoding to vary."""
    backbone = Denoiser(DenoiserConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, max_seq_len=96,
                                       block_size=block_size, init_std=init_std), seed=seed)
    return DiffusionLM(backbone, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, vocab_size=V,
                       block_size=block_size, suppress_mask_logit=True).eval()


class Recorder(nn.Module):
    """Wraps a model: +bonus on EOS (rows finish at different blocks); records per call the input
    shape and what logits_to_keep asked for; passes the cache through."""

    scoring_arguments = frozenset({"logits_to_keep"})  # its forward takes it (ddrl.contract.ScoringModel)

    def __init__(self, model: DiffusionLM, bonus: float = 0.0):
        super().__init__()
        self.model, self.bonus = model, bonus
        self.calls: list[tuple[tuple[int, ...], object]] = []  # (input shape, logits_to_keep)
        for name in ("vocab_size", "mask_token_id", "eos_token_id", "pad_token_id", "block_size", "logits_shifted"):
            setattr(self, name, getattr(model, name))

    def forward(self, input_ids, attention_mask=None, logits_to_keep=None, **kwargs):
        keep = logits_to_keep.tolist() if isinstance(logits_to_keep, torch.Tensor) else logits_to_keep
        self.calls.append((tuple(input_ids.shape), keep))
        out = self.model(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep, **kwargs)
        logits = out.logits.clone()
        logits[..., EOS] += self.bonus
        return type(out)(logits=logits, past_key_values=out.past_key_values)


class OpLog(TorchDispatchMode):
    """Records every random op (name, shape, dtype, device, its generator's seed and device), every
    float64 output's size, and the ops that read a device value on the host."""

    RANDOM = {"uniform_", "rand", "randint", "exponential_", "bernoulli_", "normal_", "random_", "multinomial",
              "randn", "rand_like"}
    SYNC = {"_local_scalar_dense", "nonzero", "is_nonzero", "item"}

    def __init__(self):
        super().__init__()
        self.random: list[tuple] = []
        self.float64_sizes: list[int] = []
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in self.RANDOM:
            t = out if isinstance(out, torch.Tensor) else args[0]
            g = kwargs.get("generator")
            self.random.append((name, tuple(t.shape), t.dtype, t.device.type,
                                None if g is None else g.initial_seed(), None if g is None else g.device.type))
        if name in self.SYNC:
            self.syncs += 1
        self.float64_sizes += [t.numel() for t in tree_leaves(out)
                               if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
        return out


def group_generators(seeds=(11, 22, 33)) -> RowGenerators:
    return RowGenerators([torch.Generator().manual_seed(s) for s in seeds], G)


# --------------------------------------------------------------------------------------------
# Noise: on the model's device, float32, no [B, W, V] float64
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_noise_is_float32_drawn_where_the_model_is_and_nothing_big_is_float64(remasking):
    model = builtin(init_std=0.02)
    ids, mask = left_pad([p for p in GROUPS for _ in range(G)])
    B, W = ids.shape[0], 4
    with OpLog() as log:
        out, _ = generate(model, ids, mask, steps=4, gen_length=8, block_length=W, temperature=1.0,
                          remasking=remasking, mask_id=MASK, generator=group_generators(), return_trajectory=True)
    assert not (out == MASK).any()
    big = [r for r in log.random if len(r[1]) == 3]
    assert len(big) == 4 * len(GROUPS)  # per step, one [G, W, V] draw for each group's rows
    for name, shape, dtype, device, _, generator_device in big:
        assert (shape, dtype, device, generator_device) == ((G, W, V), torch.float32, "cpu", "cpu")
    # The caller's generators give one seed each, nothing else: the noise comes from device generators.
    from_callers = [r for r in log.random if r[4] in (11, 22, 33)]
    assert [torch.Size(r[1]).numel() for r in from_callers] == [1, 1, 1]
    assert max(log.float64_sizes, default=0) < B * W * V  # confidences are [B, W] float64, never [B, W, V]


def test_noise_dtype_float64_draws_float64_uniforms():
    model = builtin(init_std=0.02)
    ids, mask = left_pad(GROUPS)
    args = dict(steps=2, gen_length=4, block_length=4, temperature=1.0, mask_id=MASK)
    with OpLog() as log:
        a = generate(model, ids, mask, generator=torch.Generator().manual_seed(0), noise_dtype="float64", **args)
    assert {r[2] for r in log.random if len(r[1]) == 3} == {torch.float64}
    b = generate(model, ids, mask, generator=torch.Generator().manual_seed(0), noise_dtype="float64", **args)
    assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cpu_generator_drives_noise_drawn_on_the_gpu():
    model = builtin(init_std=0.02).cuda()
    ids, mask = left_pad(GROUPS)
    with OpLog() as log:
        generate(model, ids.cuda(), mask.cuda(), steps=2, gen_length=4, block_length=4, temperature=1.0,
                 mask_id=MASK, generator=torch.Generator().manual_seed(0))
    big = [r for r in log.random if len(r[1]) == 3]
    assert big and all(r[2:4] == (torch.float32, "cuda") and r[5] == "cuda" for r in big)


# --------------------------------------------------------------------------------------------
# Split invariance: a batched call over groups == one call per group
# --------------------------------------------------------------------------------------------


SPLIT_SETTINGS = {
    "threshold+early_exit": ("masked", None, dict(threshold=0.5, cache="none")),
    "threshold+dual+cfg": ("masked", None, dict(threshold=0.5, cache="dual", cfg_scale=0.5)),
    "factor": ("masked", None, dict(factor=0.5, cache="prefix")),
    "fixed+random": ("masked", None, dict(remasking="random")),
    "block+threshold": ("block", 4, dict(threshold=0.5, cache="auto", block_length=None)),
    "sdar_dynamic": ("block", 4, dict(threshold=0.7, remasking="sdar_dynamic", block_length=None, top_k=8)),
    "emerge": ("emerge", None, dict()),
}


@pytest.mark.parametrize("setting", list(SPLIT_SETTINGS))
def test_a_batched_call_over_groups_equals_one_call_per_group(setting):
    name, block_size, extra = SPLIT_SETTINGS[setting]
    model = Recorder(builtin(block_size=block_size), bonus=1.0)
    cfg = dataclasses.replace(SamplerConfig(name=name, steps=16, gen_length=16, block_length=4, temperature=1.0,
                                            early_exit=True), **extra)
    sampler = {"masked": sample_masked, "block": sample_block, "emerge": sample_emerge}[name]
    ids, mask = left_pad([p for p in GROUPS for _ in range(G)])  # every group padded to the batch's width
    batched = sampler(model, ids, mask, cfg, generator=group_generators())
    alone = []
    for g, seed in enumerate((11, 22, 33)):
        rows = slice(g * G, (g + 1) * G)
        alone.append(sampler(model, ids[rows], mask[rows], cfg, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(batched.completion_ids[rows], alone[-1].completion_ids), f"group {g}"
    if setting != "fixed+random" and name != "emerge":
        # rows finish their blocks at different steps: the groups alone make different numbers of calls
        assert len({a.nfe for a in alone} | {batched.nfe}) > 1
    assert (batched.completion_ids == EOS).any()  # early exit fired somewhere


def test_batched_fixed_count_trajectories_equal_the_groups_alone():
    """With fixed counts every group makes the same calls, so the whole trajectory is split-invariant too."""
    model = builtin()
    cfg = SamplerConfig(steps=8, gen_length=8, block_length=4, temperature=1.0, early_exit=False)
    ids, mask = left_pad([p for p in GROUPS for _ in range(G)])
    batched = sample_masked(model, ids, mask, cfg, generator=group_generators(), return_trajectory=True)
    for g, seed in enumerate((11, 22, 33)):
        rows = slice(g * G, (g + 1) * G)
        out = sample_masked(model, ids[rows], mask[rows], cfg, generator=torch.Generator().manual_seed(seed),
                            return_trajectory=True)
        assert torch.equal(batched.trajectory.commit_step[rows], out.trajectory.commit_step)
        torch.testing.assert_close(batched.trajectory.token_probs[rows], out.trajectory.token_probs, equal_nan=True)


class TableModel:
    """Row-independent logits from a random table (uniform process over ids 3..5; 6 is the mask)."""

    def __init__(self):
        from ddrl.processes import UniformProcess

        self.table = torch.randn(7, 7, generator=torch.Generator().manual_seed(0)) * 2
        self.process, self.vocab_size, self.mask_token_id = UniformProcess(3, offset=3), 7, 6

    def __call__(self, input_ids, attention_mask=None):
        return Output(logits=self.table[input_ids] + self.table[input_ids.roll(1, dims=1)])


def _split(run, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """run(ids, mask, generator) -> [rows, ...] tokens: a batched call with RowGenerators == one call per group."""
    batched = run(ids, mask, group_generators())
    for g, seed in enumerate((11, 22, 33)):
        rows = slice(g * G, (g + 1) * G)
        assert torch.equal(batched[rows], run(ids[rows], mask[rows], torch.Generator().manual_seed(seed))), g


def test_the_uniform_sampler_takes_row_generators():
    from ddrl.sampling.uniform import sample_uniform

    ids, mask = left_pad([[p % 3 for p in prompt] for prompt in GROUPS for _ in range(G)])
    cfg = SamplerConfig(name="uniform", steps=4, gen_length=5, temperature=1.0)
    _split(lambda i, m, g: sample_uniform(TableModel(), i, m, cfg, generator=g).completion_ids, ids, mask)


@pytest.mark.parametrize("alg,alg_temp", [("origin", None), ("maskgit_plus", 0.5)])
def test_the_dream_sampler_takes_row_generators(alg, alg_temp):
    from ddrl.sampling.dream import dream_generate

    model = ToyKeep(vocab_size=V, mask_token_id=MASK).eval()
    ids, mask = left_pad([p for p in GROUPS for _ in range(G)])
    _split(lambda i, m, g: dream_generate(model, i, m, steps=4, gen_length=8, alg=alg, alg_temp=alg_temp,
                                          temperature=1.0, generator=g), ids, mask)


def test_the_diffusion_gemma_sampler_takes_row_generators(tmp_path):
    from ddrl.models import load_model
    from ddrl.sampling.diffusion_gemma import diffusion_gemma_generate
    from tests.unit.test_hf_models import write_tiny_diffusion_gemma

    model = load_model(write_tiny_diffusion_gemma(tmp_path / "dg", vocab_size=48)).eval()
    ids, mask = left_pad([p for p in GROUPS for _ in range(G)])
    _split(lambda i, m, g: diffusion_gemma_generate(model, i, m, steps=4, generator=g)[0], ids, mask)


def test_row_generators_must_cover_the_batch():
    ids, mask = left_pad(GROUPS)
    with pytest.raises(ValueError, match="RowGenerators covers 6 rows"):
        generate(builtin(), ids, mask, steps=2, gen_length=4, block_length=4, temperature=1.0, mask_id=MASK,
                 generator=group_generators())


# --------------------------------------------------------------------------------------------
# The current block only, at fixed shapes
# --------------------------------------------------------------------------------------------


def test_the_no_cache_path_asks_the_model_for_the_current_block_only():
    model = Recorder(builtin(init_std=0.02))
    ids, mask = left_pad(GROUPS)
    P = ids.shape[1]
    generate(model, ids, mask, steps=4, gen_length=8, block_length=4, mask_id=MASK)
    blocks = [list(range(P, P + 4))] * 2 + [list(range(P + 4, P + 8))] * 2
    assert [keep for _, keep in model.calls] == blocks


@pytest.mark.parametrize("block_size,cache", [(None, "prefix"), (None, "dual"), (4, "none"), (4, "auto")])
def test_every_call_asks_for_block_length_positions(block_size, cache):
    model = Recorder(builtin(block_size=block_size, init_std=0.02))
    ids, mask = left_pad(GROUPS)
    fn = sample_block if block_size else sample_masked
    fn(model, ids, mask, SamplerConfig(steps=8, gen_length=8, block_length=None if block_size else 4,
                                       temperature=0.0, cache=cache, early_exit=False), generator=None)
    widths = [keep if isinstance(keep, int) else len(keep) for _, keep in model.calls]
    assert max(widths) == 4 and set(widths) <= {1, 2, 3, 4}  # a block model's last window may be partial


def _calls_per_block(model: Recorder, monkeypatch):
    """Marks each block start in model.calls (the strategy's begin_block); -> a function giving the
    input shapes of the calls of each block."""
    original = masked_module.block_forward
    marks: list[int] = []

    def marked(*args, **kwargs):
        strategy = original(*args, **kwargs)
        begin = strategy.begin_block

        def begin_block(start, end):
            marks.append(len(model.calls))
            begin(start, end)

        strategy.begin_block = begin_block
        return strategy

    monkeypatch.setattr(masked_module, "block_forward", marked)
    return lambda: [[shape for shape, _ in model.calls[a:b]] for a, b in zip(marks, marks[1:] + [len(model.calls)])]


@pytest.mark.parametrize("block_size,cache", [(None, "none"), (None, "prefix"), (None, "dual"), (4, "none"),
                                              (4, "auto")])
def test_every_step_of_a_block_feeds_the_same_shape_while_rows_finish(block_size, cache, monkeypatch):
    model = Recorder(builtin(block_size=block_size), bonus=1.0)
    blocks = _calls_per_block(model, monkeypatch)
    ids, mask = left_pad([p for p in GROUPS for _ in range(G)])
    cfg = SamplerConfig(steps=16, gen_length=16, block_length=None if block_size else 4, temperature=1.0,
                        threshold=0.5, cache=cache, cfg_scale=0.5, early_exit=True)
    out = (sample_block if block_size else sample_masked)(model, ids, mask, cfg, generator=group_generators(),
                                                         return_trajectory=True)
    filled = (out.trajectory.commit_step == -1).sum(dim=1)  # positions early exit filled with EOS, per row
    assert (filled > 0).sum() >= 2 and len(set(filled.tolist())) > 1  # rows do finish, at different blocks
    per_block = [b for b in blocks() if b]
    assert all(rows == 2 * ids.shape[0] for b in per_block for rows, _ in b)  # guided: 2B rows, every call
    assert any(len(b) > 2 for b in per_block)  # blocks of several steps
    for b in per_block:
        assert len(set(b[1:])) <= 1, b  # the first step of a cached block feeds more; the rest one shape
    if cache == "none":
        assert len({shape for b in per_block for shape in b}) == 1  # one shape for the whole generation


# --------------------------------------------------------------------------------------------
# Host reads
# --------------------------------------------------------------------------------------------


class ToyKeep(ToyDiffusionLM):
    """The toy model, taking logits_to_keep itself (no host read), so that the count is the sampler's."""

    scoring_arguments = frozenset({"logits_to_keep"})  # ddrl.contract.ScoringModel

    def forward(self, input_ids, attention_mask=None, logits_to_keep=None):
        logits = super().forward(input_ids, attention_mask).logits
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return Output(logits=logits)


@pytest.mark.parametrize("emerge", [False, True])
def test_fixed_step_loops_read_nothing_from_the_device_per_step(emerge):
    model = ToyKeep(vocab_size=12, mask_token_id=11, seed=0).eval()
    ids, mask = left_pad([[2, 3, 4], [5, 6, 7, 8, 9]])
    counts = []
    for steps in (2, 8):
        with OpLog() as log:
            if emerge:
                sample_emerge(model, ids, mask, SamplerConfig(steps=steps, gen_length=8, block_length=8,
                                                              temperature=1.0, early_exit=False),
                              generator=torch.Generator().manual_seed(0), return_trajectory=True)
            else:
                generate(model, ids, mask, steps=steps, gen_length=8, block_length=8, temperature=1.0, mask_id=11,
                         generator=torch.Generator().manual_seed(0), return_trajectory=True)
        counts.append(log.syncs)
    assert counts[0] == counts[1], counts


def test_threshold_decoding_reads_one_flag_per_step():
    model = ToyKeep(vocab_size=12, mask_token_id=11, seed=0).eval()
    ids, mask = left_pad([[2, 3, 4], [5, 6, 7, 8, 9]])
    with OpLog() as log:
        _, traj = generate(model, ids, mask, steps=1, gen_length=8, block_length=4, threshold=0.9, mask_id=11,
                           return_trajectory=True)
    calls = traj.token_probs.shape[1]
    blocks = 2
    # After each call, and once more to end each block: "a mask left?"; once per call: "is the prompt
    # mask all ones?" (ddrl.sampling.masked "Host reads").
    assert log.syncs == calls + blocks + 1


# --------------------------------------------------------------------------------------------
# One check of the settings
# --------------------------------------------------------------------------------------------


BAD = [
    dict(threshold=0.0),  # (0, 1] everywhere: the config used to say (0, 1], the sampler [0, 1]
    dict(threshold=1.5),
    dict(factor=0.0),
    dict(threshold=0.9, factor=1.0),
    dict(cache="block"),
    dict(remasking="confident"),
    dict(remasking="sdar_dynamic"),
    dict(steps=5),
    dict(gen_length=10),
    dict(temperature=-1.0),
    dict(cfg_scale=-0.5),
    dict(top_p=0.0),
]


@pytest.mark.parametrize("bad", BAD, ids=[str(b) for b in BAD])
def test_a_bad_setting_reads_the_same_from_check_sampler_the_config_and_the_sampler(bad):
    """One check (ddrl.sampling.checks.check_sampler): config validation and the sampler say the same words."""
    from ddrl.config import ConfigError, validate_sampler
    from ddrl.sampling.checks import check_sampler

    cfg = dataclasses.replace(SamplerConfig(steps=8, gen_length=8, block_length=4, temperature=0.0), **bad)
    with pytest.raises(ValueError) as direct:
        check_sampler(cfg, "rollout")
    with pytest.raises(ConfigError) as from_config:
        validate_sampler(cfg, "rollout")
    model = ToyKeep(vocab_size=V, mask_token_id=MASK).eval()
    ids, mask = left_pad(GROUPS)
    with pytest.raises(ValueError) as sampled:
        sample_masked(model, ids, mask, cfg, generator=torch.Generator().manual_seed(0))
    assert str(direct.value) == str(sampled.value) == str(from_config.value)
    assert "rollout." in str(direct.value)


def test_threshold_one_is_accepted_everywhere():
    from ddrl.sampling.checks import check_sampler

    cfg = SamplerConfig(steps=8, gen_length=8, block_length=4, temperature=0.0, threshold=1.0)
    check_sampler(cfg, "rollout")
    model = ToyKeep(vocab_size=V, mask_token_id=MASK).eval()
    ids, mask = left_pad(GROUPS)
    assert sample_masked(model, ids, mask, cfg, generator=None).nfe == 8


def test_settings_a_sampler_does_not_read_are_refused():
    from ddrl.sampling.checks import check_sampler

    with pytest.raises(ValueError, match="rollout.threshold does not apply to the emerge sampler"):
        check_sampler(SamplerConfig(name="emerge", threshold=0.9), "rollout")
    with pytest.raises(ValueError, match="rollout.cfg_scale does not apply to the dream sampler"):
        check_sampler(SamplerConfig(name="dream", cfg_scale=1.0), "rollout")
    with pytest.raises(ValueError, match="rollout.name='nope' is not valid"):
        check_sampler(SamplerConfig(name="nope"), "rollout")
    with pytest.raises(ValueError, match="noise_dtype='float16' is not valid"):
        check_sampler(_with(SamplerConfig(), noise_dtype="float16"))


def _with(cfg: SamplerConfig, **fields):
    """cfg with extra attributes a SamplerConfig may not declare yet (e.g. noise_dtype)."""
    from types import SimpleNamespace

    return SimpleNamespace(**{**dataclasses.asdict(cfg), **fields})


def test_a_model_without_a_mask_token_is_refused_by_every_masked_sampler():
    from ddrl.sampling.dream import sample_dream

    model = ToyKeep(vocab_size=V, mask_token_id=MASK).eval()
    model.mask_token_id = None
    ids, mask = left_pad(GROUPS)
    cfg = SamplerConfig(steps=4, gen_length=4, temperature=0.0)
    for sampler in (sample_masked, sample_dream):
        with pytest.raises(ValueError, match="mask_token_id is None"):
            sampler(model, ids, mask, cfg, generator=torch.Generator().manual_seed(0))
