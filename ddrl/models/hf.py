"""Checkpoint directories in the Hugging Face layout -> DiffusionLM: LLaDA, MMaDA, Dream, SDAR/TraDo
natively; DiffusionGemma and other models through transformers.

    model = load_hf_model("/models/LLaDA-8B-Instruct", device="cuda", dtype=torch.bfloat16)
    model = ddrl.load_model(same_dir)      # load_model sends every non-built-in directory here

Nothing is downloaded: directories are local (`local_files_only=True`). The family is read from
config.json (ddrl.models.families, which holds the table of family facts) and decides the backbone:

* **Native families** (llada, mmada, dream, sdar, llada2): `NATIVE_FAMILIES.get(family).from_pretrained(dir)`
  from ddrl.models.native builds ddrl's own implementation from config.json and the safetensors
  with the authors' weight names; a checkpoint whose weight names are not its family's fails there,
  before any compute. No code from the directory runs, whatever trust_remote_code says, and the
  tokenizer is read without it too (ddrl.models.hf_tokenizer). The backbone takes 2-D and boolean
  3-D/4-D masks, positions and a KV cache itself, so they are passed straight through ("native"
  feed): left-padded rows run in one batch and the fast samplers' caches work. SDAR's block size is
  its checkpoint's (families.checkpoint_block_size); a model.block_size that contradicts it is an
  error. Dream's vocabulary is padded past its tokenizer: logits_range = (0, len(tokenizer)) keeps
  sampling inside the tokenizer's ids.
* **DiffusionGemma** stays on transformers' own DiffusionGemmaForBlockDiffusion ("canvas" feed,
  ddrl.models.feeds).
* **Other directories** load through transformers' classes (config.json architectures, then the
  masked-/causal-LM Auto classes). A directory that ships modeling code (config.json auto_map)
  runs it only with trust_remote_code=True (model.trust_remote_code=true; the default is False),
  on the transformers version ddrl pins. Code that does not run there fails with
  RemoteCodeError naming the file, the exception and that version. Remote code that ignores
  attention_mask can be fed unpadded rows by writing "ddrl": {"attention": "unpadded"} into its
  config.json (ddrl.models.feeds).

**Stop tokens**: `model.stop_token_ids` is eos_token_id (the tokenizer's) followed by the ids of
generation_config.json's eos_token_id, when the directory has one: a chat checkpoint's turn ends
with <|im_end|> (SDAR/TraDo), which config.json's EOS is not. A ddrl-saved directory restores its
own list ("ddrl" section).

The mask id is, in order: the mask_token_id argument (ModelConfig.mask_token_id), a value saved
by ddrl ("ddrl" section of config.json), config.json's own mask_token_id, the family's id, the
tokenizer's mask token (a uniform process falls back to the pad id). An id outside the
vocabulary is an error naming the override.

**MMaDA images**: `image_token_range = (len(tokenizer), len(tokenizer) + codebook_size)` (the authors'
offset, ddrl.models.families.image_token_range; None without a tokenizer) and `image_logits(logits)`
(codebook-space ids). Setting `model.logits_range = (a, b)` gives every id outside [a, b) the
suppressed logit, so the ordinary samplers and estimators generate and score image tokens only.

**Gradient checkpointing** uses Hugging Face's when the backbone supports it, else (native
families; remote code without it, LLaDA issue #51) wraps each transformer block's forward in
torch.utils.checkpoint (non-reentrant; ddrl.models.backbone).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ddrl.data import as_stop_ids
from ddrl.models.backbone import (base_model, checkpoint_blocks, drop_input_grad_hooks, logits_width,
                                  transformer_blocks)
from ddrl.logits import LogitsToKeep
from ddrl.ops.logprobs import TargetRequest
from ddrl.models.diffusion_lm import (DiffusionLM, DiffusionLMOutput, check_class_range,
                                      load_saved_adapter, logits_to_keep_kind, make_process_spec)
from ddrl.models.families import (FAMILIES, FamilyFacts, checkpoint_block_size, detect_family, family_facts,
                                  image_token_range, remote_code_files)
from ddrl.models.feeds import FEEDS
from ddrl.models.hf_tokenizer import HFTokenizer, load_tokenizer, missing_tokenizer_error
from ddrl.models.io import CONFIG_FILE, ModelDirectoryError, read_json

__all__ = ["FAMILIES", "FamilyFacts", "HFDiffusionLM", "HFTokenizer", "RemoteCodeError", "detect_family",
           "load_hf_model", "checkpoint_blocks", "transformer_blocks"]

NATIVE_FAMILY_NAMES = "LLaDA, LLaDA-1.5, MMaDA, Dream, DiffuCoder, SDAR, TraDo and LLaDA2.0/2.1"


class RemoteCodeError(ModelDirectoryError):
    """A directory's own modeling code does not import or build on the pinned transformers."""


# --------------------------------------------------------------------------------------------
# The model wrapper
# --------------------------------------------------------------------------------------------


class HFDiffusionLM(DiffusionLM):
    """DiffusionLM over a checkpoint directory's backbone, fed the way its family needs (ddrl.models.feeds).

    attention:         the feed, a name in FEEDS ("native": masks, positions and cache as given).
    image_token_range: (first, end) vocabulary ids of an image codebook (MMaDA) or None.
    logits_range:      (first, end) or None; when set, logits outside it are suppressed.
    canvas_length:     DiffusionGemma's canvas (block) length, for attention="canvas".
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, attention: str = "native",
                 image_token_range: tuple[int, int] | None = None, logits_range: tuple[int, int] | None = None,
                 canvas_length: int | None = None, **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        if attention == "canvas" and not canvas_length:
            raise ValueError("attention='canvas' needs canvas_length (DiffusionGemma's config.canvas_length)")
        self.attention = attention
        self.image_token_range = None if image_token_range is None else _int_pair(image_token_range)
        self.logits_range = None if logits_range is None else _int_pair(logits_range)
        self.canvas_length = canvas_length

    @property
    def attention(self) -> str:
        return self._attention

    @attention.setter
    def attention(self, name: str) -> None:
        self._feed = FEEDS.get(name)  # an unknown name lists the valid ones
        self._attention = name

    @property
    def samplers(self) -> tuple[str, ...]:
        """DiffusionLM.samplers; a checkpoint that edits tokens (LLaDA2.1's config token_editing) puts
        its family's editing sampler first."""
        facts = family_facts(self.family)
        if facts.editing_samplers and getattr(getattr(self.model, "config", None), "token_editing", False):
            return facts.editing_samplers
        return super().samplers

    # not DiffusionLM.forward's signature (override silenced): it names the backbone's cache arguments
    # instead of passing any **kwargs on
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,  # type: ignore[override]
                position_ids: Tensor | None = None, past_key_values: Any = None, use_cache: bool = False, *,
                logits_to_keep: LogitsToKeep = None, targets: TargetRequest | None = None,
                class_range: tuple[int, int] | None = None, raw: bool = False) -> DiffusionLMOutput:
        """input_ids [B, T_new] -> logits [B, T_new, V] aligned with the input (DiffusionLM's contract;
        [B, K, V] for the K positions of logits_to_keep; with targets, target_logprobs [B, K] and no logits;
        with class_range (a, b), the logits of ids [a, b) only, [B, K, b - a]: DiffusionLM._ranged_forward;
        raw: every class's logits, the mask's included, as DiffusionLM.forward's).

        attention_mask: None; [B, T_past + T_new] padding mask (1 = real); or a boolean
        [B, (1,) T_new, T_past + T_new] mask used as given. position_ids [B, T_new].
        past_key_values / use_cache reach backbones whose feed takes a cache ("native"); the
        "unpadded" and "canvas" feeds return none (ddrl's samplers then run without one).
        logits_to_keep reaches the backbone through the "native" feed only; the others compute every
        position, sliced.
        """
        if past_key_values is not None and not self._feed.takes_cache:
            raise ValueError(f"the {self.family!r} backbone is run without a KV cache by ddrl; "
                             f"do not pass past_key_values (set rollout.cache=none)")
        kwargs: dict[str, Any] = {}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if self._feed.takes_cache and (past_key_values is not None or use_cache):
            kwargs.update(past_key_values=past_key_values, use_cache=use_cache)
        run = functools.partial(self._feed.run, self, input_ids, attention_mask, **kwargs)
        if raw:  # every class's logits, unsuppressed (DiffusionLM.forward's raw)
            out, logits = self._raw_forward(run, logits_to_keep, targets, class_range)
            return DiffusionLMOutput(logits=logits, past_key_values=_backbone_cache(out))
        kind = logits_to_keep_kind(self.model) if self.attention == "native" else None
        if targets is not None:  # log-probs from the hidden states, chunked (DiffusionLM._scored_forward)
            check_class_range(class_range, self.vocab_size, targets=targets)
            out, lp = self._scored_forward(run, input_ids, logits_to_keep, kind, targets)
            return DiffusionLMOutput(logits=None, past_key_values=_backbone_cache(out), target_logprobs=lp)
        # [B, T_new or K, V] (or b - a ids); logits_range is applied there (DiffusionLM.suppress_logits)
        out, logits = self._ranged_forward(run, input_ids, logits_to_keep, kind, class_range)
        return DiffusionLMOutput(logits=logits, past_key_values=_backbone_cache(out))

    def image_logits(self, logits: Tensor) -> Tensor:
        """[..., V] -> [..., codebook_size]: the image-codebook slice (MMaDA); index i = codebook entry i."""
        if self.image_token_range is None:
            raise ValueError(f"this {self.family!r} model has no image codebook (image_token_range is None)")
        lo, hi = self.image_token_range
        return logits[..., lo:hi]

    # ------------------------------------------------------------------ checkpointing, persistence
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Hugging Face's (non-reentrant) when the backbone supports it, else per-block checkpointing."""
        base = base_model(self.model)
        if getattr(base, "supports_gradient_checkpointing", False):
            kwargs = gradient_checkpointing_kwargs or {"use_reentrant": False}
            if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
                base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if not kwargs.get("use_reentrant", True):  # transformers' hook is for the reentrant kind
                drop_input_grad_hooks(base)
        else:
            checkpoint_blocks(base)

    def gradient_checkpointing_disable(self) -> None:
        base = base_model(self.model)
        if getattr(base, "supports_gradient_checkpointing", False):
            if hasattr(base, "activation_checkpointing_disable"):
                base.activation_checkpointing_disable()
            else:
                base.gradient_checkpointing_disable()
        else:
            checkpoint_blocks(base, enable=False)

    def ddrl_config(self) -> dict[str, Any]:
        return {**super().ddrl_config(), "attention": self.attention, "image_token_range": self.image_token_range,
                "logits_range": self.logits_range, "canvas_length": self.canvas_length}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, attention={self.attention!r}"


def _int_pair(pair: Sequence[int]) -> tuple[int, int]:
    lo, hi = pair
    return int(lo), int(hi)


def _backbone_cache(out: Any) -> Any:
    cache = getattr(out, "past_key_values", None)
    return getattr(out, "cache", None) if cache is None else cache  # transformers >= 5 names it `cache`


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_hf_model(path: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                  trust_remote_code: bool = False, mask_token_id: int | None = None, block_size: int | None = None,
                  require_tokenizer: bool = False, vq_path: str | Path | None = None,
                  t2i_attend_padding: bool | None = None) -> HFDiffusionLM:
    """A local checkpoint directory -> HFDiffusionLM with its family's facts (module docstring).

    vq_path:           MMaDA only: the MAGVIT-v2 directory; the model then generates images
                       (ddrl.models.mmada.MMaDAImageLM). A ddrl save of such a model records it.
    t2i_attend_padding: a text-to-image MMaDA only: MaskGRPO's [iPAD]-padded, attended prompt rows
                       (ddrl.models.mmada); None keeps the saved choice (default False).
    block_size:        the block size asked for (model.block_size); it must be the checkpoint's.
    require_tokenizer: a directory without a tokenizer is an error (training and generating from text).
    Every check on the directory runs before its weights are read.
    """
    directory = Path(path)
    config = read_json(directory / CONFIG_FILE)
    saved = config.get("ddrl") or {}
    family = saved.get("family") or detect_family(config)
    facts = family_facts(family)
    where = f"{str(directory)!r} ({family})"
    vq_path = vq_path if vq_path is not None else saved.get("vq_path")
    if vq_path is not None and family != "mmada":
        raise ValueError(f"vq_path applies to URSA pipelines and MMaDA; {str(directory)!r} is a {family!r} model")
    if t2i_attend_padding is not None and vq_path is None:
        from ddrl.models.mmada import not_text_to_image

        raise not_text_to_image(f"{str(directory)!r} is a {family!r} model loaded without vq_path")
    generation = read_json(directory / GENERATION_CONFIG_FILE) if (directory / GENERATION_CONFIG_FILE).is_file() else {}
    model_block_size = checkpoint_block_size(config, facts, block_size, where, generation)
    if not facts.native:
        _check_remote_code_allowed(directory, config, trust_remote_code)
    hf_tokenizer = load_tokenizer(directory, native=facts.native, trust_remote_code=trust_remote_code)
    if hf_tokenizer is None and require_tokenizer:
        raise missing_tokenizer_error(directory, "this run encodes and decodes text with it")
    mask_id = _mask_token_id(directory, family, facts, config, saved, mask_token_id, hf_tokenizer)

    if facts.native:
        backbone = _native_backbone(directory, family, facts, device=device, dtype=dtype, block_size=model_block_size)
    else:
        backbone = _transformers_backbone(directory, config, dtype=dtype, trust_remote_code=trust_remote_code)
    vocab_size = int(saved.get("vocab_size") or _vocab_size(backbone, config))
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_token_id={mask_id} (from the {family!r} family rule or config) is outside the "
                         f"vocabulary [0, {vocab_size}) of {str(directory)!r}; pass the right id as mask_token_id "
                         f"(model.mask_token_id=ID)")
    tokenizer = HFTokenizer(hf_tokenizer, mask_token_id=mask_id) if hf_tokenizer is not None else None

    logits_range = saved["logits_range"] if "logits_range" in saved else _tokenizer_range(facts, tokenizer, vocab_size)
    spec = saved.get("process_spec") if mask_token_id is None else None  # an override rebuilds it
    if spec is None:
        spec = make_process_spec(facts.process, mask_token_id=mask_id, num_classes=vocab_size)
    kwargs: dict[str, Any] = dict(
        mask_token_id=mask_id, vocab_size=vocab_size, family=family, block_size=model_block_size,
        logits_shifted=saved.get("logits_shifted", facts.logits_shifted), process_spec=spec,
        suppress_mask_logit=saved.get("suppress_mask_logit", False),
        attention=facts.attention if facts.native else saved.get("attention", facts.attention),
        image_token_range=saved.get("image_token_range") or (_image_token_range(config, tokenizer)
                                                             if facts.image_codebook else None),
        logits_range=logits_range, canvas_length=saved.get("canvas_length") or config.get("canvas_length"),
    )
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if saved.get(name) is not None:
            kwargs[name] = saved[name]
    # eos_token_id (the tokenizer's) comes first; the constructor puts it there
    kwargs["stop_token_ids"] = saved["stop_token_ids"] if "stop_token_ids" in saved else _generation_stop_ids(directory)
    if vq_path is not None:  # an MMaDA that generates images
        from ddrl.models.mmada import build_text_to_image

        model: HFDiffusionLM = build_text_to_image(backbone, hf_tokenizer, vq_path, kwargs, saved=saved, device=device,
                                    attend_padding=t2i_attend_padding)
    else:
        model = HFDiffusionLM(backbone, tokenizer, **kwargs)
    model = load_saved_adapter(model, directory)
    return model.to(device=device) if device is not None else model


GENERATION_CONFIG_FILE = "generation_config.json"


def _generation_stop_ids(directory: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int or a list) -> the ids that end a turn; () without one.

    A chat checkpoint ends its turns with a token that is not config.json's EOS: SDAR/TraDo list
    [<|im_end|>, <|endoftext|>] there, while config.json and the tokenizer name only <|endoftext|>."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return ()
    value = read_json(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids if i is not None):
        raise ModelDirectoryError(f"{str(path)!r} has eos_token_id={value!r}; it must be a token id or a list of "
                                  f"them (fix the file, or delete eos_token_id from it)")
    return as_stop_ids(i for i in ids if i is not None)


def _tokenizer_range(facts: FamilyFacts, tokenizer: Any, vocab_size: int) -> tuple[int, int] | None:
    """(0, len(tokenizer)) where the family's vocabulary is padded past its tokenizer: those ids are never sampled."""
    if facts.tokenizer_vocab_only and tokenizer is not None and len(tokenizer) < vocab_size:
        return 0, len(tokenizer)
    return None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _mask_token_id(directory: Path, family: str, facts: FamilyFacts, config: dict[str, Any], saved: dict[str, Any],
                   override: int | None, hf_tokenizer: Any) -> int:
    mask_id = _first(override, saved.get("mask_token_id"), config.get("mask_token_id"), facts.mask_token_id,
                     getattr(hf_tokenizer, "mask_token_id", None))
    if mask_id is None and facts.process == "uniform":
        text = config.get("text_config") or {}
        mask_id = _first(getattr(hf_tokenizer, "pad_token_id", None), config.get("pad_token_id"),
                         text.get("pad_token_id"))
    if mask_id is not None:
        return int(mask_id)
    if hf_tokenizer is None:
        raise missing_tokenizer_error(directory, f"config.json names no mask_token_id, so the {family!r} model's mask "
                                                 f"id must come from the tokenizer (or pass model.mask_token_id=ID)")
    raise ValueError(f"no mask token id for {str(directory)!r} (family {family!r}): neither config.json nor the "
                     f"tokenizer names one; pass mask_token_id (model.mask_token_id=ID)")


def _image_token_range(config: dict[str, Any], tokenizer: Any) -> tuple[int, int] | None:
    """MMaDA's codes start after its tokenizer (ddrl.models.families); None without a tokenizer."""
    return None if tokenizer is None else image_token_range(config, len(tokenizer))


def _vocab_size(backbone: nn.Module, config: dict[str, Any]) -> int:
    """Logits width: the LM head's, else the backbone config's, else config.json's."""
    width = logits_width(backbone)
    if width:
        return width
    backbone_config: Any = getattr(backbone, "config", None)
    if hasattr(backbone_config, "get_text_config"):
        backbone_config = backbone_config.get_text_config()
    value = _first(getattr(backbone_config, "vocab_size", None), config.get("embedding_size"), config.get("vocab_size"))
    if value is None:
        raise ModelDirectoryError(f"cannot tell the vocabulary size of {type(backbone).__name__}: it has no LM head "
                                  f"module and config.json names no vocab_size; add vocab_size to config.json")
    return int(value)


def _native_backbone(directory: Path, family: str, facts: FamilyFacts, *, device: Any, dtype: Any,
                     block_size: int | None) -> nn.Module:
    """ddrl's own implementation of the family (its weight-name check raises, unchanged, on a foreign checkpoint).
    A block family's class is told the block size when it takes one (a config.json without it)."""
    from ddrl.models.native import NATIVE_FAMILIES

    if facts.native_module is not None:
        module = f"ddrl.models.native.{facts.native_module}"
        try:
            importlib.import_module(module)  # registers the family's class
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise ModelDirectoryError(f"{str(directory)!r} is a {family} checkpoint, but this ddrl install has no "
                                      f"{module}; reinstall ddrl") from None
    cls = NATIVE_FAMILIES.get(family)
    kwargs: dict[str, Any] = {"device": device, "dtype": dtype}
    if block_size is not None and "block_size" in inspect.signature(cls.from_pretrained).parameters:
        kwargs["block_size"] = block_size
    return cls.from_pretrained(directory, **kwargs)


def _check_remote_code_allowed(directory: Path, config: dict[str, Any], trust_remote_code: bool) -> None:
    if config.get("auto_map") and not trust_remote_code:
        files = ", ".join(remote_code_files(config)) or "the files named in auto_map"
        raise ModelDirectoryError(
            f"{str(directory)!r} ships its own modeling code (config.json auto_map): loading it runs {files} from that "
            f"directory. Read it, then set model.trust_remote_code=true (load_model(..., trust_remote_code=True)) to "
            f"run it. ({NATIVE_FAMILY_NAMES} checkpoints need no remote code: ddrl loads them natively when "
            f"config.json's model_type/architectures name the family.)")


def _transformers_backbone(directory: Path, config: dict[str, Any], *, dtype: torch.dtype | None,
                           trust_remote_code: bool) -> nn.Module:
    """The model class named by auto_map (remote code) or by `architectures` (transformers'), else the Auto classes."""
    import transformers

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    auto_map = config.get("auto_map") or {}
    if auto_map:
        for name in ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel"):
            if name in auto_map:
                try:
                    return getattr(transformers, name).from_pretrained(str(directory), **kwargs)
                except (ImportError, AttributeError, KeyError, NameError, TypeError) as e:
                    raise _remote_code_error(directory, config, name, e) from e
        raise ModelDirectoryError(f"config.json auto_map of {str(directory)!r} names no model class ddrl can load "
                                  f"(AutoModelForMaskedLM, AutoModelForCausalLM or AutoModel), only {sorted(auto_map)}")
    candidates = [getattr(transformers, a) for a in config.get("architectures") or [] if hasattr(transformers, a)]
    candidates += [transformers.AutoModelForMaskedLM, transformers.AutoModelForCausalLM]
    errors = []
    for cls in candidates:
        try:
            return cls.from_pretrained(str(directory), **kwargs)
        except (ValueError, KeyError) as e:  # this Auto class does not know the architecture
            errors.append(f"{getattr(cls, '__name__', cls)}: {e}")
    raise ModelDirectoryError(
        f"transformers {transformers.__version__} has no class that loads {str(directory)!r} (model_type "
        f"{config.get('model_type')!r}, architectures {config.get('architectures')}): " + "; ".join(errors[-3:])
        + f". ddrl loads {NATIVE_FAMILY_NAMES} natively, DiffusionGemma and transformers' own model types through "
        f"transformers, and other models through their own code (config.json auto_map + model.trust_remote_code=true)")


def _remote_code_error(directory: Path, config: dict[str, Any], auto_class: str,
                       error: BaseException) -> RemoteCodeError:
    import transformers

    ref = config["auto_map"][auto_class]
    ref = ref[0] if isinstance(ref, (list, tuple)) else ref
    file = str(ref).split("--")[-1].rsplit(".", 1)[0].replace(".", "/") + ".py"
    files = set(remote_code_files(config))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).name in files]
    at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return RemoteCodeError(
        f"the modeling code of {str(directory)!r} ({file}, config.json auto_map {auto_class}) does not run on "
        f"transformers {transformers.__version__}, the version ddrl pins: {type(error).__name__}: {error}{at}. "
        f"Hub modeling code is written for one transformers release. ddrl loads {NATIVE_FAMILY_NAMES} natively, "
        f"without their code (config.json model_type/architectures name the family); for another model, update its "
        f"code for transformers {transformers.__version__}")
