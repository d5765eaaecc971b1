"""MMaDA text-to-image: its prompt layout, the MAGVIT-v2 decoder and the image completion.

    model = ddrl.load_model("/models/MMaDA-8B-Base", vq_path="/models/magvitv2")
    model.tokenizer.encode_prompt("a red cat")       # the t2i layout, ending with <|soi|>
    model.completion_suffix                          # (<|eoi|>,): the fixed token after the image
    pixels = model.decode_images(codes)              # [B, h, w] codes -> [B, 3, 16h, 16w] in [0, 1]

A MMaDA loaded with a `vq_path` generates images: its prompts take the text-to-image layout, its
completions are image codes (logits_range = image_token_range, code c = token len(tokenizer) + c,
ddrl.models.families) and rewards get the decoded pixels (ddrl.data.task_completions).

**The layout** (Gen-Verse/MMaDA @ 3cdb870 training/prompting_utils.py `t2i_gen_prompt`, reserved
token ids of `reserved_token_mapping`; MaskGRPO @ b74ba3c builds the same):

    [iPAD] ... [iPAD] <|t2i|> <bos> text <eos>   (max_text_len + 1 = 257 tokens: left padding)
    <|soi|>                                      (the prompt ends here)
    1024 image slots                             (the completion)
    <|eoi|>                                      (the completion suffix)

A text longer than max_text_len + 1 tokens (with <|t2i|>, <bos> and <eos>) keeps its first tokens and
ends with <eos>, as theirs. The padding is *masked* there (MMaDA passes attention_bias = mask_i & mask_j),
so `encode_prompt` returns the real tokens only and ddrl's left padding + attention mask give the same
logits (positions count real tokens; RoPE is relative: float rounding). MaskGRPO's copy of LLaDA passes
`attn_mask=None` (its models/modeling_llada.py:715), so its rollouts and log-probs attend to the [iPAD]
padding at absolute positions: `attend_padding=True` reproduces that released deviation (the rows come
back padded to 257 + 1 tokens, every token real, so the sampler and the estimators get an all-ones prompt
mask). It is chosen at load: `model.t2i_attend_padding: true` in a `ddrl train` config
(load_model(..., t2i_attend_padding=True)); a save records it (t2i_attend_padding), so a reload, and
`ddrl eval` of the saved run, lays prompts out the same way. Default false: MMaDA's own masked padding.

**The completion suffix.** <|eoi|> follows the image in every pass: `completion_suffix` is read by the
sampler (ddrl.sampling.utils.completion_logits) and by every estimator (ddrl.estimators.common
.forward_logprobs), the one place each builds [prompt, completion]; it is attended, never scored.

**Guidance.** As released, the unconditional input is the empty prompt laid out the same way
(`encode_prompt("")`: <|t2i|> <bos> <eos> <|soi|>) with the same canvas, and the logits are
(1 + w) cond - w uncond (the samplers' guided_logits). `cfg_unconditional = "masked_prompt"` switches to
ddrl's own form (every real prompt token replaced by the mask).

**Special tokens.** MMaDA-8B's tokenizer holds them as reserved ids (126084 <|soi|>, 126085 <|eoi|>,
126088 <|t2i|>, 126093 [iPAD]); a tokenizer that names a token (a tiny test tokenizer) gives its own id.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ddrl.data import prompt_parts
from ddrl.models.hf import HFDiffusionLM
from ddrl.models.hf_tokenizer import HFTokenizer
from ddrl.models.native.magvit2 import MAGVITv2Decoder

if TYPE_CHECKING:
    from ddrl.tasks.base import ChatPrompt

# MMaDA's reserved ids (training/prompting_utils.py reserved_token_mapping), by role.
RESERVED_TOKENS = {"<|soi|>": 126084, "<|eoi|>": 126085, "<|t2i|>": 126088, "[iPAD]": 126093}
MAX_TEXT_LEN = 256  # max_seq_length of MaskGRPO's t2i scripts and MMaDA's stage-4 config: 257 tokens with <|t2i|>
CFG_UNCONDITIONAL = ("empty_prompt", "masked_prompt")

__all__ = ["MMaDAT2ITokenizer", "MMaDAImageLM", "RESERVED_TOKENS", "build_text_to_image"]


class MMaDAT2ITokenizer(HFTokenizer):
    """MMaDA's tokenizer with encode_prompt = the text-to-image layout (module docstring); pad = [iPAD]."""

    def __init__(self, tokenizer: Any, *, mask_token_id: int | None = None, max_text_len: int = MAX_TEXT_LEN,
                 attend_padding: bool = False):
        super().__init__(tokenizer, mask_token_id=mask_token_id)
        self.special = {name: self._id(name, default) for name, default in RESERVED_TOKENS.items()}
        self.pad_token_id = self.special["[iPAD]"]
        self.max_text_len, self.attend_padding = int(max_text_len), bool(attend_padding)

    def _id(self, name: str, default: int) -> int:
        found = self.tokenizer.convert_tokens_to_ids(name)
        if isinstance(found, int) and found != self.tokenizer.unk_token_id and found is not None:
            return found
        if default >= len(self.tokenizer):
            raise ValueError(f"the tokenizer ({len(self.tokenizer)} tokens) has no {name} token and MMaDA's reserved "
                             f"id {default} is outside it; use MMaDA's own tokenizer")
        return default

    def encode_prompt(self, prompt: str | ChatPrompt) -> list[int]:
        """<|t2i|> <bos> text <eos> <|soi|> (cut to max_text_len + 1 before <|soi|>, ending with <eos>);
        with attend_padding, left-padded with [iPAD] to max_text_len + 2 tokens (MaskGRPO's rows)."""
        text, system, prefill = prompt_parts(prompt)
        if system is not None or prefill:
            raise ValueError("a text-to-image prompt is the caption alone; MMaDA's t2i layout has no system message "
                             "or pre-fill")
        bos, eos, pad = self.bos_token_id, self.eos_token_id, self.pad_token_id
        if bos is None or eos is None or pad is None:
            raise ValueError(f"MMaDA's text-to-image prompt needs the tokenizer's bos, eos and pad ids; got "
                             f"bos={bos}, eos={eos}, pad={pad}: load the checkpoint's own tokenizer")
        ids = [self.special["<|t2i|>"], bos] + self.encode(text) + [eos]
        width = self.max_text_len + 1
        if len(ids) > width:
            ids = ids[:width - 1] + [eos]
        if self.attend_padding:
            ids = [pad] * (width - len(ids)) + ids
        return ids + [self.special["<|soi|>"]]


class MMaDAImageLM(HFDiffusionLM):
    """MMaDA that generates images (module docstring): decode_images, completion_suffix, guidance input.

    vq_decoder:         MAGVIT-v2's decoder (kept outside the module tree: never trained or sharded).
    vq_path:            where it was read (recorded in a save, so a reload decodes with it again).
    cfg_unconditional:  "empty_prompt" (as released) | "masked_prompt" (ddrl's form).
    """

    vq_decoder: MAGVITv2Decoder  # kept in __dict__, not a submodule (__init__)

    def __init__(self, model: Any, tokenizer: MMaDAT2ITokenizer, *, decoder: MAGVITv2Decoder, vq_path: str,
                 cfg_unconditional: str = "empty_prompt", **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        self.__dict__["vq_decoder"] = decoder
        self.vq_path = str(vq_path)
        self.cfg_unconditional = cfg_unconditional

    @property
    def cfg_unconditional(self) -> str:
        return self._cfg_unconditional

    @cfg_unconditional.setter
    def cfg_unconditional(self, value: str) -> None:
        if value not in CFG_UNCONDITIONAL:
            raise ValueError(f"cfg_unconditional={value!r}; choose one of {', '.join(CFG_UNCONDITIONAL)}")
        self._cfg_unconditional = value

    # The emerge sampler's pace (ddrl.sampling.commit.emerge_mask_fraction): MaskGRPO samples images with
    # k(tau) = cos(pi tau / 2) (t2i_generate_emerge's noise_schedule), not the linear pace of MMaDA's process.
    emerge_schedule = "cosine"

    @property
    def completion_suffix(self) -> tuple[int, ...]:  # type: ignore[override]  # derived here
        """The fixed ids after the completion: (<|eoi|>,)."""
        return (self.tokenizer.special["<|eoi|>"],)

    @property
    def cfg_unconditional_prompt(self) -> tuple[int, ...] | None:  # type: ignore[override]  # derived here
        """The guidance pass's prompt: the empty caption laid out as a prompt (None: ddrl's masked prompt)."""
        return tuple(self.tokenizer.encode_prompt("")) if self.cfg_unconditional == "empty_prompt" else None

    @torch.no_grad()
    def decode_images(self, codes: Tensor) -> Tensor:
        """Codebook indices [B, h, w] (long) -> pixels [B, 3, 16h, 16w] float32 in [0, 1]."""
        if codes.dim() != 3 or codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be a [B, h, w] integer tensor of codebook indices, got {codes.dtype} "
                             f"{list(codes.shape)} (vocabulary ids: subtract image_token_range[0] first)")
        size = self.vq_decoder.codebook_size
        if bool(((codes < 0) | (codes >= size)).any()):
            raise ValueError(f"codes must be codebook indices in [0, {size}); got values in [{int(codes.min())}, "
                             f"{int(codes.max())}] (vocabulary ids: subtract image_token_range[0] = "
                             f"{self.image_token_range and self.image_token_range[0]})")
        decoder = self.vq_decoder
        if decoder.decoder.conv_in.weight.device != codes.device:
            decoder.to(codes.device)
        return decoder.pixels(codes)

    def ddrl_config(self) -> dict[str, Any]:
        return {**super().ddrl_config(), "vq_path": self.vq_path, "cfg_unconditional": self.cfg_unconditional,
                "t2i_attend_padding": self.tokenizer.attend_padding, "t2i_max_text_len": self.tokenizer.max_text_len}


def not_text_to_image(where: str) -> ValueError:
    """The error for t2i_attend_padding asked of a model that is not a text-to-image MMaDA."""
    return ValueError(f"model.t2i_attend_padding (load_model's t2i_attend_padding) applies to a text-to-image MMaDA "
                      f"(loaded with model.vq_path, or saved from one): it chooses MaskGRPO's attended [iPAD] "
                      f"padding or MMaDA's masked one; {where}. Unset it")


def build_text_to_image(backbone: Any, hf_tokenizer: Any, vq_path: str | Path, kwargs: dict[str, Any], *,
                        saved: dict[str, Any], device: Any = None, attend_padding: bool | None = None) -> MMaDAImageLM:
    """The MMaDA pieces load_hf_model read -> MMaDAImageLM with the decoder of vq_path (module docstring).
    attend_padding: MaskGRPO's attended [iPAD] rows (True) or MMaDA's masked padding (False); None = the
    saved choice (t2i_attend_padding), False for a directory that has none."""
    if hf_tokenizer is None:
        raise ValueError("a text-to-image MMaDA needs its tokenizer (the image codes start after it); copy it next to "
                         "config.json")
    if kwargs.get("image_token_range") is None:
        raise ValueError("this MMaDA has no image codebook range")
    tokenizer = MMaDAT2ITokenizer(hf_tokenizer, mask_token_id=kwargs["mask_token_id"],
                                  max_text_len=saved.get("t2i_max_text_len", MAX_TEXT_LEN),
                                  attend_padding=saved.get("t2i_attend_padding", False) if attend_padding is None
                                  else attend_padding)
    decoder = MAGVITv2Decoder.from_pretrained(vq_path, device=device)
    lo, hi = kwargs["image_token_range"]
    if hi - lo > decoder.codebook_size:  # MMaDA-8B: 8192 = 8192 (a tiny test MMaDA uses the first codes)
        raise ValueError(f"the MMaDA codebook has {hi - lo} codes but MAGVIT-v2 in {str(vq_path)!r} decodes "
                         f"{decoder.codebook_size}; the two do not belong together")
    kwargs = {**kwargs, "logits_range": (lo, hi), "pad_token_id": tokenizer.pad_token_id}
    return MMaDAImageLM(backbone, tokenizer, decoder=decoder, vq_path=str(vq_path),
                        cfg_unconditional=saved.get("cfg_unconditional", "empty_prompt"), **kwargs)
