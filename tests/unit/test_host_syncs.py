"""No host syncs per denoising step, and none in an estimator's forward + backward (issue 27, item 4).

A host read of a device value stops the CPU until the GPU has run everything queued before it; in
a decode step of ~512 tokens that wait, and the launch gap after it, cost more than the step. No
GPU is needed to find them: every read of a tensor's value (.item(), int(t), bool(t), .tolist(),
an `if` on a tensor) dispatches `aten._local_scalar_dense`, and the ops whose output size depends on
values (nonzero, masked_select, boolean indexing) read a count on the GPU. HostReads counts both
kinds under a TorchDispatchMode while the CPU runs the real code.

What is pinned:
  * the masked sampler's fixed-count path on the native LLaDA and Dream fixtures (no cache, prefix
    and dual caches): the reads do not grow with the number of steps, and their number per call is
    exactly the one the sampler documents (ddrl.sampling.masked "Host reads": the noise seeds, one
    read per call, only when sampling), so the model calls themselves read nothing;
  * the estimators' scoring call (ddrl.estimators.common.forward_logprobs, the model's fused
    log-prob path through ddrl.ops.logprobs.target_logprobs), forward and backward: no read
    without a scored-position mask; with one, exactly one (the count of scored positions, the
    price of running the LM head on those only), none in backward;
  * a method's estimate, loss and backward on a micro-batch (the update's inner step): none for the
    PPO/ELBO family (masked_stat's statistics are masked sums, not boolean selections; the
    stratified counts of ESPO/DACA keep the lengths on the device; the ratio-noise seed is read only
    when noise is asked for; the group softmax of StableDRL and wd1 uses a same-group table; UniGRPO's
    copies are indexed without a nonzero), and TraceRL's four data-dependent sizes (METHOD_READS),
    pinned here so that a new read fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ddrl
import ddrl.estimators  # noqa: F401  (registration)
import ddrl.objectives  # noqa: F401
from ddrl.config import SamplerConfig
from ddrl.estimators.common import forward_logprobs, stratified_counts
from ddrl.objectives import AggregationCounts
from ddrl.objectives.base import masked_stat
from ddrl.registry import ESTIMATORS, OBJECTIVES
from ddrl.types import RolloutBatch, Trajectory
from ddrl.ops.logprobs import target_logprobs
from ddrl.sampling.masked import sample_masked

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class HostReads:
    """Counts the ops that make the host wait for a device value, in call order (names in `ops`).

    Two modes: the dispatcher sees every value read and data-dependent size; .tolist() and .numpy()
    copy the data out without dispatching a read op on the CPU, so the torch-function level counts them."""

    VALUE_READS = {"_local_scalar_dense"}  # .item(), int(), float(), bool() of a tensor, `if tensor:`
    SIZE_READS = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"}  # output size from values
    COPIES_OUT = {"tolist", "numpy"}

    def __init__(self):
        self.ops: list[str] = []
        self._modes = (_FunctionLevel(self), _DispatchLevel(self))

    def __enter__(self) -> "HostReads":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, log: HostReads):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HostReads.COPIES_OUT:
            self.log.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, log: HostReads):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HostReads.VALUE_READS or name in HostReads.SIZE_READS or _boolean_index(name, args):
            self.log.ops.append(name)
        return func(*args, **(kwargs or {}))


def _boolean_index(name: str, args: tuple) -> bool:
    """x[mask] and x[mask] = v: a boolean index is turned into positions (a nonzero) inside the kernel."""
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


@pytest.fixture(scope="module", params=["llada", "dream"])
def native(request):
    return ddrl.load_model(FIXTURES / request.param / "model", dtype=torch.float32).eval()


def prompts(model, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded when `padded` (the attention mask is then used)."""
    pad = model.pad_token_id  # 121 (LLaDA), 100 (Dream): not one of the prompt's ids
    ids = torch.tensor([[pad, pad, 5, 6, 7] if padded else [3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    return ids, ids != pad


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("padded", [True, False])
def test_fixed_count_sampling_reads_nothing_per_step(native, cache, temperature, padded):
    ids, mask = prompts(native, padded)
    reads = []
    for steps in (4, 16):
        cfg = SamplerConfig(steps=steps, gen_length=16, block_length=8, temperature=temperature, cache=cache,
                            early_exit=False)
        with HostReads() as log:
            out = sample_masked(native, ids, mask, cfg, generator=torch.Generator().manual_seed(0))
        assert out.nfe == steps
        reads.append(log.ops)
    # Per call (ddrl.sampling.masked "Host reads"): whether the prompt mask is all ones, and the noise
    # seeds when sampling (one tolist of the generators' draws). Nothing per step or per block.
    expected = ["_local_scalar_dense"] + (["tolist"] if temperature > 0 else [])
    assert reads == [expected, expected], reads


def test_the_estimators_scoring_call_reads_nothing_forward_and_backward(native):
    ids, mask = prompts(native)
    L = 6
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(0, 100, (2, L), generator=g)
    noised = completion.masked_fill(torch.rand(2, L, generator=g) < 0.5, native.mask_token_id)
    scored = torch.tensor([[True, False, True, True, False, True], [False, True, True, False, True, True]])
    for where, expected in ((None, []), (scored, ["nonzero"])):
        native.zero_grad()
        with HostReads() as log:
            lp = forward_logprobs(native, ids, mask, noised, completion, scored=where)
            forward_reads = list(log.ops)
            lp.sum().backward()
        assert forward_reads == expected, forward_reads  # the scored count, read once before the model call
        assert log.ops == expected, log.ops  # backward reads nothing
        assert all(p.grad is not None for p in native.parameters() if p.requires_grad)


def test_target_logprobs_reads_nothing_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(3, 7, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    suppressed = torch.zeros(50, dtype=torch.bool)
    suppressed[49] = True
    with HostReads() as log:
        lp = target_logprobs(hidden, targets, head, vocab=50, suppressed=suppressed, chunk=4, backend="torch")
        lp.sum().backward()
    assert log.ops == []
    assert hidden.grad is not None and head.weight.grad is not None


def test_out_of_range_ids_are_still_refused(native, monkeypatch):
    """The input check stays, queued on the device (ddrl.ops.value_checks); DDRL_SYNC_CHECKS=1 reads it at
    once and names the values."""
    bad = torch.tensor([[3, 4, native.vocab_size + 5]])
    with pytest.raises(RuntimeError, match="input_ids hold ids outside"):
        native(bad)
    monkeypatch.setenv("DDRL_SYNC_CHECKS", "1")
    with pytest.raises(ValueError, match=rf"outside .*max {native.vocab_size + 5}"):
        native(bad)


# Pinned reads of an update's inner step (estimate, loss, backward). The group softmax of StableDRL
# and wd1 reads nothing (a same-group table, not torch.unique's group count), nor do UniGRPO's masked
# copies when every row is computed. TraceRL's are the data-dependent sizes: the number of states S
# (it sizes the [S, B, L] state masks), the (state, sample) rows to run (nonzero), the scored positions
# the LM head computes (nonzero, ddrl.models.diffusion_lm), and the objective's S for its rows.
TRACE_READS = ["_local_scalar_dense", "nonzero", "nonzero", "_local_scalar_dense"]
METHOD_READS = {"grpo": [], "espo": [], "daca_grpo": [], "spg": [], "coupled_grpo": [], "gdsd": [], "fpo": [],
                "stable_drl": [], "wd1": [], "unigrpo": [], "tracerl": TRACE_READS}


@pytest.mark.parametrize("objective", sorted(METHOD_READS))
def test_a_methods_estimate_loss_and_backward_read_only_what_is_pinned(native, objective):
    method = OBJECTIVES.get(objective)()
    estimator = ESTIMATORS.get(method.default_estimator)(**method.default_estimator_args)
    ids, mask = prompts(native)
    completion = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    commit = torch.tensor([[0, 0, 2, 3, -1, -1], [1, 0, 1, 5, 4, 4]])  # TraceRL's decoding order
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=mask, completion_ids=completion,
                         completion_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6], dtype=torch.bool),
                         group_ids=torch.zeros(2, dtype=torch.long), rewards=torch.tensor([1.0, 0.0]),
                         advantages=torch.tensor([0.5, -0.5]), mask_seeds=torch.tensor([3]),
                         trajectory=Trajectory(commit, None) if method.default_estimator == "trace" else None)
    rows = float(estimator.count_rows(batch)) if hasattr(estimator, "count_rows") else None
    counts = dataclasses.replace(AggregationCounts.from_batch(batch, 1), rows=rows)  # the planner's, once a step
    method.prepare(batch)
    with torch.no_grad():
        old = estimator(native, batch, 7)
    native.zero_grad()
    with HostReads() as log:
        new = estimator(native, batch, 7)
        out = method(batch, new, old, old, counts=counts)
        out.loss.backward()
    assert log.ops == METHOD_READS[objective], log.ops


def test_masked_stat_reads_nothing_and_is_the_selected_mean_and_max():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 5, generator=g)
    values[0, 0] = float("inf")  # outside the mask: must not leak into the stat
    mask = torch.rand(3, 5, generator=g) < 0.5
    mask[0, 0] = False
    rows = torch.tensor([True, False, True])
    with HostReads() as log:
        stats = [masked_stat(values, mask), masked_stat(values, mask, "max"), masked_stat(values, rows),
                 masked_stat(values, torch.zeros_like(mask)), masked_stat(values, torch.zeros_like(mask), "max")]
    assert log.ops == []
    picked = [float(v) for v, m in zip(values.flatten(), mask.flatten()) if m]
    by_row = [float(v) for r in (0, 2) for v in values[r]]
    expected = [sum(picked) / len(picked), max(picked), sum(by_row) / len(by_row), 0.0, 0.0]
    assert [float(x) for x in stats] == pytest.approx(expected, rel=1e-6)


def test_stratified_counts_keep_the_lengths_where_they_are():
    lengths = torch.tensor([0, 3, 7, 16, 16, 5])
    with HostReads() as log:
        n = stratified_counts(lengths, torch.Generator().manual_seed(4))
    assert log.ops == []
    u = float(torch.rand((), generator=torch.Generator().manual_seed(4)))  # the formula, by hand
    expected = [min(int(((u + j / 6) % 1.0) * (length + 1)), length) for j, length in enumerate(lengths.tolist())]
    assert n.tolist() == expected
