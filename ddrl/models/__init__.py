"""The model layer: the denoiser contract, the built-in transformer, loading and building.

    model = load_model("checkpoints/mini_sudoku-masked")      # built-in or Hugging Face directory
    model = build_model(cfg.model, tokenizer)                  # a fresh built-in model
    logits = model(input_ids, attention_mask).logits           # [B, T, V]

Checkpoint directories that are not built-in go to ddrl.models.hf (native LLaDA, MMaDA, Dream,
SDAR/TraDo; DiffusionGemma and other models through transformers), URSA pipeline folders to
ddrl.models.ursa, imported here lazily: only those paths import transformers. Where things live: families.py (which family a directory is),
hf_tokenizer.py (Hugging Face tokenizers), feeds.py (how masks reach a backbone), backbone.py
(blocks and LM head of any backbone), lora.py (LoRA), native/ (ddrl's own model code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddrl.models.diffusion_lm import DiffusionLM, DiffusionLMOutput, check_requested_block_size, make_process_spec
from ddrl.models.io import (CONFIG_FILE, HF_WEIGHT_FILES, ModelDirectoryError, atomic_directory, check_model_dir,
                            consolidated_model_dir, is_sharded_checkpoint, read_json)
from ddrl.models.tokenizer import SymbolTokenizer
from ddrl.models.transformer import MODEL_TYPE, Denoiser, DenoiserConfig, DenoiserOutput, swiglu_hidden

__all__ = [
    "DiffusionLM", "DiffusionLMOutput", "Denoiser", "DenoiserConfig", "DenoiserOutput", "SymbolTokenizer",
    "ModelDirectoryError", "atomic_directory", "build_model", "load_model", "make_process_spec", "resolve_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """"bfloat16" / torch.bfloat16 / None -> torch dtype or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; choose one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(path: str | Path, *, device: torch.device | str | None = None,
               dtype: torch.dtype | str | None = None, mask_token_id: int | None = None,
               trust_remote_code: bool = False, block_size: int | None = None,
               require_tokenizer: bool = False, vq_path: str | Path | None = None,
               t2i_attend_padding: bool | None = None) -> DiffusionLM:
    """A saved model directory -> DiffusionLM: built-in (config.json model_type "ddrl_denoiser")
    or a checkpoint directory (LLaDA, Dream, SDAR, ... through ddrl.models.hf).

    trust_remote_code: run modeling code shipped in a non-native directory (ModelConfig.trust_remote_code).
    block_size:        the block size asked for (ModelConfig.block_size); None = the checkpoint's own,
                       anything else must equal it.
    require_tokenizer: fail, before reading weights, when the directory has no tokenizer.
    vq_path:           the image decoder: URSA's AutoencoderVQ directory (instead of the pipeline's vae/),
                       or MMaDA's MAGVIT-v2 directory, which makes the MMaDA generate images
                       (ddrl.models.mmada: t2i prompt layout, image-code completions, decode_images).
    t2i_attend_padding: a text-to-image MMaDA only (ModelConfig.t2i_attend_padding): True lays prompts out as
                       MaskGRPO's rows, [iPAD]-padded and attended (their LLaDA copy ignores the attention
                       mask), False as MMaDA's (padding masked); None keeps the saved choice (False). Any
                       other model refuses it (ddrl.models.mmada).

    A Lightning `.ckpt` file of DRAKES / SEPO's MDLM DNA model (or a directory ddrl saved it to) is read
    natively by ddrl.models.mdlm_dna: family "mdlm_dna", mask id 4 after A, C, G, T (needs omegaconf).

    An URSA pipeline folder (model_index.json, no top-level config.json) is read natively by
    ddrl.models.ursa: family "ursa", model.decode_images, the metric-path process.

    A sharded training checkpoint (train.sharded_checkpoints) is read in this process alone: its
    shards are consolidated into a temporary model directory (ddrl.models.io.consolidate_checkpoint).
    Under `with torch.device("meta")` the built-in and native families read no weight data.
    """
    from ddrl.models import mdlm_dna, ursa  # URSA: a diffusers pipeline folder (no top-level config.json)
    from ddrl.models.mmada import not_text_to_image

    if mdlm_dna.is_lightning_checkpoint(path) or mdlm_dna.is_mdlm_dna_dir(path):  # DRAKES / SEPO's DNA model
        if block_size is not None or vq_path is not None:
            raise ValueError(f"{str(path)!r} is an MDLM DNA model: block_size and vq_path do not apply; unset them")
        if t2i_attend_padding is not None:
            raise not_text_to_image(f"{str(path)!r} is an MDLM DNA model")
        if mask_token_id not in (None, mdlm_dna.MASK_ID):
            raise ValueError(f"model.mask_token_id={mask_token_id}: the MDLM DNA model's mask id is {mdlm_dna.MASK_ID}")
        load = mdlm_dna.load_dir if Path(path).is_dir() else mdlm_dna.load_lightning_checkpoint
        return load(path, device=device, dtype=resolve_dtype(dtype))

    if ursa.is_pipeline_dir(path):
        if t2i_attend_padding is not None:
            raise not_text_to_image(f"{str(path)!r} is an URSA pipeline")
        if block_size is not None:
            raise ValueError(f"block_size={block_size}: {str(path)!r} is an URSA pipeline (full attention); unset it")
        return ursa.load_ursa(path, device=device, dtype=resolve_dtype(dtype), vq_path=vq_path,
                              mask_token_id=mask_token_id, require_tokenizer=require_tokenizer)
    if (Path(path) / CONFIG_FILE).is_file() and read_json(Path(path) / CONFIG_FILE).get("_class_name") == (
            ursa.TRANSFORMER_CLASS):
        raise ModelDirectoryError(f"{str(path)!r} is the transformer/ folder of an URSA pipeline; pass the pipeline "
                                  f"directory that holds it (its parent, with model_index.json)")
    if is_sharded_checkpoint(path):  # a sharded training checkpoint: its shards, consolidated in a temp dir
        with consolidated_model_dir(path) as directory:
            return load_model(directory, device=device, dtype=dtype, mask_token_id=mask_token_id,
                              trust_remote_code=trust_remote_code, block_size=block_size,
                              require_tokenizer=require_tokenizer, vq_path=vq_path,
                              t2i_attend_padding=t2i_attend_padding)
    directory = check_model_dir(path, weights=HF_WEIGHT_FILES)
    torch_dtype = resolve_dtype(dtype)
    if read_json(directory / CONFIG_FILE).get("model_type") == MODEL_TYPE:
        if vq_path is not None:
            raise ValueError(f"vq_path applies to URSA pipelines and MMaDA; {str(directory)!r} is a built-in model")
        if t2i_attend_padding is not None:
            raise not_text_to_image(f"{str(directory)!r} is a built-in model")
        model = DiffusionLM.from_pretrained(directory, device=device, dtype=torch_dtype)
        if mask_token_id is not None and mask_token_id != model.mask_token_id:
            raise ValueError(f"model.mask_token_id={mask_token_id} differs from the built-in model's own "
                             f"({model.mask_token_id}); leave model.mask_token_id unset for built-in models")
        check_requested_block_size(block_size, model.block_size, f"the built-in model {str(directory)!r}")
        if require_tokenizer and model.tokenizer is None:
            raise ModelDirectoryError(f"the built-in model {str(directory)!r} has no tokenizer.json; save the model "
                                      f"with its tokenizer (DiffusionLM(backbone, tokenizer).save_pretrained)")
        return model
    from ddrl.models import hf  # imports transformers: only for Hugging Face directories

    return hf.load_hf_model(str(directory), device=device, dtype=torch_dtype, mask_token_id=mask_token_id,
                            trust_remote_code=trust_remote_code, block_size=block_size,
                            require_tokenizer=require_tokenizer, vq_path=vq_path,
                            t2i_attend_padding=t2i_attend_padding)


def build_model(model_cfg: Any, tokenizer: Any, *, process_spec: dict[str, Any] | None = None,
                generator_seed: int = 0) -> DiffusionLM:
    """A freshly initialised built-in DiffusionLM sized by a ddrl.config.ModelConfig (architecture mdlm_dna:
    the DNA CNN with its own tokenizer and process; `tokenizer` and `process_spec` are then unused).

    The initial weights depend only on generator_seed (the global RNG is not used).
    """
    if model_cfg.path is not None:
        raise ValueError(
            f"model.path={model_cfg.path!r} is set: load that model with load_model, or unset model.path to build one"
        )
    if model_cfg.architecture == "mdlm_dna":  # the DNA CNN brings its own tokenizer and process
        from ddrl.models.mdlm_dna import build_mdlm_dna

        return build_mdlm_dna(model_cfg, generator_seed)
    spec = process_spec or make_process_spec(model_cfg.process, mask_token_id=tokenizer.mask_token_id,
                                             schedule=model_cfg.schedule)
    if spec["name"] == "block" and model_cfg.block_size is None:
        raise ValueError("model.process='block' needs model.block_size (the block diffusion block length); set it")
    config = DenoiserConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=model_cfg.d_model,
        n_layers=model_cfg.n_layers,
        n_heads=model_cfg.n_heads,
        ffn_hidden=swiglu_hidden(model_cfg.d_model, model_cfg.ffn_mult),
        max_seq_len=model_cfg.max_seq_len,
        block_size=model_cfg.block_size,
        dropout=model_cfg.dropout,
    )
    backbone = Denoiser(config, seed=generator_seed)
    model = DiffusionLM(  # block_size: the backbone config's
        backbone, tokenizer, process_spec=spec, family="ddrl",
        # An absorbing process never has the mask as a clean token, so the denoiser never predicts it.
        suppress_mask_logit="mask_token_id" in spec,
    )
    model.to(dtype=resolve_dtype(model_cfg.dtype))
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model
