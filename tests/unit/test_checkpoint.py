import os
from pathlib import Path

import pytest
import torch

from ddrl.training import checkpoint as ckpt


class FakeModel:
    def __init__(self, fail=False):
        self.fail = fail

    def save_pretrained(self, d):
        d = Path(d)
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        if self.fail:
            raise OSError("disk full")
        (d / "model.safetensors").write_text("x")


def test_save_is_atomic_and_complete(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 3, FakeModel(), {"step": 3})
    assert path.name == "checkpoint-3" and (path / ckpt.COMPLETE).exists()
    assert ckpt.load_trainer_state(path)["step"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")]


def test_failed_write_leaves_previous_checkpoint_and_no_partial(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, FakeModel(), {"step": 1})
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 2, FakeModel(fail=True), {"step": 2})
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-1"
    assert not (tmp_path / "checkpoint-2").exists()


def test_half_written_checkpoint_is_never_loaded(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, FakeModel(), {"step": 1})
    half = tmp_path / "checkpoint-5"
    half.mkdir()
    torch.save({"step": 5}, half / "trainer_state.pt")  # killed before the COMPLETE marker
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-1"
    with pytest.raises(ValueError, match="incomplete.*interrupted"):
        ckpt.load_trainer_state(half)


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, s, FakeModel(), {"step": s}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]


def test_unwritable_run_dir_fails_at_start(tmp_path):
    from ddrl.training.common import check_writable

    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permission bits: use a path under a file instead
            target = tmp_path / "afile"
            target.write_text("x")
            with pytest.raises(ValueError, match="not writable"):
                check_writable(target / "run")
        else:
            with pytest.raises(ValueError, match="not writable"):
                check_writable(ro / "run")
    finally:
        os.chmod(ro, 0o700)


# --------------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint) in one process; 2-process runs are in
# tests/integration/test_sharded_checkpoint.py
# --------------------------------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_builtin(seed: int = 0):
    from ddrl.config import ModelConfig
    from ddrl.models import SymbolTokenizer, build_model

    return build_model(ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32),
                       SymbolTokenizer(list("0123456789")), generator_seed=seed)


def stepped(model, lr: float = 1e-2):
    """(model, AdamW) after one optimizer step, so that weights and Adam moments are non-trivial."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 3]])
    model(ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_optimizer(model_a, opt_a, model_b, opt_b) -> bool:
    a, b = ckpt.named_optimizer_state(model_a, opt_a), ckpt.named_optimizer_state(model_b, opt_b)
    return (a["state"].keys() == b["state"].keys()
            and all(torch.equal(a["state"][n][f], b["state"][n][f]) for n in a["state"] for f in a["state"][n])
            and [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]])


def save_sharded(run_dir, model, opt, step: int = 1, keep=None):
    from ddrl.training.distributed import DistInfo

    return ckpt.save_training_checkpoint(run_dir, step, model, opt, {"step": step, "scheduler": {"x": step}},
                                         dist=DistInfo(), sharded=True, keep=keep)


def test_a_sharded_checkpoint_holds_shards_not_weights_and_resumes_model_and_optimizer(tmp_path):
    from ddrl.models.io import SHARDED_STATE_DIR, WEIGHT_LAYOUT_FILE, is_sharded_checkpoint

    model, opt = stepped(tiny_builtin())
    path = save_sharded(tmp_path, model, opt, step=3)
    assert path == tmp_path / "checkpoint-3" and is_sharded_checkpoint(path)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "tokenizer.json", WEIGHT_LAYOUT_FILE, SHARDED_STATE_DIR, ckpt.COMPLETE} <= names
    assert "model.safetensors" not in names  # nothing was gathered into one file
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")]

    fresh, fresh_opt = stepped(tiny_builtin(seed=1), lr=5e-3)  # other weights, moments and lr
    state = ckpt.load_training_checkpoint(path, fresh, fresh_opt)
    assert state == {"step": 3, "scheduler": {"x": 3}}
    assert same_state(fresh.state_dict(), model.state_dict())
    assert same_optimizer(fresh, fresh_opt, model, opt)


def test_a_fresh_optimizer_gets_the_saved_moments(tmp_path):
    """Adam creates its state on the first step: loading must still fill exp_avg / exp_avg_sq / step."""
    model, opt = stepped(tiny_builtin())
    path = save_sharded(tmp_path, model, opt)
    fresh = tiny_builtin(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load_training_checkpoint(path, fresh, fresh_opt)
    assert same_optimizer(fresh, fresh_opt, model, opt)


def test_the_full_format_still_writes_a_model_directory_and_resumes(tmp_path):
    from ddrl.training.distributed import DistInfo

    model, opt = stepped(tiny_builtin())
    path = ckpt.save_training_checkpoint(tmp_path, 2, model, opt, {"step": 2}, dist=DistInfo(), sharded=False,
                                         keep=None)
    assert (path / "model.safetensors").is_file() and "optimizer" in ckpt.load_trainer_state(path)
    fresh, fresh_opt = stepped(tiny_builtin(seed=1))
    assert ckpt.load_training_checkpoint(path, fresh, fresh_opt) == {"step": 2}
    assert same_state(fresh.state_dict(), model.state_dict()) and same_optimizer(fresh, fresh_opt, model, opt)


def _lora_builtin():
    from ddrl.config import LoraConfig
    from ddrl.models.lora import apply_lora

    model = apply_lora(tiny_builtin(), LoraConfig(rank=4, alpha=8, target_modules=LORA_TARGETS))
    with torch.no_grad():  # B = 0 at init: give the adapter values that a layout mix-up would show
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.25)
    return model


def _fixture(family: str):
    from ddrl.models import load_model

    return load_model(FIXTURES / family / "model")


def _remote_code_tiny(tmp_path):
    from ddrl.models import load_model
    from tests.unit.test_hf_models import write_tiny_model

    return load_model(write_tiny_model(tmp_path / "tiny"), trust_remote_code=True)


MODELS = {
    "builtin": lambda tmp: tiny_builtin(),
    "builtin+lora": lambda tmp: _lora_builtin(),
    "llada": lambda tmp: _fixture("llada"),
    "dream": lambda tmp: _fixture("dream"),  # tied head: the hub layout drops lm_head
    "sdar": lambda tmp: _fixture("sdar"),
    "transformers (remote code)": _remote_code_tiny,
}


@pytest.mark.parametrize("family", list(MODELS))
def test_consolidating_a_sharded_checkpoint_gives_the_model_directory_of_every_family(family, tmp_path):
    """The weight layout is learned from each family's own save_pretrained: consolidation writes the
    files an ordinary save writes, and load_model reads back the same tensors and logits."""
    from ddrl.models import load_model
    from ddrl.models.io import consolidate_checkpoint

    model = MODELS[family](tmp_path).eval()
    path = save_sharded(tmp_path / "run", model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    out = consolidate_checkpoint(path, tmp_path / "model")
    model.save_pretrained(tmp_path / "ordinary")
    listing = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert listing(out) == listing(tmp_path / "ordinary")
    loaded = load_model(out, trust_remote_code=True).eval()
    assert same_state(loaded.state_dict(), model.state_dict())
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_load_model_reads_a_sharded_checkpoint_in_one_process(tmp_path):
    """ddrl.load_model (eval, generate) takes a sharded checkpoint directory like any model directory."""
    import ddrl

    model, opt = stepped(tiny_builtin())
    path = save_sharded(tmp_path, model, opt)
    loaded = ddrl.load_model(path)
    assert same_state(loaded.state_dict(), model.state_dict())


def test_a_sharded_checkpoint_read_as_a_plain_model_directory_names_the_fix(tmp_path):
    from ddrl.models.io import ModelDirectoryError, check_model_dir

    model, opt = stepped(tiny_builtin())
    path = save_sharded(tmp_path, model, opt)
    with pytest.raises(ModelDirectoryError, match="sharded training checkpoint.*consolidate_checkpoint"):
        check_model_dir(path)


def test_resuming_a_sharded_checkpoint_with_lora_switched_names_the_settings(tmp_path):
    model, opt = stepped(tiny_builtin())
    path = save_sharded(tmp_path, model, opt)
    lora, lora_opt = stepped(_lora_builtin())
    with pytest.raises(ValueError, match="LoRA switched on or off"):
        ckpt.load_training_checkpoint(path, lora, lora_opt)


def test_a_failed_sharded_save_leaves_the_previous_checkpoint_and_no_partial(tmp_path, monkeypatch):
    model, opt = stepped(tiny_builtin())
    save_sharded(tmp_path, model, opt, step=1)

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "write_weight_layout", disk_full)  # fails after the shards are written
    with pytest.raises(OSError, match="disk full"):
        save_sharded(tmp_path, model, opt, step=2)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]


def test_sharded_checkpoints_are_pruned_to_keep(tmp_path):
    model, opt = stepped(tiny_builtin())
    for step in (1, 2, 3):
        save_sharded(tmp_path, model, opt, step=step, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]


def test_read_safetensors_on_the_meta_device_reads_headers_only(tmp_path):
    from safetensors.torch import save_file

    from ddrl.models.io import read_safetensors

    tensors = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64),
               "h": torch.ones(2, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    assert same_state(read_safetensors(tmp_path / "x.safetensors"), tensors)
    with torch.device("meta"):
        meta = read_safetensors(tmp_path / "x.safetensors")
    assert {k: (v.device.type, v.shape, v.dtype) for k, v in meta.items()} == {
        k: ("meta", v.shape, v.dtype) for k, v in tensors.items()}


@pytest.mark.parametrize("family", ["builtin", "llada"])
def test_ranks_other_than_0_build_the_model_on_the_meta_device(family, tmp_path):
    """Loading at scale: rank 0 reads the weights, the others hold none until the broadcast."""
    from ddrl.training.distributed import DistInfo

    if family == "builtin":
        tiny_builtin().save_pretrained(tmp_path / "m")
        directory = tmp_path / "m"
    else:
        directory = FIXTURES / family / "model"
    on_rank = {rank: ckpt.load_model_on_rank0(directory, DistInfo(rank=rank, world_size=2)) for rank in (0, 1)}
    assert {p.device.type for p in on_rank[0].parameters()} == {"cpu"}
    assert {p.device.type for p in on_rank[1].parameters()} == {"meta"}
    assert [(n, p.shape, p.dtype) for n, p in on_rank[1].named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in on_rank[0].named_parameters()]


def test_rotation_keeps_the_pinned_checkpoint_made_with_valid_rewards(tmp_path):
    for s in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, s, FakeModel(), {"step": s}, keep=2, pinned=1)  # steps 2-4: dead rewards
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]


def test_a_truncated_safetensors_file_is_named_before_anything_loads(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(64)}, tmp_path / "model.safetensors")
    ckpt.check_weight_files(tmp_path)  # whole: no error
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(ckpt.CorruptCheckpointError, match="model.safetensors' is truncated"):
        ckpt.check_weight_files(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ckpt.CorruptCheckpointError, match="not a readable safetensors file"):
        ckpt.check_weight_files(tmp_path)


def test_a_garbage_trainer_state_falls_back_and_a_missing_one_alone_is_a_clear_error(tmp_path, caplog, monkeypatch):
    loaded = []
    monkeypatch.setattr(ckpt, "load_training_checkpoint",
                        lambda path, model, opt, **kw: loaded.append(path.name) or ckpt.load_trainer_state(path))
    for s in (1, 2):
        ckpt.save_checkpoint(tmp_path, s, FakeModel(), {"step": s}, keep=0)
    (tmp_path / "checkpoint-2" / ckpt.TRAINER_STATE).write_bytes(b"not a torch file")
    with caplog.at_level("WARNING", logger="ddrl"):
        path, state = ckpt.load_newest_training_checkpoint(tmp_path, None, None)
    assert path.name == "checkpoint-1" and state["step"] == 1 and loaded == ["checkpoint-2", "checkpoint-1"]
    assert "checkpoint-2/trainer_state.pt' cannot be read" in caplog.text and "falling back" in caplog.text
    (tmp_path / "checkpoint-1" / ckpt.TRAINER_STATE).unlink()
    with pytest.raises(ckpt.CorruptCheckpointError, match="no checkpoint of .* can be resumed.*"
                                                          "checkpoint-1/trainer_state.pt' is missing"):
        ckpt.load_newest_training_checkpoint(tmp_path, None, None)
