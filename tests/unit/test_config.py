import pytest

from ddrl.config import ConfigError, PretrainConfig, RLConfig, load_config, parse_overrides


def test_overrides_nest_and_parse_scalars():
    d = parse_overrides(["train.lr=3e-5", "train.steps=7", "model.path=/x", "eval.before=false"])
    assert d == {"train": {"lr": "3e-5", "steps": 7}, "model": {"path": "/x"}, "eval": {"before": False}}


def test_yaml_string_float_is_coerced():
    cfg = load_config({"train": {"lr": "3e-5"}}, cls=PretrainConfig)
    assert cfg.train.lr == pytest.approx(3e-5)


def test_unknown_key_names_the_key_and_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lrr'.*valid keys under 'train'.*\blr\b"):
        load_config({}, ["train.lrr=1"], PretrainConfig)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer"):
        load_config({}, ["train.steps=abc"], PretrainConfig)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config({}, ["train.steps"], PretrainConfig)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/file.yaml", cls=PretrainConfig)


def test_sampler_divisibility_errors_name_the_parameters():
    with pytest.raises(ConfigError, match="gen_length=10 is not divisible by sampler.block_length=4"):
        load_config({"sampler": {"gen_length": 10, "block_length": 4}}, cls=PretrainConfig)
    with pytest.raises(ConfigError, match="steps=5 is not divisible by the number of blocks"):
        load_config({"sampler": {"gen_length": 8, "block_length": 4, "steps": 5}}, cls=PretrainConfig)


def test_unknown_registry_names_list_choices():
    with pytest.raises(ConfigError, match="task.name='nope' is not valid; choose one of:.*mini_sudoku"):
        load_config({"task": {"name": "nope"}}, cls=PretrainConfig)
    with pytest.raises(ConfigError, match="method.objective='nope'.*stable_drl"):
        load_config({}, ["objective=nope"], RLConfig)


def test_one_line_method_switch():
    cfg = load_config({}, ["objective=espo"], RLConfig)
    assert cfg.method.objective == "espo"


def test_objective_args_checked_against_the_objective():
    with pytest.raises(ConfigError, match="unknown key 'method.objective_args.epsilonn'"):
        load_config({"method": {"objective": "espo", "objective_args": {"epsilonn": 0.2}}}, cls=RLConfig)


def test_empty_mapping_override_clears_args():
    base = {"method": {"objective": "spg", "estimator_args": {"num_t": 2}}}
    assert load_config(base, ["method.estimator_args.beta_eubo=1.0"], RLConfig).method.estimator_args == {
        "num_t": 2, "beta_eubo": 1.0}
    assert load_config(base, ["method.estimator_args={}"], RLConfig).method.estimator_args == {}


def test_overrides_apply_in_order_so_an_args_mapping_can_be_cleared_then_set():
    base = {"method": {"objective": "stable_drl", "estimator_args": {"num_t": 2}}}
    cfg = load_config(base, ["objective=tracerl", "method.estimator_args={}", "method.estimator_args.shrink=4"])
    assert cfg.method.estimator_args == {"shrink": 4}
    cfg = load_config(base, ["method.estimator_args.shrink=4", "method.estimator_args={}"])
    assert cfg.method.estimator_args == {}
    cfg = load_config(base, ["method.estimator_args.p_mask_prompt=0.1"])
    assert cfg.method.estimator_args == {"num_t": 2, "p_mask_prompt": 0.1}


def test_prompt_pool_and_eval_split_are_checked():
    with pytest.raises(ConfigError, match="train.prompt_pool"):
        load_config(None, ["train.prompt_pool=0"])
    with pytest.raises(ConfigError, match="eval.split"):
        load_config(None, ["eval.split=heldout"])
    cfg = load_config(None, ["train.prompt_pool=64", "eval.split=train"])
    assert cfg.train.prompt_pool == 64 and cfg.eval.split == "train"


def test_a_config_file_extends_its_base(tmp_path):
    (tmp_path / "common.yaml").write_text(
        "method:\n  objective: espo\n  objective_args: {epsilon: 0.2, beta: 0.01}\ntrain:\n  lr: 1.0e-6\n  steps: 7\n")
    (tmp_path / "task.yaml").write_text(
        "base: common.yaml\nmethod:\n  objective_args: {beta: 0.003}\ntrain:\n  steps: 9\n")
    cfg = load_config(tmp_path / "task.yaml", ["train.group_size=4"])
    assert cfg.method.objective == "espo" and cfg.method.objective_args == {"epsilon": 0.2, "beta": 0.003}
    assert (cfg.train.lr, cfg.train.steps, cfg.train.group_size) == (1e-6, 9, 4)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="its own base"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "missing.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(ConfigError, match="nope.yaml.*does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_bf16_full_fine_tuning_is_refused_before_any_compute():
    import torch

    from ddrl.training.common import build_optimizer

    with pytest.raises(ConfigError, match="bfloat16 with full fine-tuning.*model.dtype=float32 model.mixed_precision=bf16"):
        load_config(None, ["model.path=x", "model.dtype=bfloat16"], RLConfig)
    load_config(None, ["model.path=x", "model.dtype=bfloat16", "model.lora.rank=8"], RLConfig)  # LoRA: fp32 adapters
    with pytest.raises(ValueError, match="rounds to zero"):
        build_optimizer([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], 1e-6, 0.0)
    # the failure itself: one AdamW step of lr 1e-6 leaves a bf16 weight of 0.02 unchanged
    w = torch.nn.Parameter(torch.full((4,), 0.02, dtype=torch.bfloat16))
    w.grad = torch.ones_like(w)
    torch.optim.AdamW([w], lr=1e-6, weight_decay=0.0).step()
    assert torch.equal(w.detach(), torch.full((4,), 0.02, dtype=torch.bfloat16))


def test_mixed_precision_is_one_knob_and_older_configs_still_load(tmp_path):
    assert load_config(None, ["model.mixed_precision=bf16"], RLConfig).model.bf16_autocast
    with pytest.raises(ConfigError, match="model.mixed_precision='fp8' is not valid; choose one of: none, bf16"):
        load_config(None, ["model.mixed_precision=fp8"], RLConfig)
    # an older run's config.yaml: bf16_autocast is read as mixed_precision, and a later source wins
    (tmp_path / "old.yaml").write_text("model:\n  dtype: float32\n  bf16_autocast: true\n")
    cfg = load_config(tmp_path / "old.yaml", cls=RLConfig)
    assert cfg.model.mixed_precision == "bf16" and "bf16_autocast" not in vars(cfg.model)
    assert load_config(tmp_path / "old.yaml", ["model.bf16_autocast=false"], RLConfig).model.mixed_precision == "none"
    assert load_config(tmp_path / "old.yaml", ["model.mixed_precision=none"], RLConfig).model.mixed_precision == "none"
    (tmp_path / "both.yaml").write_text("model:\n  bf16_autocast: true\n  mixed_precision: none\n")
    with pytest.raises(ConfigError, match="contradicts model.mixed_precision=none"):
        load_config(tmp_path / "both.yaml", cls=RLConfig)
    (tmp_path / "child.yaml").write_text("base: old.yaml\nmodel:\n  mixed_precision: none\n")
    assert load_config(tmp_path / "child.yaml", cls=RLConfig).model.mixed_precision == "none"


def test_micro_batch_rows_needs_an_estimator_with_rows():
    cfg = load_config(None, ["objective=tracerl", "train.micro_batch_rows=4"], RLConfig)
    assert cfg.train.micro_batch_rows == 4
    with pytest.raises(ConfigError, match="train.micro_batch_rows cuts an estimator's own training rows"):
        load_config(None, ["objective=grpo", "train.micro_batch_rows=4"], RLConfig)
    with pytest.raises(ConfigError, match="train.micro_batch_rows must be >= 1"):
        load_config(None, ["objective=tracerl", "train.micro_batch_rows=0"], RLConfig)


def test_sharded_checkpoints_is_auto_true_or_false():
    assert load_config(None, [], RLConfig).train.sharded_checkpoints == "auto"
    assert load_config(None, ["train.sharded_checkpoints=true"], RLConfig).train.sharded_checkpoints is True
    with pytest.raises(ConfigError, match="train.sharded_checkpoints='sometimes' is not valid"):
        load_config(None, ["train.sharded_checkpoints=sometimes"], RLConfig)


def test_max_prompt_length_is_a_positive_token_count_or_null():
    assert load_config(None, ["rollout.max_prompt_length=200"]).rollout.max_prompt_length == 200
    assert load_config(None, []).rollout.max_prompt_length is None  # default: a too-long prompt is an error
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_length must be a positive number of tokens.*got 0"):
        load_config(None, ["rollout.max_prompt_length=0"])
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_length"):
        load_config(None, ["rollout.max_prompt_length=many"])


def test_more_minibatches_than_groups_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"train.minibatches=64 is more than train.prompts_per_step=32.*"
                                          r"set train.minibatches <= 32"):
        load_config(None, ["train.prompts_per_step=32", "train.minibatches=64"], RLConfig)


def test_adamw_betas_are_two_numbers_in_the_unit_interval():
    # refused at load, before a model is read (AdamW itself would fail only once the trainer builds it)
    for bad in ("[0.9]", "[0.9, 0.99, 0.5]", "[0.9, 1.5]"):
        with pytest.raises(ConfigError, match=r"train.betas=.*must be AdamW's two betas in \[0, 1\)"):
            load_config(None, [f"train.betas={bad}"], RLConfig)
    assert load_config(None, ["train.betas=[0.8, 0.95]"], RLConfig).train.betas == [0.8, 0.95]


def test_resume_is_true_false_or_auto():
    from ddrl.config import ConfigError, RLConfig, load_config

    assert load_config(None, ["resume=auto"], RLConfig).resume == "auto"
    assert load_config(None, ["resume=true"], RLConfig).resume is True
    with pytest.raises(ConfigError, match="resume='sometimes' is not valid.*auto"):
        load_config(None, ["resume=sometimes"], RLConfig)
    with pytest.raises(ConfigError, match="train.max_invalid_steps must be >= 0"):
        load_config(None, ["train.max_invalid_steps=-1"], RLConfig)
