"""The parts of `ddrl train --rehearse` (ddrl.training.rehearse) that run without a whole step."""

import json

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ddrl.training.memory import LLADA_8B, LLADA2_MINI, shape_from_config
from ddrl.training.rehearse import FIXTURES, HostReads, family_source, sized_config


def test_llada_fixture_config_resized_to_the_published_shape():
    source, shape = family_source("/path/to/LLaDA-8B-Instruct")
    assert shape == LLADA_8B
    sized = sized_config(json.loads((source / "config.json").read_text()), shape, None)
    assert (sized["d_model"], sized["n_layers"], sized["mlp_hidden_size"], sized["embedding_size"]) == (
        4096, 32, 12288, 126464)
    assert shape_from_config(sized).params == LLADA_8B.params  # 8.0B: the hand model reads the same sizes


def test_reduced_layer_count_and_moe_fields():
    raw = json.loads((FIXTURES / "llada2/model-2.0/config.json").read_text())
    sized = sized_config(raw, LLADA2_MINI, 4)
    assert sized["num_hidden_layers"] == 4 and sized["num_experts"] == 256 and sized["moe_intermediate_size"] == 512
    assert sized["rotary_dim"] == 64  # half of a 128-wide head (partial_rotary_factor 0.5)


def test_host_reads_are_counted_by_call_site():
    reads = HostReads()
    with FakeTensorMode(), reads:
        x = torch.ones(3, 4)
        reads.counting = True
        assert bool((x > 0).any())  # stand-in True
        assert x.sum().item() == 1.0  # stand-in 1.0: fake tensors hold no values
        idx = torch.nonzero(x)
    assert idx.shape == (12, 2)  # stand-in: every element
    assert reads.total == 3
    assert all("test_rehearse_parts" not in site for site in reads.sites)  # sites name ddrl frames only


def test_unknown_placeholder_is_refused_with_the_known_families():
    try:
        family_source("/path/to/SomeOther-7B")
    except ValueError as e:
        assert "LLaDA-8B" in str(e) and "model.path" in str(e)
    else:
        raise AssertionError("an unknown placeholder was accepted")
