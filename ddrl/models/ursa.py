"""URSA pipeline directories -> DiffusionLM: the text-to-image family of UDM-GRPO, read natively.

    model = ddrl.load_model("/models/URSA-1.7B-IBQ512")          # a directory with model_index.json
    model.family                                                  # "ursa"
    ids, mask = model.encode_prompts(["a red cat"])               # [B, max_prompt_length + 1]: text, <bov>
    model(torch.cat([ids, codes + model.image_token_range[0]], 1)).logits   # [B, T, V], position i scores token i
    pixels = model.decode_images(codes.view(B, h, w))             # [B, 3, H, W] float in [0, 1]

An URSA checkpoint is a diffusers pipeline folder (no top-level config.json):

    model_index.json   {"_class_name": "URSAPipeline", "transformer": [module, class], "vae": ..., ...}
    transformer/       config.json + diffusion_pytorch_model.safetensors (URSATransformer3DModel)
    vae/               config.json + diffusion_pytorch_model.safetensors (AutoencoderVQ)
    scheduler/         scheduler_config.json (alpha, c, shift) + scheduler_model.pth ({"path.emb": codebook})
    tokenizer/         the Qwen3 tokenizer (tokenizer.json ...)

Nothing in it runs: ddrl.models.native.ursa builds the transformer and the VQ decoder from their
weights, ddrl.processes.metric_path the path from the scheduler files, ddrl.models.hf_tokenizer the
tokenizer without remote code. `load_model(dir, vq_path=VAE_DIR)` decodes with another AutoencoderVQ
directory instead of the pipeline's vae/.

The model: logits are realigned (URSA's position i scores token i + 1; DiffusionLM's logits_shifted)
and only codebook ids are ever sampled (logits_range = image_token_range: code c is token
lm_vocab_size + c). Its process is the metric path over the codebook; its sampler is
ddrl.sampling.metric_path (rollout.name=metric_path). The latent grid of an image is
model.image_shape (h, w), else square.

The prompt is URSA's: the text tokenized, truncated and left-padded to max_prompt_length (320, the
pipeline's default, or the tokenizer's model_max_length where that is smaller, as in the digits toy
whose prompt is one word: ddrl.models.ursa_init; set model.max_prompt_length) with the pad token *attended* (their pipeline passes
no mask), then <bov>. model.tokenizer (URSATokenizer) encodes every prompt in that fixed-length layout
(encode_prompt), so ddrl's trainer and eval, which tokenize then left-pad to the widest row
(ddrl.data.tokenize_prompts, pad_prompts), add no padding and get a mask of ones: the batch
model.encode_prompts gives, with no URSA case in the trainer.

save_pretrained writes the same layout back: transformer/ from the (trained) weights, vae/, scheduler/
and tokenizer/ copied from where they were read. The VQ decoder lives outside the module tree (it is
never trained, sharded or adapted); decode_images moves it to the codes' device.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from ddrl.data import prompt_parts
from ddrl.models.hf import HFDiffusionLM
from ddrl.models.hf_tokenizer import HFTokenizer, load_tokenizer, missing_tokenizer_error
from ddrl.models.io import CONFIG_FILE, INCOMPLETE_MARKER, ModelDirectoryError, atomic_directory, read_json, write_json
from ddrl.models.native.ursa import TRANSFORMER_CLASS, URSABackbone, VQDecoder
from ddrl.processes.metric_path import MetricPathProcess

PIPELINE_INDEX = "model_index.json"
PIPELINE_CLASS = "URSAPipeline"
SCHEDULER_CONFIG = "scheduler_config.json"
SCHEDULER_WEIGHTS = "scheduler_model.pth"
COMPONENTS = ("transformer", "vae", "scheduler", "tokenizer")
DEFAULT_MAX_PROMPT_LENGTH = 320  # URSAPipeline.__call__'s max_prompt_length

__all__ = ["URSADiffusionLM", "URSATokenizer", "is_pipeline_dir", "load_ursa"]


def is_pipeline_dir(path: str | Path) -> bool:
    """A diffusers pipeline folder: model_index.json and no top-level config.json."""
    p = Path(path)
    return (p / PIPELINE_INDEX).is_file() and not (p / CONFIG_FILE).is_file()


def read_pipeline_index(directory: Path) -> dict[str, Any]:
    """model_index.json, checked: an URSA pipeline with its four component folders."""
    if (directory / INCOMPLETE_MARKER).exists():
        raise ModelDirectoryError(f"model directory {str(directory)!r} is half-written (it still holds "
                                  f"{INCOMPLETE_MARKER}: a save was interrupted); use another checkpoint")
    index = read_json(directory / PIPELINE_INDEX)
    transformer = index.get("transformer")
    classes = [str(index.get("_class_name"))] + ([str(transformer[-1])] if isinstance(transformer, list) else [])
    if PIPELINE_CLASS not in classes and TRANSFORMER_CLASS not in classes:
        raise ModelDirectoryError(f"{str(directory)!r} is a diffusers pipeline of class {index.get('_class_name')!r} "
                                  f"(transformer {transformer!r}); ddrl reads {PIPELINE_CLASS} directories (URSA) only")
    missing = [c for c in COMPONENTS if not (directory / c).is_dir()]
    if missing:
        raise ModelDirectoryError(f"the URSA pipeline {str(directory)!r} is incomplete: it has no {', '.join(missing)} "
                                  f"folder; copy the whole pipeline directory")
    return index


def read_scheduler(directory: Path) -> tuple[dict[str, Any], Tensor]:
    """scheduler/ -> (scheduler_config.json, the codebook embedding "path.emb" [N, D] float32)."""
    config_file, weights = directory / SCHEDULER_CONFIG, directory / SCHEDULER_WEIGHTS
    for f in (config_file, weights):
        if not f.is_file():
            raise ModelDirectoryError(f"the URSA scheduler {str(directory)!r} has no {f.name}; the metric path needs "
                                      f"its alpha, c and shift ({SCHEDULER_CONFIG}) and codebook ({SCHEDULER_WEIGHTS})")
    config = read_json(config_file)
    if config.get("alpha") is None or config.get("c") is None:
        raise ModelDirectoryError(f"{str(config_file)!r} has no alpha / c: that is URSA's mixture path, not the metric "
                                  f"path ddrl implements")
    state = torch.load(str(weights), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "path.emb" not in state:
        raise ModelDirectoryError(f"{str(weights)!r} holds no 'path.emb' (the codebook embedding of the metric path)")
    return config, state["path.emb"].float()


class URSATokenizer(HFTokenizer):
    """URSA's Qwen3 tokenizer, whose prompt is fixed-length (module docstring): encode_prompt gives the
    text truncated (on the right) and left-padded with the pad id to max_prompt_length, then <bov>, as
    URSAPipeline.encode_prompt tokenizes (max_length, truncation, padding="max_length", left)."""

    def __init__(self, tokenizer: Any, *, mask_token_id: int, bov_token_id: int,
                 max_prompt_length: int = DEFAULT_MAX_PROMPT_LENGTH):
        super().__init__(tokenizer, mask_token_id=mask_token_id)
        self.bov_token_id, self.max_prompt_length = int(bov_token_id), int(max_prompt_length)

    def encode_prompt(self, prompt: Any, max_prompt_length: int | None = None) -> list[int]:
        """[pad ... pad, text ids, <bov>]: max_prompt_length + 1 ids (a str, or a ChatPrompt of one user turn)."""
        text, system, prefill = prompt_parts(prompt)
        if system is not None or prefill:
            raise ValueError("URSA's prompt is a caption: a ChatPrompt's system message or pre-fill has no place in "
                             f"it (system={system!r}, prefill={prefill!r})")
        length = int(max_prompt_length or self.max_prompt_length)
        ids = self.tokenizer(text, max_length=length, padding="max_length", padding_side="left",
                             truncation=True).input_ids
        return list(ids) + [self.bov_token_id]


class URSADiffusionLM(HFDiffusionLM):
    """DiffusionLM over URSA's transformer, with its VQ decoder, metric path and prompt layout (module docstring).

    decoder:          the VQ decoder (kept outside the module tree).
    codebook:         the metric path's codebook [N, D] (scheduler_model.pth "path.emb").
    scheduler_config: scheduler_config.json (alpha, c, shift).
    sources:          the folders vae/, scheduler/, tokenizer/ were read from, and model_index.json's content,
                      for save_pretrained.
    """

    vq_decoder: VQDecoder  # kept in __dict__, not a submodule (__init__)

    def __init__(self, model: URSABackbone, tokenizer: Any, *, decoder: VQDecoder, codebook: Tensor,
                 scheduler_config: dict[str, Any], sources: dict[str, Any], **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        self.__dict__["vq_decoder"] = decoder  # not a submodule: never trained, sharded, or moved by .to()
        self._codebook, self.scheduler_config, self.sources = codebook, dict(scheduler_config), dict(sources)
        self._metric_process: MetricPathProcess | None = None
        self._max_prompt_length = DEFAULT_MAX_PROMPT_LENGTH  # used when there is no tokenizer to hold it

    # ------------------------------------------------------------------ what URSA adds
    @property
    def bov_token_id(self) -> int:  # type: ignore[override]  # derived here
        return int(self.model.config.bov_token_id)

    @property
    def max_prompt_length(self) -> int:
        """The text part of URSA's prompt, in tokens (320 for the released models); the tokenizer's."""
        tokenizer = self.tokenizer
        return tokenizer.max_prompt_length if isinstance(tokenizer, URSATokenizer) else self._max_prompt_length

    @max_prompt_length.setter
    def max_prompt_length(self, length: int) -> None:
        if isinstance(self.tokenizer, URSATokenizer):
            self.tokenizer.max_prompt_length = int(length)
        self._max_prompt_length = int(length)

    @property
    def image_shape(self) -> tuple[int, int] | None:
        """The latent grid (h, w) of the image tokens; None = square."""
        return self.model.image_shape

    @image_shape.setter
    def image_shape(self, shape: Sequence[int] | None) -> None:
        self.model.image_shape = None if shape is None else (int(shape[0]), int(shape[1]))

    @property
    def process(self) -> MetricPathProcess:
        """The metric path over the codebook, from the pipeline's scheduler/ (built once)."""
        if self._metric_process is None:
            assert self.image_token_range is not None  # load_ursa sets it: an URSA model's codes are images
            lo, hi = self.image_token_range
            sched = self.scheduler_config
            self._metric_process = MetricPathProcess(hi - lo, lo, codebook=self._codebook, alpha=sched["alpha"],
                                                     c=sched["c"], shift=sched.get("shift", 1.0),
                                                     eps=sched.get("eps", 1e-5))
        return self._metric_process

    def encode_prompts(self, texts: Sequence[str], max_prompt_length: int | None = None) -> tuple[Tensor, Tensor]:
        """URSA's prompts (URSATokenizer.encode_prompt): -> (ids [B, P + 1], attention mask [B, P + 1] of ones:
        URSA attends its padding)."""
        if not isinstance(self.tokenizer, URSATokenizer):
            raise ValueError("this URSA model was loaded without a tokenizer (no tokenizer/ folder)")
        ids = torch.tensor([self.tokenizer.encode_prompt(t, max_prompt_length) for t in texts], dtype=torch.long)
        return ids, torch.ones_like(ids)

    @torch.no_grad()
    def decode_images(self, codes: Tensor) -> Tensor:
        """Codebook indices [B, h, w] (long) -> pixels [B, 3, H, W] float32 in [0, 1] (clamp(x / 2 + 1/2))."""
        if codes.dim() != 3 or codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be a [B, h, w] integer tensor of codebook indices, got {codes.dtype} "
                             f"{list(codes.shape)} (vocabulary ids: subtract image_token_range[0] first)")
        decoder = self.vq_decoder
        size = decoder.codebook_size
        if bool(((codes < 0) | (codes >= size)).any()):
            raise ValueError(f"codes must be codebook indices in [0, {size}); got values in "
                             f"[{int(codes.min())}, {int(codes.max())}] (vocabulary ids: subtract "
                             f"image_token_range[0] = {self.image_token_range and self.image_token_range[0]})")
        if decoder.post_quant_conv.weight.device != codes.device:
            decoder.to(codes.device)
        return decoder(codes.long()).float().mul(0.5).add(0.5).clamp(0.0, 1.0)

    # ------------------------------------------------------------------ persistence (the pipeline layout)
    def save_pretrained(self, directory: str | Path, *, state_dict: dict[str, Tensor] | None = None,
                        merge_adapter: bool = False) -> None:
        """Write the pipeline folder (module docstring), atomically. state_dict: the full weights keyed like
        self.state_dict() (e.g. gathered FSDP2 shards); None = this module's own."""
        if hasattr(self.model, "peft_config"):
            raise ValueError("saving an URSA model with a LoRA adapter in the pipeline layout is not supported; merge "
                             "the adapter into the weights first (ddrl.models.lora)")
        backbone_state = None
        if state_dict is not None:
            backbone_state = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        with atomic_directory(directory) as tmp:
            write_json(tmp / PIPELINE_INDEX, self.sources["index"])
            self.model.save_pretrained(tmp / "transformer", backbone_state)
            for name in ("vae", "scheduler", "tokenizer"):
                source = Path(self.sources[name])
                if not source.is_dir():
                    raise ModelDirectoryError(f"cannot save: the {name}/ folder this model was read from "
                                              f"({str(source)!r}) is gone; save needs it to copy")
                shutil.copytree(source, tmp / name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, image_token_range={self.image_token_range}"


def load_ursa(path: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
              vq_path: str | Path | None = None, mask_token_id: int | None = None,
              require_tokenizer: bool = False) -> URSADiffusionLM:
    """An URSA pipeline directory -> URSADiffusionLM (module docstring). dtype applies to the transformer
    (None keeps the stored one) and the VQ decoder (None: float32); vq_path replaces the pipeline's vae/."""
    directory = Path(path)
    index = read_pipeline_index(directory)
    tokenizer_dir = directory / "tokenizer"
    hf_tokenizer = load_tokenizer(tokenizer_dir, native=True)
    if hf_tokenizer is None and require_tokenizer:
        raise missing_tokenizer_error(tokenizer_dir, "this run encodes prompts with it")
    scheduler_config, codebook = read_scheduler(directory / "scheduler")
    vae_dir = Path(vq_path) if vq_path is not None else directory / "vae"
    backbone = URSABackbone.from_pretrained(directory / "transformer", device=device, dtype=dtype)
    decoder = VQDecoder.from_pretrained(vae_dir, device=device, dtype=dtype or torch.float32)
    config = backbone.config
    lo, hi = config.image_token_range
    checks = [(codebook.shape[0] == hi - lo, f"scheduler_model.pth's codebook has {codebook.shape[0]} entries"),
              (decoder.codebook_size == hi - lo,
               f"the VQ decoder in {str(vae_dir)!r} has {decoder.codebook_size} codes")]
    for ok, what in checks:
        if not ok:
            raise ModelDirectoryError(f"{what}, but the transformer's head scores {hi - lo} (lm_head_size); the "
                                      f"components of {str(directory)!r} do not belong together")
    if hf_tokenizer is not None and len(hf_tokenizer) != lo:
        raise ModelDirectoryError(f"the tokenizer in {str(tokenizer_dir)!r} has {len(hf_tokenizer)} tokens but the "
                                  f"transformer's lm_vocab_size is {lo} (codes start there); use the pipeline's own")
    pad = getattr(hf_tokenizer, "pad_token_id", None)
    mask_id = mask_token_id if mask_token_id is not None else (pad if pad is not None else config.bov_token_id)
    # the pipeline's 320, or the tokenizer's model_max_length where smaller (a toy's 1-word prompts)
    max_prompt = min(DEFAULT_MAX_PROMPT_LENGTH, int(getattr(hf_tokenizer, "model_max_length", None) or
                                                    DEFAULT_MAX_PROMPT_LENGTH))
    tokenizer = None if hf_tokenizer is None else URSATokenizer(hf_tokenizer, mask_token_id=mask_id,
                                                                bov_token_id=config.bov_token_id,
                                                                max_prompt_length=max_prompt)
    sched = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    spec: dict[str, Any] = {"name": "metric_path", "num_classes": hi - lo, "offset": lo,
            **{k: sched[k] for k in ("alpha", "c", "shift") if k in sched}}
    model = URSADiffusionLM(
        backbone, tokenizer, decoder=decoder, codebook=codebook, scheduler_config=sched,
        sources={"index": index, "vae": str(vae_dir), "scheduler": str(directory / "scheduler"),
                 "tokenizer": str(tokenizer_dir)},
        mask_token_id=mask_id, vocab_size=config.vocab_size, family="ursa", logits_shifted=True, process_spec=spec,
        attention="native", image_token_range=(lo, hi), logits_range=(lo, hi),
        pad_token_id=pad, stop_token_ids=())
    return model.to(device=device) if device is not None else model
