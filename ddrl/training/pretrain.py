"""`ddrl pretrain CONFIG`: train a denoiser from scratch (or continue one) on prompt/completion pairs.

The loss is the forward process's own: the masked NELBO (MDLM/LLaDA, 1/t-weighted), the uniform
NELBO (UDLM) or cross-entropy, or for block diffusion the one-pass staircase ELBO (BD3-LM style),
all on completion tokens only; the prompt is never noised (as in LLaDA SFT). model.process=metric_path
builds a tiny URSA pipeline over the task's gray-level codebook (ddrl.models.ursa_init; task pairs carry
image "codes") and trains it with URSA's cross-entropy on the metric path; data.prompt_dropout trains
that fraction of each batch on the empty prompt, the unconditional branch of URSA's guidance.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ddrl.config import PretrainConfig, load_config, save_config, task_kwargs
from ddrl.data import encode_completions, encode_image_codes, encode_prompts, prompt_budget
from ddrl.processes.draws import make_generator, uniform_draw
from ddrl.training.common import build_optimizer, build_scheduler, check_writable, derive_seed, pick_device
from ddrl.training.logging import MetricsLogger


def _load_pairs(cfg: PretrainConfig, task: Any) -> tuple[list[dict], list[dict]]:
    if cfg.data.jsonl:
        path = Path(cfg.data.jsonl)
        if not path.is_file():
            raise ValueError(f"data.jsonl file {str(path)!r} does not exist")
        pairs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for i, p in enumerate(pairs[:3]):
            if "prompt" not in p or "completion" not in p:
                raise ValueError(f"{path}: line {i + 1} needs 'prompt' and 'completion' fields")
        n_held = min(cfg.data.n_heldout, max(1, len(pairs) // 10))
        return pairs[n_held:], pairs[:n_held]
    train = task.pretrain_pairs(cfg.data.n_train, seed=cfg.seed)
    held = task.pretrain_pairs(cfg.data.n_heldout, seed=derive_seed(cfg.seed, "heldout") % 2**31)
    return train, held


def _process_spec(cfg: PretrainConfig, task: Any, tokenizer: Any) -> dict[str, Any]:
    """model.process -> its spec; a uniform process corrupts the task's uniform_symbols only."""
    from ddrl.models import make_process_spec

    if cfg.model.process == "uniform":
        symbols = task.uniform_symbols
        if not symbols:
            raise ValueError(f"model.process=uniform needs a task with uniform_symbols; {task.name!r} has none")
        offset = tokenizer.convert_tokens_to_ids(symbols[0])
        return make_process_spec("uniform", num_classes=len(symbols), offset=offset, schedule=cfg.model.schedule)
    # block: its block_size is model.block_size, held by the model (build_model checks it is set)
    return make_process_spec(cfg.model.process, mask_token_id=tokenizer.mask_token_id, schedule=cfg.model.schedule)


def _init_ursa(cfg: PretrainConfig, task: Any, out: Path, pairs: list[dict]) -> Any:
    """model.process=metric_path: a fresh tiny URSA pipeline over the task's gray levels, written to
    <output_dir>/init and read back like any URSA directory (ddrl.models.ursa_init)."""
    from ddrl.models import load_model
    from ddrl.models.ursa_init import write_gray_level_pipeline

    levels = getattr(task, "image_levels", None)
    if not levels or "codes" not in pairs[0]:
        raise ValueError(f"model.process=metric_path builds an URSA model over a task's gray-level codebook: task "
                         f"{task.name!r} has no image_levels / image codes (use digits_image)")
    path = write_gray_level_pipeline(
        out / "init", words=task.symbols(), levels=int(levels), hidden_size=cfg.model.d_model,
        num_layers=cfg.model.n_layers, num_heads=cfg.model.n_heads, ffn_mult=cfg.model.ffn_mult,
        max_prompt_length=max(len(p["prompt"].split()) for p in pairs), seed=derive_seed(cfg.seed, "init") % 2**31,
        max_position_embeddings=cfg.model.max_seq_len)
    return load_model(path, require_tokenizer=True)


def _loss(model: Any, x0: torch.Tensor, eligible: torch.Tensor, attn: torch.Tensor, P: int,
          generator: torch.Generator) -> torch.Tensor:
    """The process's own loss on completion positions (block: one staircase pass over all blocks)."""
    loss, _ = model.process.pretrain_loss(model, x0, eligible, attn, generator=generator)
    return loss


def pretrain(config: str | Path | dict | PretrainConfig, overrides: list[str] | None = None) -> Path:
    """Run pretraining; returns the directory of the final model (`<output_dir>/final`)."""
    from ddrl.models import SymbolTokenizer, build_model, load_model
    from ddrl.tasks import get_task

    cfg = config if isinstance(config, PretrainConfig) else load_config(config, overrides, PretrainConfig)
    out = check_writable(cfg.output_dir)
    device = pick_device(cfg.device)
    task = get_task(cfg.task.name, **task_kwargs(cfg.task))
    train_pairs, held_pairs = _load_pairs(cfg, task)
    if not train_pairs:
        raise ValueError("pretraining data is empty; check data.jsonl or data.n_train")

    if cfg.model.path:
        model = load_model(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code, block_size=cfg.model.block_size,
                           require_tokenizer=True)
        tokenizer = model.tokenizer
    elif cfg.model.architecture == "mdlm_dna":  # the DNA CNN brings its own tokenizer and process
        model = build_model(cfg.model, None, generator_seed=derive_seed(cfg.seed, "init") % 2**31)
        tokenizer = model.tokenizer
    elif cfg.model.process == "metric_path":
        model = _init_ursa(cfg, task, out, train_pairs)
        tokenizer = model.tokenizer
    else:
        tokenizer = SymbolTokenizer(task.symbols())
        model = build_model(cfg.model, tokenizer, process_spec=_process_spec(cfg, task, tokenizer),
                            generator_seed=derive_seed(cfg.seed, "init") % 2**31)
    model.to(device).train()
    save_config(cfg, out / "config.yaml")

    L = cfg.sampler.gen_length
    max_prompt = prompt_budget(model, cfg.sampler, "sampler.max_prompt_length", "sampler.gen_length")

    def encode(pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        p_ids, p_mask = encode_prompts(tokenizer, [p["prompt"] for p in pairs], max_length=max_prompt,
                                       max_prompt_length=cfg.sampler.max_prompt_length)
        if "codes" in pairs[0]:  # an image task: codebook indices
            c_ids = encode_image_codes(model, [p["codes"] for p in pairs], L)
        else:
            c_ids = encode_completions(tokenizer, [p["completion"] for p in pairs], L)
        x0 = torch.cat([p_ids, c_ids], 1)  # [N, T]
        attn = torch.cat([p_mask, torch.ones_like(c_ids, dtype=torch.bool)], 1)
        eligible = torch.zeros_like(attn)
        eligible[:, p_ids.shape[1]:] = True
        return x0, attn, eligible, p_ids.shape[1]

    dropout = cfg.data.prompt_dropout
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"data.prompt_dropout must be in [0, 1), got {dropout}")
    # with prompt dropout, each pair is encoded twice (its prompt, then ""), padded together
    n_train = len(train_pairs)
    x_train, a_train, e_train, P = encode(train_pairs + ([{**p, "prompt": ""} for p in train_pairs] if dropout else []))
    x_held, a_held, e_held, P_held = encode(held_pairs)
    t = cfg.train
    opt = build_optimizer(model.parameters(), t.lr, t.weight_decay)
    sched = build_scheduler(opt, schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=t.steps,
                            min_lr_ratio=t.min_lr_ratio)
    logger = MetricsLogger(out, tensorboard=False)
    n_params = sum(p.numel() for p in model.parameters())
    bar = tqdm(range(1, t.steps + 1), desc=f"pretrain {task.name} ({n_params / 1e6:.2f}M params)",
               disable=not t.progress, dynamic_ncols=True)
    start = time.perf_counter()
    held_loss = float("nan")
    for step in bar:
        g = make_generator(derive_seed(cfg.seed, "pretrain", step))
        rows = torch.randint(0, n_train, (t.batch_size,), generator=g)
        if dropout:  # row i + n_train is pair i with the prompt ""
            rows = torch.where(uniform_draw((t.batch_size,), generator=g) < dropout, rows + n_train, rows)
        loss = _loss(model, x_train[rows].to(device), e_train[rows].to(device), a_train[rows].to(device), P, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"))
        opt.step()
        sched.step()
        metrics: dict[str, Any] = {"loss": loss.detach(), "grad_norm": grad_norm, "lr": sched.get_last_lr()[0]}
        if step % t.eval_every == 0 or step == t.steps:
            held_loss = _heldout_loss(model, x_held, a_held, e_held, P_held, cfg, device)
            metrics["heldout/loss"] = held_loss
        metrics["time/elapsed"] = time.perf_counter() - start
        logger.log(step, metrics)
        bar.set_postfix(loss=f"{loss.item():.3f}", heldout=f"{held_loss:.3f}")
        if t.save_every and step % t.save_every == 0 and step != t.steps:
            model.save_pretrained(out / f"checkpoint-{step}")
    logger.close()
    final = out / "final"
    model.save_pretrained(final)
    return final


@torch.no_grad()
def _heldout_loss(model: Any, x: torch.Tensor, attn: torch.Tensor, eligible: torch.Tensor, P: int,
                  cfg: PretrainConfig, device: torch.device) -> float:
    model.eval()
    total = 0.0
    bs = cfg.train.batch_size
    n_batches = min(cfg.train.eval_batches, max(1, (x.shape[0] + bs - 1) // bs))
    for b in range(n_batches):
        sl = slice(b * bs, (b + 1) * bs)
        if x[sl].shape[0] == 0:
            break
        g = make_generator(derive_seed(cfg.seed, "heldout-noise", b))  # the same noise at every eval
        total += _loss(model, x[sl].to(device), eligible[sl].to(device), attn[sl].to(device), P, g).item()
    model.train()
    return total / n_batches
