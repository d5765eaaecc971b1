"""LoRA on a DiffusionLM, through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of LLMs").

    model = apply_lora(model, LoraConfig(rank=16, alpha=32, target_modules=["q_proj", "v_proj"]))
    with model.disable_adapter():      # the RL reference: the frozen base, no second copy of it
        ref_logits = model(ids).logits
    merge_and_save(model, "runs/x/merged")   # a plain model directory: W + (alpha / r) B A
    save_adapter(model, "runs/x/adapter")     # the adapter alone, in peft's layout

apply_lora wraps the backbone (`model.model`) in a peft PeftModel and keeps the DiffusionLM
wrapper, so samplers, estimators and the trainer see the same object. Only the adapter's A and B
matrices are trainable.

**Which layers** (`lora_targets`). Module names are the backbone's (`model.model.named_modules()`,
i.e. the checkpoint's weight names without ".weight"). Each entry of target_modules and
exclude_modules is, as in peft:
  * a name, plain or dotted ("q_proj", "self_attn.q_proj"): every module whose full name is it or
    ends with "." + it (peft's rule for a list);
  * "re:<regex>": every module whose full name the regex matches entirely (peft's rule for a string).
Only nn.Linear layers are adapted (a matched wrapper such as DiffusionGemma's vision-tower
Gemma4ClippableLinear is skipped with a note; its inner `.linear` can be named, or the tower
excluded: exclude_modules: ["re:.*vision_tower.*"]). Entries that match nothing are reported in a
warning, not an error (d1's LLaMA-named list matched only q/k/v/up_proj on LLaDA); nothing matched
at all is an error listing the model's linear layer names. The log (logger "ddrl") lists the
wrapped layers.

**The LM head** (backbone.get_output_embeddings() or its `lm_head`) is adapted only when an
entry is its full dotted path. An entry that reaches it otherwise is read as meaning the blocks:
LLaDA's blocks call their MLP output `ff_out`, and so is its untied LM head
(`model.transformer.ff_out`), so "ff_out" adapts the blocks and skips the head with a logged note.
An entry that would match the head and nothing else ("lm_head") is an error naming the path.

Module names per family: the built-in Denoiser, Dream, SDAR and DiffusionGemma's text layers use
LLaMA's (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); LLaDA and MMaDA use
q_proj, k_proj, v_proj, attn_out (attention output), ff_proj (gate), up_proj, ff_out (down).

A LoRA model's save_pretrained (so every trainer checkpoint) writes the *base* weights as a plain
model directory plus the adapter in DIR/adapter/; load_model re-attaches it, so a checkpoint
resumes and evaluates as it was trained. The base weights are written so that the directory stays
self-contained; merge_and_save writes the deployable merged model instead. The adapter's
adapter_config.json names the wrapped layers exactly (one regex of their full names).

Merging is computed from a state dict (W + scale * B @ A per adapted linear layer), not by
peft's in-place merge, so it neither modifies the training model nor needs unsharded modules:
a sharded (FSDP2) run merges the gathered full state dict.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ddrl.models.backbone import drop_input_grad_hooks, output_projection
from ddrl.models.diffusion_lm import ADAPTER_DIR, DiffusionLM, ModelT, save_backbone

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["apply_lora", "lora_targets", "save_adapter", "load_adapter", "merge_and_save", "split_lora_state",
           "is_lora"]

logger = logging.getLogger("ddrl")
REGEX_PREFIX = "re:"  # a target_modules / exclude_modules entry that is a regex over full module names

ADAPTER = "default"  # the peft adapter name ddrl uses
_PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's parameter names
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_lora(model: Any) -> bool:
    return hasattr(getattr(model, "model", None), "peft_config")


def apply_lora(model: DiffusionLM, cfg: Any, *, seed: int = 0) -> DiffusionLM:
    """Add a LoRA adapter (ddrl.config.LoraConfig: rank, alpha, dropout, target_modules,
    exclude_modules) to the backbone, on the layers lora_targets picks (module docstring).

    Returns the same DiffusionLM, its backbone now a peft PeftModel whose base weights are frozen.
    A is drawn as peft draws it (Kaiming-uniform, bound 1/sqrt(fan_in)) but from a generator seeded
    with `seed` instead of the global RNG, so every process of a run starts from the same adapter;
    B = 0, so the adapted model starts as the base model.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if is_lora(model):
        raise ValueError("this model already has a LoRA adapter; apply_lora once")
    if not isinstance(cfg.rank, int) or cfg.rank <= 0:
        raise ValueError(f"model.lora.rank must be a positive integer to apply LoRA, got {cfg.rank!r}")
    names = lora_targets(model.model, list(cfg.target_modules or []), list(getattr(cfg, "exclude_modules", None) or []))
    exact = "(?:" + "|".join(re.escape(n) for n in names) + ")"  # peft fullmatches a string target
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=exact,
                              bias="none")
    model.model = get_peft_model(model.model, peft_cfg)
    drop_input_grad_hooks(model.model)  # peft's, for reentrant checkpointing: ddrl's is non-reentrant
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            if ".lora_A." in name:
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float32) * 2 - 1) * bound)
    return model


def _matches(entry: str, name: str) -> bool:
    if entry.startswith(REGEX_PREFIX):
        return re.fullmatch(entry[len(REGEX_PREFIX):], name) is not None
    return name == entry or name.endswith("." + entry)


def lora_targets(backbone: nn.Module, targets: list[str], exclude: list[str] | None = None) -> list[str]:
    """The full names of the linear layers LoRA wraps (rules in the module docstring); logs them.

    Errors, before any adapter is built: nothing matched; an entry that matches only the LM head
    without being its full path; a malformed regex.
    """
    exclude = list(exclude or [])
    for entry in targets + exclude:
        if entry.startswith(REGEX_PREFIX):
            try:
                re.compile(entry[len(REGEX_PREFIX):])
            except re.error as e:
                raise ValueError(f"model.lora entry {entry!r} is not a valid regex ({e}); write 're:<python regex>' "
                                 f"matching whole module names") from None
    modules = {name: m for name, m in backbone.named_modules() if name}
    head = output_projection(backbone)
    head_name = head[0] if head is not None else None
    excluded = {n for n in modules if any(_matches(e, n) for e in exclude)}
    chosen: list[str] = []
    unmatched: list[str] = []
    skipped_head: list[str] = []
    not_linear: set[str] = set()
    for entry in targets:
        hits = [n for n in modules if _matches(entry, n)]
        if hits and all(n in excluded for n in hits):
            continue  # asked for and excluded: exclude_modules wins, nothing to report
        hits = [n for n in hits if n not in excluded]
        not_linear.update(n for n in hits if not isinstance(modules[n], nn.Linear))
        hits = [n for n in hits if isinstance(modules[n], nn.Linear)]
        if head_name in hits and entry != head_name:
            hits.remove(head_name)
            if not hits:
                raise ValueError(f"model.lora.target_modules entry {entry!r} matches only the LM head "
                                 f"{head_name!r}; LoRA on the LM head must be asked for by its full path "
                                 f"(target_modules: [{head_name}]), or drop {entry!r}")
            skipped_head.append(entry)
        if not hits:
            unmatched.append(entry)
        chosen += [n for n in hits if n not in chosen]
    if not chosen:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)})
        raise ValueError(f"model.lora.target_modules {targets} (exclude_modules {exclude}) matches no linear layer of "
                         f"this {type(backbone).__name__}; its linear layers are named: {', '.join(linear)} (plain or "
                         f"dotted names match name suffixes, 're:<regex>' whole names)")
    if unmatched:
        logger.warning("LoRA: model.lora.target_modules entries that match no linear layer of %s (ignored): %s",
                       type(backbone).__name__, ", ".join(unmatched))
    if skipped_head:
        logger.warning("LoRA: the LM head %s is not adapted although %s match it: name it by its full path to adapt it",
                       head_name, ", ".join(repr(e) for e in skipped_head))
    if not_linear:
        logger.info("LoRA: skipped %d matched modules that are not nn.Linear (e.g. %s); name their inner linear "
                    "layers, or exclude them with exclude_modules", len(not_linear), sorted(not_linear)[0])
    logger.info("LoRA wraps %d linear layers: %s", len(chosen), _summarise(chosen))
    return chosen


def _summarise(names: list[str]) -> str:
    """["a.0.q", "a.1.q", "b"] -> "a.*.q (x2), b": layer indices folded, so an 8B model's list stays readable."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        groups[re.sub(r"\.\d+(?=\.|$)", ".*", name)].append(name)
    return ", ".join(found[0] if len(found) == 1 else f"{key} (x{len(found)})" for key, found in groups.items())


# --------------------------------------------------------------------------------------------
# State dicts: base part, adapter part, merged
# --------------------------------------------------------------------------------------------


def split_lora_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A PeftModel's state dict -> (base weights under the base model's own names, LoRA tensors as given)."""
    base, adapter = {}, {}
    for key, value in state.items():
        if ".lora_" in key:
            adapter[key] = value
            continue
        name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        base[name.replace(".base_layer.", ".")] = value
    return base, adapter


def merged_state(peft_model: PeftModel, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Base weights with every LoRA update folded in: W + scale * B @ A (computed in float32)."""
    base, adapter = split_lora_state(state)
    suffix = f".lora_A.{ADAPTER}.weight"
    inner = peft_model.get_base_model()
    for key in adapter:
        if not key.endswith(suffix):
            continue
        layer_name = key[len(_PEFT_PREFIX):-len(suffix)]
        layer: Any = inner.get_submodule(layer_name)  # a peft LoraLayer (scaling, use_dora, fan_in_fan_out)
        if getattr(layer, "use_dora", {}).get(ADAPTER, False):
            raise ValueError(f"{layer_name} uses DoRA, which merge_and_save does not merge; merge with peft instead")
        a = adapter[key].float()  # [r, in]
        b = adapter[key.replace(".lora_A.", ".lora_B.")].float()  # [out, r]
        delta = layer.scaling[ADAPTER] * (b @ a)  # [out, in]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        w = base[f"{layer_name}.weight"]
        base[f"{layer_name}.weight"] = (w.float() + delta.to(w.device)).to(w.dtype)
    return base


def save_adapted_backbone(peft_model: PeftModel, directory: Path, state: dict[str, Tensor] | None = None, *,
                          merge: bool = False) -> None:
    """Write a LoRA backbone: base weights + DIR/adapter/, or (merge=True) the merged weights only.

    state: the PeftModel's full state dict (gathered under FSDP2); None = its own.
    """
    state = peft_model.state_dict() if state is None else state
    inner = peft_model.get_base_model()
    if merge:
        save_backbone(inner, directory, merged_state(peft_model, state))
        _drop_peft_config_keys(directory)
        return
    base, _ = split_lora_state(state)
    save_backbone(inner, directory, base)
    _drop_peft_config_keys(directory)
    _write_adapter(peft_model, Path(directory) / ADAPTER_DIR, state)


def _write_adapter(peft_model: PeftModel, directory: Path, state: dict[str, Tensor]) -> None:
    from peft import get_peft_model_state_dict

    directory.mkdir(parents=True, exist_ok=True)
    weights = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=ADAPTER)
    weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    peft_model.peft_config[ADAPTER].save_pretrained(str(directory))


def _drop_peft_config_keys(directory: Path) -> None:
    """Hugging Face's save of a model holding injected LoRA layers may record them; a base directory must not."""
    path = Path(directory) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        if config.pop("_hf_peft_config_loaded", None) is not None:
            path.write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Public save / load
# --------------------------------------------------------------------------------------------


def save_adapter(model: DiffusionLM, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
    """The adapter alone (adapter_config.json + adapter_model.safetensors, peft's layout)."""
    if not is_lora(model):
        raise ValueError("this model has no LoRA adapter to save; apply one with apply_lora")
    state = None
    if state_dict is not None:
        state = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
    directory = Path(directory)
    _write_adapter(model.model, directory, model.model.state_dict() if state is None else state)
    return directory


def load_adapter(model: ModelT, directory: str | Path, *, trainable: bool = True) -> ModelT:
    """Attach a saved adapter (save_adapter's or a checkpoint's adapter/) to a plain DiffusionLM."""
    from peft import PeftModel

    if is_lora(model):
        raise ValueError("this model already has a LoRA adapter; load the adapter into the base model")
    directory = Path(directory)
    if not (directory / "adapter_config.json").is_file():
        raise ValueError(f"{str(directory)!r} holds no adapter_config.json; pass a directory written by save_adapter")
    model.model = PeftModel.from_pretrained(model.model, str(directory), adapter_name=ADAPTER,
                                            is_trainable=trainable)
    return model


def merge_and_save(model: DiffusionLM, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
    """Merge the adapter into the base weights and save a plain model directory (load_model reads it).

    The training model is left as it was. state_dict: the gathered full state dict under FSDP2.
    """
    if not is_lora(model):
        raise ValueError("this model has no LoRA adapter to merge; save it with model.save_pretrained")
    model.save_pretrained(directory, state_dict=state_dict, merge_adapter=True)
    return Path(directory)
