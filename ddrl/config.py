"""One source of truth for configuration: nested dataclasses <- YAML + dotted key=value overrides.

    cfg = load_config("configs/rl/espo_mini_sudoku.yaml", ["train.lr=3e-5", "objective=espo"], RLConfig)

Every field has a docstring-comment. Loading checks each key and type and fails with a message
naming the key and the valid choices; `validate()` checks registry names and cross-field rules,
once, before any compute.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix."""


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class LoraConfig:
    """LoRA through peft (ddrl.models.lora). Module names are the backbone's (the checkpoint's weight
    names without ".weight"). An entry of target_modules / exclude_modules is a name, plain or dotted,
    matching every module whose full name is it or ends with "." + it (peft's rule: "q_proj",
    "self_attn.q_proj"), or "re:<regex>" matching whole names ("re:.*vision_tower.*"). Entries that
    match nothing are logged, not fatal; matching nothing at all is an error. The LM head is adapted
    only when named by its full path: a name that also reaches it (LLaDA's "ff_out", the name of its
    blocks' MLP output and of its LM head) skips it with a logged note. LLaDA/MMaDA names: q_proj,
    k_proj, v_proj, attn_out, ff_proj, up_proj, ff_out; the built-in model, Dream, SDAR and
    DiffusionGemma: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""

    rank: int = 0  # LoRA rank; 0 disables LoRA (full fine-tuning)
    alpha: float = 16.0  # LoRA scaling numerator (scale = alpha / rank)
    dropout: float = 0.0  # dropout on the LoRA branch
    # layers to adapt: names (suffix match) or "re:<regex>" (class docstring)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    exclude_modules: list[str] = field(default_factory=list)  # never adapted, same syntax: ["re:.*vision_tower.*"]


@dataclass
class ModelConfig:
    path: str | None = None  # a saved model directory (built-in or Hugging Face); None = build from the fields below
    process: str = "masked"  # forward process when building from scratch: masked | uniform | block
    # backbone to build from scratch: transformer (ddrl's Denoiser) | mdlm_dna (the DRAKES / SEPO DNA CNN:
    # d_model channels, n_layers stacks, max_seq_len bases; masked process, loglinear schedule, mask id 4)
    architecture: str = "transformer"
    schedule: str = "linear"  # noise schedule alpha_t: linear | cosine | loglinear (MDLM's; architecture mdlm_dna)
    d_model: int = 128  # built-in transformer width
    n_layers: int = 4  # built-in transformer depth
    n_heads: int = 4  # attention heads
    ffn_mult: float = 2.6667  # SwiGLU hidden size = ffn_mult * d_model (rounded to a multiple of 8)
    max_seq_len: int = 256  # longest prompt + completion the model accepts
    block_size: int | None = None  # block-causal block size to build; on load None = the checkpoint's, else must match
    dropout: float = 0.0  # dropout inside the built-in transformer
    dtype: str = "float32"  # parameter (master weight) dtype: float32 | bfloat16 (RL: a frozen LoRA base only)
    # compute precision: none (compute in model.dtype) | bf16 (bf16 matmuls over the parameters: under
    # FSDP2 a MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), else torch.autocast(bf16)).
    # Full fine-tuning at scale: dtype=float32 + mixed_precision=bf16. Older configs' bf16_autocast: true
    # loads as mixed_precision: bf16.
    mixed_precision: str = "none"
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    trust_remote_code: bool = False  # run a non-native directory's own code (auto_map); LLaDA/Dream/SDAR never do
    mask_token_id: int | None = None  # override the family's mask id (HF models)
    # the image decoder's directory: MMaDA + MAGVIT-v2 (the model then generates images), or another
    # AutoencoderVQ for an URSA pipeline (default: its vae/); load_model(path, vq_path=...)
    vq_path: str | None = None
    # text-to-image MMaDA only (needs vq_path or a saved t2i model): true = MaskGRPO's released prompt rows,
    # [iPAD]-padded and attended, since their LLaDA copy passes attn_mask=None (rollouts and log-probs see
    # the padding); false = MMaDA's own, padding masked; null = the saved model's choice (false). ddrl.models.mmada
    t2i_attend_padding: bool | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def bf16_autocast(self) -> bool:
        """Read-only view of the older knob: bf16 compute (model.mixed_precision=bf16)."""
        return self.mixed_precision == "bf16"


@dataclass
class SamplerConfig:
    """The rollout section: every sampler's keys, in one place for YAML, flags and the Python API. Each
    sampler reads only those of its settings class (ddrl.sampling.settings; MaskedSettings, DreamSettings
    ... beside each sampler); a key set for a sampler that does not read it is refused, naming the sampler,
    the key and why: at config load for an explicit name, once the model is known for auto. A key at its
    default, or "off" (cache none, a block_length of the whole completion), is not set."""

    # sampler: auto (the model's own: block for SDAR/TraDo, diffusion_gemma for DiffusionGemma, uniform
    # for uniform models, metric_path for URSA, masked for LLaDA/MMaDA/Dream) | masked (LLaDA semi-AR) | emerge | uniform |
    # block | dream | diffusion_gemma; one the model cannot run is refused (sampling.checks.resolve_sampler)
    name: str = "auto"
    steps: int = 16  # model calls in total (masked: divided evenly over blocks)
    gen_length: int = 16  # completion tokens to generate
    block_length: int | None = None  # semi-AR block; None = gen_length (one block)
    temperature: float = 1.0  # 0 = greedy
    cfg_scale: float = 0.0  # classifier-free guidance weight (0 = off)
    remasking: str = "low_confidence"  # low_confidence | random | sdar_dynamic (SDAR: those above threshold if >= k, else the top k)
    threshold: float | None = None  # confidence-threshold parallel decoding (commit all above it)
    cache: str = "auto"  # KV cache: none (reference) | prefix | dual (Fast-dLLM, approximate) | auto (exact cache on block-causal models, none elsewhere)
    # masked/block/emerge: run the decode step's model call under torch.compile (CUDA graphs on CUDA,
    # mode reduce-overhead); the same tokens as eager, compiled once per shape (ddrl.sampling.cache)
    compile: bool = False
    factor: float | None = None  # Fast-dLLM factor rule: commit the largest n with (n+1)(1-c_(n)) < factor
    early_exit: bool = True  # stop spending compute on sequences that already produced EOS
    # keep the last N tokens of a longer prompt, as TRL and d1 do (d1: 200); the sampler, the likelihood
    # passes and evaluation all see the cut prompt; counted as rollout/truncated_prompts. None = no cut,
    # and a prompt longer than the model's max_seq_len - gen_length is an error
    max_prompt_length: int | None = None
    # Gumbel noise of masked/block/emerge, drawn on the model's device: float32 | float64 (the
    # reference's: its tail also reaches tempered probabilities below ~6e-8; twice the draw's memory)
    noise_dtype: str = "float32"
    # emerge's random-number layout: ddrl (draws keyed per chunk of rows, block and step, so a row never
    # depends on the others) | released (image completions: MaskGRPO's t2i_generate_emerge draws, one
    # torch.multinomial over every image slot per step from the chunk's generator, so a seed reproduces the
    # authors' tokens; ddrl.sampling.released says what it covers)
    rng: str = "ddrl"
    # rows per sampler call: the rollout (and evaluation) is cut into calls of at most this many rows,
    # because a call holds its rows' logits, [rows, W, V] per step (twice under guidance; an image model's
    # codebook only, but emerge's rng=ddrl still draws fp32 uniforms over all V: ~0.55 GB a row for a
    # 1,024-token MMaDA image, ddrl.training.memory). MaskGRPO's generation_batch_size
    # ("handles OOM during rollout", 1 for text-to-image). Calls take whole prompt groups when it is at
    # least the group size (the tokens of one call); below it every row draws from its own generator,
    # seeded from its group's (ddrl.sampling.base.sample_in_chunks). None = all of a rank's rows at once
    batch_rows: int | None = None
    # Dream's diffusion_generate (rollout.name=dream) and SDAR's tempered confidence (remasking=sdar_dynamic):
    alg: str = "entropy"  # dream: which masked positions to commit: origin | entropy | maskgit_plus | topk_margin
    alg_temp: float | None = None  # dream: sample the positions to commit from softmax(confidence / alg_temp)
    top_p: float | None = None  # nucleus filter of the token distribution (dream, sdar_dynamic); None = off
    top_k: int | None = None  # top-k filter of the token distribution (dream, sdar_dynamic); None = off


@dataclass
class TaskConfig:
    name: str = "mini_sudoku"  # a registered task, or "module.path:factory" for a user's own task
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the task factory
    format: str | None = None  # prompt format: compact (built-in tiny models) | chat (HF models); None = the task's default


@dataclass
class MethodConfig:
    objective: str = "grpo"  # the RL objective (see `ddrl methods`); switching it switches the method
    estimator: str | None = None  # likelihood estimator; None = the objective's default
    advantage: str | None = None  # mean | zscore | loo ; None = the objective's default
    advantage_clip: float | None = None  # clip advantages to +-this (UDM-GRPO: 5)
    advantage_std: str | None = None  # zscore's std: sample | population ; None = as the method's authors do
    invalid_reward: str = "drop"  # a None/NaN reward: drop (out of its group, no loss) | zero (reward 0: d1, wd1)
    objective_args: dict[str, Any] = field(default_factory=dict)  # e.g. {epsilon: 0.2, beta: 0.01}
    estimator_args: dict[str, Any] = field(default_factory=dict)  # e.g. {num_mc: 2, p_mask_prompt: 0.15}
    fresh_masks: bool | None = None  # new mask seed for every pass (StableDRL); None = objective's default
    reuse_masks: bool | None = None  # every inner iteration reuses iteration 0's masks (DiPOD); None = default
    elbo_reg: float = 0.0  # DiPOD on-policy ELBO regulariser weight lambda (0 = off)
    moe_aux_loss_coef: float = 0.0  # a mixture of experts' (LLaDA2) router balance loss added to the loss with
    # this weight (ddrl.models.moe_balance: DeepSeek-V3's sequence-wise form); 0 = off, as the released models
    # and RL recipes run them (auxiliary-loss-free balancing through expert_bias)


@dataclass
class TrainConfig:
    steps: int = 100  # RL steps = rollout batches; each makes num_iterations x minibatches optimizer steps
    # (the peers count optimizer steps: a paper's max_steps S is train.steps = S / (num_iterations x minibatches))
    prompts_per_step: int = 8  # distinct prompts per step (across all processes)
    prompt_pool: int | None = None  # cycle through the first N training prompts (None = new prompts every step)
    group_size: int = 8  # G, completions per prompt
    num_iterations: int = 1  # mu, inner updates on the same rollouts
    micro_batch_size: int | None = None  # rows per forward/backward (gradient accumulation); None = all
    micro_batch_rows: int | None = None  # estimators with training rows of their own (TraceRL's trace states,
    # UniGRPO's masked copies): at most this many rows per forward/backward, cut sample-major as dLLM-RL does
    # (row_chunks) within each micro_batch_size slice (whose masks a copy chunk keeps), so memory is bounded
    # by rows, not by samples x states or copies; None = whole micro-batches
    minibatches: int = 1  # optimizer steps per inner iteration, each on a disjoint share of the groups (PPO
    # minibatches; TraceRL); old log-probs stay those of the rollout policy
    group_filter: list[float] | None = None  # [lo, hi]: groups whose mean reward is below lo or above hi
    # are left out of the update, counts included (dLLM-RL's TraceRL/UniGRPO: [0.2, 0.8])
    truncated_reward: float | None = None  # reward of a completion with no stop token (cut at gen_length);
    # None = the task's reward (dLLM-RL scores truncated answers as wrong: 0)
    truncation_margin: int = 0  # with truncated_reward: also a completion of >= gen_length - margin tokens
    # (dLLM-RL: 5, counting answers that end at the limit as cut off)
    disable_dropout: bool = True  # dropout off in every RL pass, so old, ref and current passes compute the
    # same function and the ratio is exactly 1 at k = 0; false = dropout on in all of them (d1, TRL)
    skip_uninformative: bool = True  # leave groups whose advantages are all 0 out of the old/ref/update passes
    # when the method's loss has no term without A (beta = 0, no ELBO regulariser): same expected
    # gradient, far less compute when most groups are all-right or all-wrong (every rank pads to the
    # same number of micro-batches)
    lr: float = 1e-5  # peak learning rate
    lr_schedule: str = "constant"  # constant | cosine | linear (after warmup)
    warmup_steps: int = 0  # linear warmup steps
    min_lr_ratio: float = 0.0  # cosine/linear floor as a fraction of lr
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    sync_ref_every: int = 0  # copy the policy into the reference model every N steps (0 = never)
    max_bad_steps: int = 5  # stop after this many non-finite steps in a row
    max_invalid_steps: int = 3  # stop (an error, exit code 3) after this many rollout steps in a row whose
    # rewards were ALL invalid (None/NaN: a reward server that is down, a reward that raises); no optimizer
    # step is taken on such a step, and the newest checkpoint made with valid rewards is never rotated away.
    # 0 = never stop
    log_every: int = 1  # write metrics every N steps
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    keep_checkpoints: int = 2  # keep the newest N checkpoints, plus the newest made with valid rewards
    sharded_checkpoints: bool | str = "auto"  # true: each rank writes its shard (torch.distributed.checkpoint);
    # false: rank 0 writes one full model directory; auto: sharded under dist.strategy=fsdp
    tensorboard: bool = True  # also write TensorBoard events
    wandb: bool = False  # also log to Weights & Biases (needs wandb installed)
    progress: bool = True  # tqdm progress bar


@dataclass
class EvalConfig:
    every: int = 0  # evaluate on eval.split every N steps (0 = only before and after)
    n: int = 64  # examples per evaluation
    temperature: float = 0.0  # sampler temperature at evaluation (0 = greedy)
    steps: int | None = None  # sampler steps at evaluation; None = the rollout's
    samples_to_log: int = 4  # completions written to samples.jsonl per evaluation
    # The periodic evaluations (before, every N, last), for choosing recipes, learning rates and
    # checkpoints: dev | test | train (with train.prompt_pool: the prompts RL trains on, for n <= pool).
    # A task without a dev split is evaluated on test, with a notice.
    split: str = "dev"
    # The sealed split, scored once before and once after training (logged as report_before/* and
    # report/*, with 95% intervals; the demo and `ddrl compare` print these); null = no report.
    report_split: str | None = "test"
    report_n: int | None = None  # examples in the sealed report; None = eval.n (make it large: it is scored twice)
    # seed of the evaluated examples and of the eval sampler's draws; None = the run's seed. Fix it to
    # score every training seed of a study on the same examples (paired across seeds and methods).
    seed: int | None = None
    before: bool = True  # evaluate the base model before training


@dataclass
class DistConfig:
    strategy: str = "auto"  # auto | none | ddp | fsdp (auto: ddp when launched by torchrun, else none)
    backend: str | None = None  # nccl | gloo; None = nccl on GPU, gloo on CPU
    # FSDP2's CPUOffloadPolicy: weights, gradients and AdamW state live in (pinned) host memory and
    # the optimizer steps on the CPU; each block is copied to the GPU for its forward/backward. What
    # lets full fine-tuning of an 8B model fit one GPU (`ddrl train --dry-run` prints the plan); needs
    # dist.strategy=fsdp, also in one process (a one-rank process group is made).
    cpu_offload: bool = False
    # collective timeout in seconds (init_process_group): a rank that waits longer in a collective is
    # killed by the watchdog. NCCL's default, 10 minutes, is shorter than rank 0 writing a ~96 GB
    # non-sharded 8B checkpoint (train.sharded_checkpoints=false) while the other ranks wait.
    timeout: int = 1800


@dataclass
class RLConfig:
    """`ddrl train CONFIG`: RL fine-tuning of a diffusion model on a task."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: SamplerConfig = field(default_factory=SamplerConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    seed: int = 0  # every random draw derives from this
    output_dir: str = "runs/rl"  # the run directory
    # true: continue from the newest complete checkpoint in output_dir (an error when there is none: a
    # misspelt output_dir must not start over; a corrupt newest checkpoint falls back to the one before);
    # auto: continue when there is one, else start fresh (torchrun --max-restarts); false: a new run,
    # refused when output_dir already holds one (metrics.jsonl or checkpoints) unless overwrite=true
    resume: bool | str = False
    overwrite: bool = False  # a new run (resume=false) replaces the run already in output_dir
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class PretrainTrainConfig:
    steps: int = 200  # optimizer steps
    batch_size: int = 64  # sequences per step
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 20  # linear warmup
    lr_schedule: str = "cosine"  # constant | cosine | linear
    min_lr_ratio: float = 0.1  # floor of the decay as a fraction of lr
    weight_decay: float = 0.01  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping
    eval_every: int = 50  # held-out loss every N steps
    eval_batches: int = 4  # held-out batches per evaluation
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    progress: bool = True  # tqdm progress bar


@dataclass
class DataConfig:
    jsonl: str | None = None  # a JSONL file with "prompt" and "completion" fields; None = the task's generator
    n_train: int = 5000  # training examples drawn from the task generator
    n_heldout: int = 256  # held-out examples for the loss
    prompt_dropout: float = 0.0  # fraction of each batch trained on the empty prompt "" (CFG's unconditional branch)


@dataclass
class PretrainConfig:
    """`ddrl pretrain CONFIG`: train a denoiser with the masked / uniform / block loss."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: PretrainTrainConfig = field(default_factory=PretrainTrainConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # used for the held-out solve rate
    seed: int = 0  # every random draw derives from this
    output_dir: str = "runs/pretrain"  # where checkpoints go
    device: str = "auto"  # auto | cpu | cuda


def task_kwargs(task: TaskConfig) -> dict[str, Any]:
    """Constructor arguments for the task factory: its args, plus the format when one is set."""
    return {**task.args, **({"format": task.format} if task.format else {})}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """["train.lr=3e-5", "objective=espo"] -> nested dict. Values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. train.lr=3e-5)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} sets a field inside a scalar")
        node[parts[-1]] = value
    return out


# Short aliases so that the one-line switch `objective=espo` works at the top level.
_ALIASES = {"objective": ("method", "objective"), "estimator": ("method", "estimator")}


def _apply_aliases(d: dict[str, Any]) -> dict[str, Any]:
    for alias, (section, key) in _ALIASES.items():
        if alias in d:
            d.setdefault(section, {})[key] = d.pop(alias)
    return _migrate_legacy(d)


def _migrate_legacy(d: dict[str, Any]) -> dict[str, Any]:
    """Older keys, rewritten into today's within one source (a file or an override), so older configs
    and run directories load and the later source still wins: `model.bf16_autocast: true` is
    `model.mixed_precision: bf16` (false: none)."""
    model = d.get("model")
    if isinstance(model, dict) and "bf16_autocast" in model:
        model = dict(model)
        legacy = model.pop("bf16_autocast")
        if not isinstance(legacy, bool):
            raise ConfigError(f"model.bf16_autocast: expected true/false, got {legacy!r} (today's key: "
                              f"model.mixed_precision=bf16|none)")
        value = "bf16" if legacy else "none"
        if model.get("mixed_precision", value) != value:
            raise ConfigError(f"model.bf16_autocast={str(legacy).lower()} contradicts model.mixed_precision="
                              f"{model['mixed_precision']}; keep only model.mixed_precision")
        model["mixed_precision"] = value
        d = {**d, "model": model}
    return d


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not k.endswith("args"):
            out[k] = _deep_merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v} if v else {}  # `method.estimator_args={}` clears the mapping
        else:
            out[k] = v
    return out


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-5 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in hints:
            where = f"under '{prefix}'" if prefix else "at the top level"
            raise ConfigError(f"unknown config key '{key}'; valid keys {where}: {', '.join(names)}")
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def _read_yaml(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """A config file's mapping, merged over its `base:` file(s) (paths relative to the file).

    `base` lets the recipes of one paper share their common part (configs/paper/<paper>/common.yaml)
    and state only what a task changes, so each setting has one source of truth.
    """
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in chain:
        raise ConfigError(f"config file {str(path)!r} is its own base (base chain: "
                          f"{' -> '.join(str(c) for c in chain)})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    bases = data.pop("base", None)
    data = _migrate_legacy(data)
    data = {k: v if k == "output_dir" else _beside_the_config(v, path, k) for k, v in data.items()}
    if bases is None:
        return data
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else list(bases):
        merged = _deep_merge(merged, _read_yaml(path.parent / str(base), (*chain, path.resolve())))
    return _deep_merge(merged, data)


def _beside_the_config(value: Any, config: Path, key: str) -> Any:
    """A relative path in a config file, read from the working directory as the shell reads it, or,
    when nothing is there, from the config file's folder or the nearest folder above it that holds
    it: the shipped configs name checkpoints/ and runs/ from the repository root, so
    `ddrl train /repo/configs/rl/x.yaml` runs from any directory, as `ddrl demo` does. Only a value
    with a folder part (a/b) that exists there is rewritten (logged); output_dir, an output, never is."""
    if isinstance(value, dict):
        return {k: _beside_the_config(v, config, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_beside_the_config(v, config, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or "/" not in value or ":" in value or Path(value).is_absolute() \
            or Path(value).exists():  # not a relative path (ddrl:NAME, http://, module:attr), or found here
        return value
    for folder in (config.resolve().parent, *config.resolve().parent.parents):
        if (folder / value).exists():
            log.info("%s: %s is not in the working directory; using %s (found from %s)", key, value,
                     folder / value, config)
            return str(folder / value)
    return value


def load_config(source: str | Path | dict[str, Any] | None, overrides: list[str] | None = None, cls: type = RLConfig) -> Any:
    """Read YAML (or a dict), apply dotted overrides, type-check every key, validate once."""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = dict(source)
    else:
        data = _read_yaml(Path(source), ())
    data = _apply_aliases(data)
    for item in overrides or []:  # one at a time, in order: `x_args={}` then `x_args.k=v` clears, then sets
        data = _deep_merge(data, _apply_aliases(parse_overrides([item])))
    cfg = _build(cls, data)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --------------------------------------------------------------------------------------------
# Validation (registry names and cross-field rules), once, before any compute
# --------------------------------------------------------------------------------------------


def _choice(value: str, valid: list[str] | tuple[str, ...], key: str) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(valid)}")


def validate_sampler(s: SamplerConfig, key: str = "rollout") -> None:
    """The sampler's own settings class checks the section (registered with it: SAMPLERS.get(name).settings,
    ddrl.sampling.settings): its values, and no key set that it does not read. rollout.name=auto: every
    sampler that reads all the keys set checks their values; the keys are checked against the model's own
    sampler when the model is known (the trainer, `ddrl eval`). The samplers run the same check, so a bad
    value reads the same from a config file and from a direct call."""
    from ddrl.registry import SAMPLERS

    auto = s.name == "auto"
    if not auto and s.name not in SAMPLERS:
        raise ConfigError(f"{key}.name={s.name!r} is not valid; choose one of: auto, {', '.join(SAMPLERS.names())}")
    for name in SAMPLERS.names() if auto else [s.name]:
        settings = getattr(SAMPLERS.get(name), "settings", None)  # None: a sampler registered without one
        if settings is not None and not (auto and settings.unread(s)):
            try:
                settings.read(s, key, name=name)
            except ValueError as e:
                raise ConfigError(str(e)) from None


# Why bf16 trainable weights are refused (config validation and build_optimizer say the same).
BF16_TRAINING = ("trainable parameters in bfloat16 learn nothing: an AdamW update of lr ~1e-6 on a weight of "
                 "~0.02 is below half a bf16 ulp and rounds to zero. Keep fp32 master weights with bf16 compute "
                 "(model.dtype=float32 model.mixed_precision=bf16; FSDP shards them) or train LoRA adapters "
                 "(model.lora.rank>0: peft keeps them in fp32 over a bf16 base)")
MIXED_PRECISION = ("none", "bf16")  # model.mixed_precision (ddrl.training.distributed applies it)
SHARDED_CHECKPOINTS = ("auto", True, False)  # train.sharded_checkpoints
RESUME = (True, False, "auto")  # resume


def _check_row_loss(method: Any, est_name: str) -> None:
    """train.micro_batch_rows with an estimator whose rows share tokens (random_ratio's masked copies):
    a chunk holds some of a sample's copies, so only a loss that sums per-row terms adds up over the
    chunks to the uncut loss; a token-level loss reads the mean over all copies."""
    from ddrl.objectives.ppo import ROW_AGGREGATIONS
    from ddrl.registry import ESTIMATORS, OBJECTIVES

    if not getattr(ESTIMATORS.get(est_name), "rows_share_tokens", False):
        return
    aggregation = method.objective_args.get("aggregation", getattr(OBJECTIVES.get(method.objective), "aggregation",
                                                                   None))
    if aggregation not in ROW_AGGREGATIONS:
        raise ConfigError(f"train.micro_batch_rows cuts estimator {est_name!r}'s masked copies into chunks, which only "
                          f"a per-row loss adds up over; objective {method.objective!r} has aggregation="
                          f"{aggregation!r}: set method.objective_args.aggregation=row_token_mean (objectives with "
                          f"row aggregations: unigrpo, tracerl) or use train.micro_batch_size")


def validate(cfg: Any) -> None:
    from ddrl.registry import ESTIMATORS, OBJECTIVES, PROCESSES, TASKS

    model = getattr(cfg, "model", None)
    if model is not None:
        if model.path is None:
            _choice(model.process, PROCESSES.names(), "model.process")
        _choice(model.schedule, ("linear", "cosine", "loglinear"), "model.schedule")
        _choice(model.architecture, ("transformer", "mdlm_dna"), "model.architecture")
        _choice(model.dtype, ("float32", "bfloat16"), "model.dtype")
        _choice(model.mixed_precision, MIXED_PRECISION, "model.mixed_precision")
        if model.dtype == "bfloat16" and model.lora.rank == 0 and isinstance(cfg, RLConfig):
            raise ConfigError(f"model.dtype=bfloat16 with full fine-tuning (model.lora.rank=0): {BF16_TRAINING}")
        if model.d_model % model.n_heads:
            raise ConfigError(f"model.d_model={model.d_model} must be divisible by model.n_heads={model.n_heads}")
    task = getattr(cfg, "task", None)
    if task is not None and ":" not in task.name:
        _choice(task.name, TASKS.names(), "task.name")
    if getattr(cfg, "device", "auto") not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={cfg.device!r} is not valid; choose one of: auto, cpu, cuda")

    if isinstance(cfg, RLConfig):
        validate_sampler(cfg.rollout, "rollout")
        m = cfg.method
        _choice(m.objective, OBJECTIVES.names(), "method.objective")
        if m.estimator is not None:
            _choice(m.estimator, ESTIMATORS.names(), "method.estimator")
        if m.advantage is not None:
            _choice(m.advantage, ("mean", "zscore", "loo"), "method.advantage")
        if m.advantage_std is not None:
            _choice(m.advantage_std, ("sample", "population"), "method.advantage_std")
        _choice(m.invalid_reward, ("drop", "zero"), "method.invalid_reward")
        if m.fresh_masks and m.reuse_masks:
            raise ConfigError("method.fresh_masks and method.reuse_masks exclude each other; set one to false")
        _check_args(OBJECTIVES.get(m.objective), m.objective_args, "method.objective_args")
        est_name = m.estimator or getattr(OBJECTIVES.get(m.objective), "default_estimator", None)
        if est_name is not None:
            _check_args(ESTIMATORS.get(est_name), m.estimator_args, "method.estimator_args")
        t = cfg.train
        if t.group_size < 2:
            raise ConfigError(f"train.group_size must be >= 2 for group advantages, got {t.group_size}")
        for name in ("steps", "prompts_per_step", "num_iterations", "minibatches"):
            if getattr(t, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")
        _choice(t.lr_schedule, ("constant", "cosine", "linear"), "train.lr_schedule")
        if t.group_filter is not None and (len(t.group_filter) != 2 or t.group_filter[0] > t.group_filter[1]):
            raise ConfigError(f"train.group_filter={t.group_filter} must be [lo, hi] with lo <= hi "
                              f"(e.g. [0.2, 0.8]), or null")
        if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):
            raise ConfigError(f"train.betas={t.betas} must be AdamW's two betas in [0, 1), e.g. [0.9, 0.99]")
        if t.minibatches > t.prompts_per_step:
            raise ConfigError(f"train.minibatches={t.minibatches} is more than train.prompts_per_step="
                              f"{t.prompts_per_step}: an optimizer step takes at least one whole prompt group "
                              f"(on any number of processes); set train.minibatches <= {t.prompts_per_step} "
                              f"(={t.prompts_per_step}: one group per optimizer step)")
        if t.prompts_per_step % t.minibatches:
            raise ConfigError(f"train.minibatches={t.minibatches} must divide train.prompts_per_step="
                              f"{t.prompts_per_step}: each optimizer step takes whole prompt groups")
        if t.micro_batch_rows is not None:
            if t.micro_batch_rows < 1:
                raise ConfigError(f"train.micro_batch_rows must be >= 1 (or null), got {t.micro_batch_rows}")
            if est_name is None or not hasattr(ESTIMATORS.get(est_name), "row_chunks"):
                raise ConfigError(f"train.micro_batch_rows cuts an estimator's own training rows (TraceRL's trace "
                                  f"states, UniGRPO's masked copies); estimator {est_name!r} has none: use "
                                  f"train.micro_batch_size")
            _check_row_loss(m, est_name)
        if t.sharded_checkpoints not in SHARDED_CHECKPOINTS:
            raise ConfigError(f"train.sharded_checkpoints={t.sharded_checkpoints!r} is not valid; choose one of: "
                              f"auto, true, false")
        if t.max_invalid_steps < 0:
            raise ConfigError(f"train.max_invalid_steps must be >= 0 (0 = never stop), got {t.max_invalid_steps}")
        if cfg.resume not in RESUME:
            raise ConfigError(f"resume={cfg.resume!r} is not valid; choose one of: true (continue, an error when "
                              f"there is nothing to continue), auto (continue, or start fresh), false (a new run)")
        if t.prompt_pool is not None and t.prompt_pool < 1:
            raise ConfigError(f"train.prompt_pool must be >= 1 (or null for new prompts every step), got {t.prompt_pool}")
        _choice(cfg.eval.split, ("test", "dev", "train"), "eval.split")  # ddrl.tasks.base.SPLITS
        if cfg.eval.report_split is not None:
            _choice(cfg.eval.report_split, ("test", "dev", "train"), "eval.report_split")
        if cfg.eval.report_n is not None and cfg.eval.report_n < 1:
            raise ValueError(f"eval.report_n must be >= 1 (or null = eval.n), got {cfg.eval.report_n}")
        _choice(cfg.dist.strategy, ("auto", "none", "ddp", "fsdp"), "dist.strategy")
        if cfg.dist.cpu_offload and cfg.dist.strategy != "fsdp":
            raise ConfigError(f"dist.cpu_offload=true is FSDP2's CPUOffloadPolicy; set dist.strategy=fsdp "
                              f"(got {cfg.dist.strategy!r}; it works in one process too)")
        if cfg.dist.timeout <= 0:
            raise ConfigError(f"dist.timeout must be a positive number of seconds, got {cfg.dist.timeout}")
    if isinstance(cfg, PretrainConfig):
        _choice(cfg.train.lr_schedule, ("constant", "cosine", "linear"), "train.lr_schedule")
        validate_sampler(cfg.sampler, "sampler")


def _check_args(component: Any, args: dict[str, Any], key: str) -> None:
    """Keyword arguments of an objective/estimator must be fields of its dataclass."""
    if not (isinstance(component, type) and dataclasses.is_dataclass(component)):  # registries hold classes
        return
    valid = {f.name for f in dataclasses.fields(component)}
    for k in args:
        if k not in valid:
            raise ConfigError(
                f"unknown key '{key}.{k}' for {getattr(component, 'name', component.__name__)}; "
                f"valid keys: {', '.join(sorted(valid)) or '(none)'}. If the config's {key} were written for "
                f"another method, clear them first: {key}={{}}"
            )
