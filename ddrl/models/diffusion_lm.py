"""DiffusionLM: a denoiser plus what the rest of ddrl must know about it.

Samplers, estimators and the trainer see one object whatever the backbone (built-in, Hugging
Face LLaDA/Dream/SDAR, a user's module): `model(input_ids, attention_mask).logits` aligned so
that position i's logits predict the clean token at position i, the special ids, the forward
process, and the tokenizer.

Dream-style models are trained autoregressively first and keep the AR alignment: position i
predicts token i + 1. `logits_shifted=True` undoes that here, once, so no caller ever thinks
about it. Position 0 has no prediction of its own after the shift and repeats position 0's
logits (it is always a prompt token). With a KV cache the first new position has the same issue:
a caller that needs its prediction must include the token before it in the new chunk. The shift
is made on the positions the backbone's head reads (raw max(i - 1, 0) for aligned i), not by
copying [B, T, V] logits, whenever the backbone takes an index tensor.

**Only the positions a caller scores go through the LM head.** `logits_to_keep` (None/0 = all,
an int K = the last K, a 1-D index tensor = those positions, a 2-D [B, K] one = each row's own)
returns [B, K, V]. At LLaDA-8B's
vocabulary (126,464) the head over [prompt, completion] is most of a scoring pass's memory, and
the estimators read only the completion. The request reaches the backbone when its forward takes
one (native families and the built-in Denoiser take index tensors; transformers models an int,
so they compute a suffix that covers the positions); otherwise every position is computed and
sliced. A shifted (Dream) model asks its backbone for raw positions max(i - 1, 0).
`kept_logits(model, ...)` is the caller's side: it slices for models that take no request.

**Log-probs without logits.** `targets=TargetRequest(ids, mask, class_range)` returns
`target_logprobs` [B, K] = log p(ids) at the kept positions instead of logits. Where the backbone
can skip its head (`compute_logits=False`: the native families and the built-in Denoiser) the
final hidden states at the kept (and, with `mask`, scored) positions go through the head and the
cross-entropy chunk by chunk (ddrl.ops.logprobs): no [B, K, V] tensor, in forward or backward.
Other backbones, or `fused_logprobs = False` (the old path, for comparison), score the kept
logits. `kept_logprobs(model, ...)` (ddrl.logits) is the caller's side.

**One source for the block size.** `DiffusionLM.block_size` is read from the backbone's own
config (the built-in DenoiserConfig, a checkpoint's config.json through ddrl.models.families);
a block process's spec carries no copy of its own: `process_spec["block_size"]` is derived from
the model's on every read. `make_process_spec` is the one place a process spec is written.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
from torch import Tensor, nn

from ddrl.data import as_stop_ids
from ddrl.logits import LogitsToKeep, kept_index, keeps_some, take_positions
from ddrl.models.backbone import base_model, forward_takes, head_linear
from ddrl.contract import PROCESS_SAMPLERS, SCORING_ARGUMENTS
from ddrl.models.io import CONFIG_FILE, atomic_directory, check_model_dir, read_json, write_json
from ddrl.models.tokenizer import TOKENIZER_FILE, SymbolTokenizer
from ddrl.models.transformer import Denoiser
from ddrl.ops.logprobs import SUPPRESSED_LOGIT, TargetRequest, target_logprobs

# The keys of config.json's "ddrl" section that are constructor arguments restored on load. The
# section also records block_size, which is not one of them: it is the backbone config's.
_SAVED_FIELDS = ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id", "stop_token_ids", "vocab_size",
                 "logits_shifted", "process_spec", "family", "suppress_mask_logit")


def make_process_spec(process: str, *, mask_token_id: int | None = None, schedule: str | None = None,
                      num_classes: int | None = None, offset: int = 0) -> dict[str, Any]:
    """{"name": <registered process>, **its constructor kwargs}: the one place a spec is written.

    masked / block: the absorbing id (a block process gets its block_size from the DiffusionLM
    that holds the spec). uniform: the corrupted token range [offset, offset + num_classes).
    schedule: the noise schedule name, or None for the process's default.
    """
    if process == "uniform":
        if num_classes is None:
            raise ValueError("a uniform process needs the corrupted token range: pass process_spec="
                             "{'name': 'uniform', 'num_classes': N, 'offset': FIRST_ID, 'schedule': ...} to build_model")
        spec: dict[str, Any] = {"name": "uniform", "num_classes": int(num_classes), "offset": int(offset)}
    else:
        if mask_token_id is None:
            raise ValueError(f"a {process!r} process needs mask_token_id (the absorbing-state id); pass it")
        spec = {"name": process, "mask_token_id": int(mask_token_id)}
    if schedule is not None:
        spec["schedule"] = schedule
    return spec


def check_requested_block_size(requested: int | None, actual: int | None, where: str) -> None:
    """A block size asked for (model.block_size) must be the model's own; None asks for nothing."""
    if requested is None or (actual is not None and int(requested) == int(actual)):
        return
    if actual is None:
        raise ValueError(f"model.block_size={requested}, but {where} is a full-attention model (no block-causal "
                         f"attention); unset model.block_size (rollout.block_length sets the sampler's blocks)")
    raise ValueError(f"model.block_size={requested} contradicts {where}, whose block size is {actual} (it was trained "
                     f"with it); unset model.block_size or set it to {actual}")


@dataclass
class DiffusionLMOutput:
    logits: Tensor | None  # [B, T, V], position i predicts the clean token at position i; None with targets
    past_key_values: Any = None  # the backbone's cache when it returned one
    target_logprobs: Tensor | None = None  # [B, K] log p(targets) at the kept positions, when asked (targets=...)


class DiffusionLM(nn.Module):
    """Wraps a backbone `model(input_ids, attention_mask=None, **kw) -> object with .logits`.

    model:               the backbone (kept as `self.model`, so LoRA/FSDP can wrap it).
    tokenizer:           SymbolTokenizer or a Hugging Face tokenizer; its special ids are the defaults.
    stop_token_ids:      ids besides eos_token_id that end a completion (a chat checkpoint's end of
                         turn, e.g. <|im_end|>); `self.stop_token_ids` is (eos_token_id, *these).
    mask_token_id:       the absorbing-state id; must be < vocab_size.
    vocab_size:          logits width; default: the backbone's config.vocab_size, else the tokenizer's.
    logits_shifted:      True for AR-initialised models (Dream) whose position i predicts token i + 1.
    block_size:          block diffusion block size (block-causal attention); None = the backbone
                         config's block_size, else full attention.
    process_spec:        {"name": <registered process>, **constructor kwargs} (make_process_spec);
                         `process` builds it. A block_size in it must agree with the model's.
    family:              "ddrl", "llada", "dream", "sdar", ...: which adapter made it.
    suppress_mask_logit: give the mask token a logit of -1e4, so the denoiser never predicts it
                         (MDLM's SUBS parameterisation). On for built-in models of an absorbing
                         process; off for Hugging Face models, whose reference samplers use raw logits.

    Settings of the log-prob path (plain attributes, read on every call with targets=...):
    fused_logprobs:      True: the LM head and cross-entropy run chunked from the hidden states where
                         the backbone allows it; False: score the kept logits (the unfused path).
    logprob_chunk:       positions per chunk; None = as many as 2**24 logits hold (ddrl.ops.logprobs).
    logprob_backend:     "auto" (Liger's fused kernel on CUDA when installed, else torch), "torch", "liger".
    logits_range:        (first, end) or None: ids outside it get the suppressed logit (set by
                         ddrl.models.hf for Dream's padded vocabulary and MMaDA's image codes).
    """

    fused_logprobs: bool = True
    logprob_chunk: int | None = None
    logprob_backend: str = "auto"
    logits_range: tuple[int, int] | None = None

    # The rest of the model contract (ddrl.contract.DiffusionModel): a family that has one of
    # these overrides it; the values here say "not supported" by type.
    scoring_arguments = SCORING_ARGUMENTS  # forward takes logits_to_keep, targets and class_range
    attention: str = "native"  # how a mask reaches the backbone (ddrl.models.feeds)
    canvas_length: int | None = None  # DiffusionGemma's canvas
    emerge_schedule: str | None = None  # None: the emerge sampler follows the process's schedule
    # Plain attributes (a test or a user may set them on any model); MMaDA and URSA derive theirs.
    bov_token_id: int | None = None  # URSA's begin-of-image id
    completion_suffix: tuple[int, ...] = ()  # fixed ids after the completion (MMaDA's <|eoi|>)
    cfg_unconditional_prompt: tuple[int, ...] | None = None  # None: guidance masks the prompt

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, mask_token_id: int | None = None,
                 pad_token_id: int | None = None, eos_token_id: int | None = None, bos_token_id: int | None = None,
                 stop_token_ids: Iterable[int] | None = None, vocab_size: int | None = None,
                 logits_shifted: bool = False, block_size: int | None = None,
                 process_spec: dict[str, Any] | None = None, family: str = "ddrl", suppress_mask_logit: bool = False):
        super().__init__()
        # a Hugging Face, peft or native backbone, read by the attribute names they share: typed Any
        self.model: Any = model
        self.tokenizer = tokenizer
        from_tok = lambda name: getattr(tokenizer, name, None)  # noqa: E731
        self.mask_token_id = mask_token_id if mask_token_id is not None else from_tok("mask_token_id")
        self.pad_token_id = pad_token_id if pad_token_id is not None else from_tok("pad_token_id")
        self.eos_token_id = eos_token_id if eos_token_id is not None else from_tok("eos_token_id")
        self.bos_token_id = bos_token_id if bos_token_id is not None else from_tok("bos_token_id")
        self.stop_token_ids = stop_token_ids
        backbone_config: Any = getattr(model, "config", None)
        if vocab_size is None:
            vocab_size = getattr(backbone_config, "vocab_size", None)
        if vocab_size is None and tokenizer is not None:
            vocab_size = len(tokenizer)
        if vocab_size is None:
            raise ValueError(
                "vocab_size is unknown: the backbone has no config.vocab_size and no tokenizer was given; pass vocab_size"
            )
        self.vocab_size = int(vocab_size)
        if self.mask_token_id is None:
            raise ValueError("mask_token_id is unknown: pass mask_token_id (the tokenizer has none)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, vocab_size={self.vocab_size}); "
                f"pass the id of the model's mask token"
            )
        if block_size is None:
            block_size = getattr(backbone_config, "block_size", None)
        elif hasattr(backbone_config, "block_size") and backbone_config.block_size != block_size:
            # One source of truth: the backbone's own attention decides the layout; a wrapper that
            # said otherwise would make the sampler and the estimators see different models.
            raise ValueError(f"block_size={block_size} contradicts the backbone's own block_size="
                             f"{backbone_config.block_size} ({type(model).__name__}); leave block_size unset")
        self.logits_shifted = bool(logits_shifted)
        self.family = family
        self.suppress_mask_logit = bool(suppress_mask_logit)
        spec = dict(process_spec) if process_spec is not None else make_process_spec(
            "block" if block_size is not None else "masked", mask_token_id=self.mask_token_id)
        spec_block = spec.pop("block_size", None)
        if spec_block is not None and block_size is not None and int(spec_block) != int(block_size):
            raise ValueError(f"process_spec block_size={spec_block} contradicts the model's block_size={block_size}; "
                             f"drop block_size from process_spec (a block process uses the model's)")
        block_size = block_size if block_size is not None else spec_block
        if spec.get("name") == "block" and block_size is None:
            raise ValueError("a block process needs the model's block size: pass block_size (model.block_size)")
        self.block_size = None if block_size is None else int(block_size)
        self._process_spec = spec
        self._check_process_spec()
        self._process: Any = None
        self._process_key: str | None = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end a completion: eos_token_id first, then the extra ones; () without any.

        The samplers' early exit, the completion mask and the decoded text read these
        (ddrl.data.model_stop_ids). Setting it keeps eos_token_id first whatever the order given.
        """
        eos = () if self.eos_token_id is None else (int(self.eos_token_id),)
        return as_stop_ids(eos + self._extra_stop_ids)

    @stop_token_ids.setter
    def stop_token_ids(self, ids: Iterable[int] | None) -> None:
        self._extra_stop_ids = as_stop_ids(ids)

    @property
    def process_spec(self) -> dict[str, Any]:
        """The forward process's spec; a block process's block_size is this model's, derived on every read."""
        if self._process_spec.get("name") == "block":
            self._process_spec["block_size"] = self.block_size
        return self._process_spec

    def _check_process_spec(self) -> None:
        spec = self.process_spec
        if not isinstance(spec.get("name"), str):
            raise ValueError(f"process_spec needs a 'name' (a registered process such as 'masked'), got {spec!r}")
        if "offset" in spec and "num_classes" in spec and spec["offset"] + spec["num_classes"] > self.vocab_size:
            raise ValueError(
                f"process_spec offset={spec['offset']} + num_classes={spec['num_classes']} exceeds "
                f"vocab_size={self.vocab_size}; the process must corrupt tokens within the vocabulary"
            )

    @property
    def process(self) -> Any:
        """The forward process built from process_spec (rebuilt if the spec is changed)."""
        key = json.dumps(self.process_spec, sort_keys=True)
        if self._process_key != key:
            from ddrl.registry import PROCESSES

            kwargs = {k: v for k, v in self.process_spec.items() if k != "name"}
            self._process = PROCESSES.get(self.process_spec["name"])(**kwargs)
            self._process_key = key
        return self._process

    @property
    def samplers(self) -> tuple[str, ...]:
        """The samplers that decode this model as trained, its own first (rollout.name=auto picks it): the
        family's (ddrl.models.families.FamilyFacts.samplers), else its process's (PROCESS_SAMPLERS; a
        block-causal model decodes its own blocks)."""
        from ddrl.models.families import family_facts  # families imports this module

        own = family_facts(self.family).samplers
        layout = "block" if self.block_size else self.process_spec["name"]
        return own or PROCESS_SAMPLERS.get(layout, PROCESS_SAMPLERS["masked"])  # a user's process: the masked ones

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        if not hasattr(self.model, "gradient_checkpointing_enable"):
            raise ValueError(f"the backbone {type(self.model).__name__} does not support gradient checkpointing")
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self) -> None:
        if hasattr(self.model, "gradient_checkpointing_disable"):
            self.model.gradient_checkpointing_disable()

    @property
    def max_seq_len(self) -> int | None:
        """Longest prompt + completion the backbone accepts (None when it does not say)."""
        config = getattr(self.model, "config", None)
        for name in ("max_seq_len", "max_position_embeddings", "max_sequence_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, logits_to_keep: LogitsToKeep = None,
                targets: TargetRequest | None = None, class_range: tuple[int, int] | None = None,
                raw: bool = False, **kwargs: Any) -> DiffusionLMOutput:
        """input_ids [B, T] -> logits [B, T, V] aligned with the input positions ([B, K, V] for the
        K positions of logits_to_keep, computed through the LM head only there when the backbone can).

        targets: TargetRequest(ids [B, K], mask [B, K] or None, class_range): return
        target_logprobs [B, K] (log p(ids) at the kept positions; 0 where mask is False) and no
        logits (module docstring). class_range (a, b): the logits of vocabulary ids [a, b) only,
        [B, K, b - a] (`_ranged_forward`). kwargs (position_ids, past_key_values, use_cache, ...) go
        to the backbone unchanged. raw: the backbone's own logits [B, T, V], every class's (no mask
        suppression, no logits_range; only Dream's shift undone), for SEPO's concrete score, which reads the
        mask class's. Through this forward, not the backbone's, so that a wrapper's hooks run (FSDP2's
        unshard of the root's parameters, DDP's gradient sync).
        """
        run = functools.partial(self.model, input_ids, attention_mask=attention_mask, **kwargs)
        if raw:
            out, logits = self._raw_forward(run, logits_to_keep, targets, class_range)
            return DiffusionLMOutput(logits=logits, past_key_values=getattr(out, "past_key_values", None))
        kind = logits_to_keep_kind(self.model)
        if targets is not None:
            check_class_range(class_range, self.vocab_size, targets=targets)
            out, lp = self._scored_forward(run, input_ids, logits_to_keep, kind, targets)
            return DiffusionLMOutput(logits=None, past_key_values=getattr(out, "past_key_values", None),
                                     target_logprobs=lp)
        out, logits = self._ranged_forward(run, input_ids, logits_to_keep, kind, class_range)
        return DiffusionLMOutput(logits=logits, past_key_values=getattr(out, "past_key_values", None))

    def _kept_forward(self, run: Callable[..., Any], input_ids: Tensor, logits_to_keep: LogitsToKeep,
                      kind: str | None) -> tuple[Any, Tensor]:
        """run(**kw) calls the backbone on input_ids [B, T] -> (its output, aligned logits at the kept
        positions [B, K, V]). kind: what the backbone takes as logits_to_keep ("tensor", "int" or None)."""
        T = input_ids.shape[1]
        if not keeps_some(logits_to_keep):
            if not (self.logits_shifted and kind == "tensor" and T > 0):
                out = run()
                return out, self.align_logits(out.logits)
            logits_to_keep = T  # realign by asking for the raw positions, not by copying [B, T, V]
        request = backbone_positions(logits_to_keep, T, shifted=self.logits_shifted, device=input_ids.device,
                                     rows=input_ids.shape[0])
        out, raw = requested_logits(run, kind, T, request)
        return out, self.suppress_logits(raw)  # already aligned: the shift is in the positions asked for

    def _ranged_forward(self, run: Callable[..., Any], input_ids: Tensor, logits_to_keep: LogitsToKeep,
                        kind: str | None, class_range: tuple[int, int] | None) -> tuple[Any, Tensor]:
        """-> (the backbone's output, the logits of vocabulary ids [a, b) = class_range at the kept
        positions [B, K, b - a]; every id's [B, K, V] when class_range is None).

        A backbone with `range_logits(hidden, a, b)` (LLaDA/MMaDA's: the head's rows [a, b)), or whose
        head module has one (URSA's codebook head), computes those columns alone from the final hidden
        states at the kept positions (compute_logits=False, as in _scored_forward): the metric_path,
        emerge and maskgit samplers of an image model then never hold [B, K, V] logits and their
        suppressed copy. The numbers are the sliced full logits' (bit for bit on the CPU: the same dot
        products), suppressed ids in the range included; any other head computes the full logits,
        sliced here."""
        if class_range is None:
            return self._kept_forward(run, input_ids, logits_to_keep, kind)
        checked = check_class_range(class_range, self.vocab_size)
        assert checked is not None  # class_range is not None here
        a, b = checked
        base = base_model(self.model)
        head: Any = base if hasattr(base, "range_logits") else getattr(base, "lm_head", None)
        if not (kind == "tensor" and forward_takes(base, "compute_logits") and hasattr(head, "range_logits")):
            out, logits = self._kept_forward(run, input_ids, logits_to_keep, kind)
            return out, logits[..., a:b]
        T = input_ids.shape[1]
        keep = logits_to_keep if keeps_some(logits_to_keep) else T
        request = backbone_positions(keep, T, shifted=self.logits_shifted, device=input_ids.device,
                                     rows=input_ids.shape[0])
        out = run(compute_logits=False)
        hidden = out.hidden_states  # [B, T, D] after the final norm
        hidden = hidden[:, T - request:] if isinstance(request, int) else take_positions(hidden, request)  # [B, K, D]
        logits = head.range_logits(hidden, a, b)  # [B, K, b - a]
        suppressed = self.suppressed_vocab(self.vocab_size, "cpu")  # on the host: no device sync to test it
        if suppressed is not None and bool(suppressed[a:b].any()):
            logits = logits.masked_fill(suppressed[a:b].to(logits.device), SUPPRESSED_LOGIT)
        return out, logits

    def _scored_forward(self, run: Callable[..., Any], input_ids: Tensor, logits_to_keep: LogitsToKeep,
                        kind: str | None, targets: TargetRequest) -> tuple[Any, Tensor]:
        """-> (the backbone's output, log p(targets.ids) at the kept positions [B, K]).

        The fused path asks the backbone for its final hidden states only (compute_logits=False),
        takes those at the kept positions (the raw ones for a shifted model), and scores them with
        the head chunk by chunk; with targets.mask only the scored positions reach the head."""
        T = input_ids.shape[1]
        keep = logits_to_keep if keeps_some(logits_to_keep) else T
        if not self._fuses_head(kind):
            out, logits = self._kept_forward(run, input_ids, keep, kind)
            return out, targets.score(logits)
        # The scored positions, flat [M]: the call's one host read (M sizes the head's input), made
        # before the backbone is queued so that it waits for the mask's own kernels, not for the
        # forward; index_select/index_copy then need no second read in backward (boolean indexing would).
        scored = None if targets.mask is None else targets.mask.to(input_ids.device).reshape(-1).nonzero().squeeze(1)
        out = run(compute_logits=False)
        request = backbone_positions(keep, T, shifted=self.logits_shifted, device=input_ids.device,
                                     rows=input_ids.shape[0])
        hidden = out.hidden_states  # [B, T, D] after the final norm
        hidden = hidden[:, T - request:] if isinstance(request, int) else take_positions(hidden, request)  # [B, K, D]
        if tuple(targets.ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"targets.ids has shape {list(targets.ids.shape)}; it must be [B, K] = "
                             f"{list(hidden.shape[:2])}, one id per kept position")
        if scored is None:
            return out, self._head_logprobs(hidden, targets.ids, targets.class_range)
        scored = scored.to(hidden.device)
        lp = self._head_logprobs(hidden.flatten(0, 1).index_select(0, scored),
                                 targets.ids.to(hidden.device).reshape(-1).index_select(0, scored),
                                 targets.class_range)  # [M]: scored positions only
        flat = torch.zeros(targets.ids.numel(), dtype=lp.dtype, device=lp.device)  # [B * K]
        return out, flat.index_copy(0, scored, lp).view(targets.ids.shape)

    def _fuses_head(self, kind: str | None) -> bool:
        """Whether the backbone can return its hidden states without logits and has a head to apply."""
        base = base_model(self.model)
        return (self.fused_logprobs and kind == "tensor" and forward_takes(base, "compute_logits")
                and callable(getattr(base, "lm_head", None)))

    def _head_logprobs(self, hidden: Tensor, ids: Tensor, class_range: tuple[int, int] | None) -> Tensor:
        """hidden [..., D] at scored positions, ids [...] -> log p(ids) [...] through the backbone's head."""
        base = base_model(self.model)
        linear = head_linear(self.model)  # Liger's kernel takes it; the torch path slices a class range's rows
        return target_logprobs(hidden, ids, base.lm_head, vocab=self.vocab_size,
                               suppressed=self.suppressed_vocab(self.vocab_size, hidden.device),
                               class_range=class_range, chunk=self.logprob_chunk, backend=self.logprob_backend,
                               linear=linear)

    def _raw_forward(self, run: Callable[[], Any], logits_to_keep: LogitsToKeep, targets: TargetRequest | None,
                     class_range: tuple[int, int] | None) -> tuple[Any, Tensor]:
        """forward(raw=True): the backbone's output and its every position's and class's logits, aligned."""
        if keeps_some(logits_to_keep) or targets is not None or class_range is not None:
            raise ValueError("forward(raw=True) gives every position's and class's logits: pass no "
                             "logits_to_keep, targets or class_range with it")
        out = run()
        return out, self.align_logits(out.logits, suppress=False)

    def align_logits(self, logits: Tensor, suppress: bool = True) -> Tensor:
        """The backbone's logits [B, T, V] -> ours: undo the Dream shift, suppress the mask token (unless
        not `suppress`). (Subclasses that feed the backbone differently, e.g. ddrl.models.hf, reuse it.)"""
        if self.logits_shifted:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return self.suppress_logits(logits) if suppress else logits

    def suppressed_vocab(self, width: int, device: torch.device | str) -> Tensor | None:
        """[width] bool: the ids whose logit is SUPPRESSED_LOGIT (the mask token when
        suppress_mask_logit; every id outside logits_range), or None when there are none."""
        if not self.suppress_mask_logit and self.logits_range is None:
            return None
        out = torch.zeros(width, dtype=torch.bool, device=device)
        if self.logits_range is not None:
            lo, hi = self.logits_range
            out[:lo] = True
            out[hi:] = True
        if self.suppress_mask_logit and self.mask_token_id is not None and self.mask_token_id < width:
            out[self.mask_token_id] = True
        return out

    def suppress_logits(self, logits: Tensor) -> Tensor:
        """[..., V] -> the same with the suppressed ids' logits (suppressed_vocab) set to SUPPRESSED_LOGIT."""
        suppressed = self.suppressed_vocab(logits.shape[-1], logits.device)
        return logits if suppressed is None else logits.masked_fill(suppressed, SUPPRESSED_LOGIT)

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator["DiffusionLM"]:
        """`with model.disable_adapter():` runs the base model without its LoRA adapter (the RL
        reference under LoRA: no second copy of the weights). See ddrl.models.lora."""
        if not hasattr(self.model, "disable_adapter"):
            raise ValueError("this model has no LoRA adapter to disable; apply one with ddrl.models.lora.apply_lora "
                             "(model.lora.rank > 0), or keep a separate reference copy")
        with self.model.disable_adapter():
            yield self

    # ------------------------------------------------------------------ persistence

    def ddrl_config(self) -> dict[str, Any]:
        """The "ddrl" section of config.json: everything the constructor needs besides backbone and tokenizer."""
        saved = {name: getattr(self, name) for name in _SAVED_FIELDS}
        saved["stop_token_ids"] = list(self.stop_token_ids)  # JSON has no tuples
        saved["process_spec"] = {k: v for k, v in self.process_spec.items() if k != "block_size"}  # derived
        saved["block_size"] = self.block_size  # a record, read only where the checkpoint's config names none
        return saved

    def save_pretrained(self, directory: str | Path, *, state_dict: dict[str, Tensor] | None = None,
                        merge_adapter: bool = False) -> None:
        """Write config.json (backbone config + "ddrl" section), weights and tokenizer, atomically:
        everything goes to a temporary sibling directory that is renamed into place at the end,
        so an interrupted save never leaves a directory that looks complete.

        state_dict:    the full weights to write, keyed like self.state_dict(); None = this module's
                       own. A sharded (FSDP2) run gathers them first (ddrl.training.distributed).
        merge_adapter: with a LoRA adapter, write the merged weights as a plain model directory
                       instead of base weights + adapter/ (ddrl.models.lora.merge_and_save).
        """
        if not hasattr(self.model, "save_pretrained"):
            raise ValueError(f"the backbone {type(self.model).__name__} has no save_pretrained(directory); give it one")
        backbone_state = None
        if state_dict is not None:
            backbone_state = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        with atomic_directory(directory) as tmp:
            if hasattr(self.model, "peft_config"):  # a LoRA adapter: base weights (+ adapter/), see ddrl.models.lora
                from ddrl.models.lora import save_adapted_backbone

                save_adapted_backbone(self.model, tmp, backbone_state, merge=merge_adapter)
            else:
                save_backbone(self.model, tmp, backbone_state)
            if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(tmp)
            config = read_json(tmp / CONFIG_FILE)
            config["ddrl"] = self.ddrl_config()
            write_json(tmp / CONFIG_FILE, config)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> "DiffusionLM":
        """Load a built-in model directory (use ddrl.load_model for Hugging Face ones)."""
        path = check_model_dir(directory)
        backbone = Denoiser.from_pretrained(path, device=device, dtype=dtype)  # checks the model type
        config = read_json(path / CONFIG_FILE)
        tokenizer = SymbolTokenizer.from_pretrained(path) if (path / TOKENIZER_FILE).is_file() else None
        saved = config.get("ddrl", {})  # its block_size is a record: the backbone config's is the model's
        model = cls(backbone, tokenizer, **{k: saved[k] for k in _SAVED_FIELDS if k in saved})
        return load_saved_adapter(model, path)

    def extra_repr(self) -> str:
        return (f"family={self.family!r}, vocab_size={self.vocab_size}, mask_token_id={self.mask_token_id}, "
                f"logits_shifted={self.logits_shifted}, block_size={self.block_size}, process_spec={self.process_spec}")


ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapter, in peft's layout, next to the base weights


ModelT = TypeVar("ModelT", bound="DiffusionLM")


def load_saved_adapter(model: ModelT, directory: Path) -> ModelT:
    """Re-attach the LoRA adapter that save_pretrained wrote into DIR/adapter (if any)."""
    if not (Path(directory) / ADAPTER_DIR).is_dir():
        return model
    from ddrl.models.lora import load_adapter  # imports peft: only for LoRA checkpoints

    return load_adapter(model, Path(directory) / ADAPTER_DIR)


def save_backbone(backbone: Any, directory: Path, state_dict: dict[str, Tensor] | None = None) -> None:
    """backbone.save_pretrained(directory), writing `state_dict` (keyed like backbone.state_dict())
    instead of the module's own tensors when given.

    Hugging Face models take the state dict as an argument. A backbone whose save_pretrained does
    not (the built-in Denoiser) writes whatever self.state_dict() returns, so for the duration of
    the call a state-dict hook hands it the given tensors: under FSDP2 the module's own are shards.
    """
    if state_dict is None:
        backbone.save_pretrained(directory)
        return
    if "state_dict" in inspect.signature(backbone.save_pretrained).parameters:
        backbone.save_pretrained(directory, state_dict=state_dict)
        return

    def use_given(module: nn.Module, own: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if prefix:
            return
        own.clear()
        own.update(state_dict)

    handle = backbone.register_state_dict_post_hook(use_given)
    try:
        backbone.save_pretrained(directory)
    finally:
        handle.remove()


# --------------------------------------------------------------------------------------------
# logits_to_keep: the LM head only where a caller scores
# --------------------------------------------------------------------------------------------


def check_class_range(class_range: Any, vocab_size: int, *, targets: Any = None) -> tuple[int, int] | None:
    """forward's class_range: None, or (a, b) with 0 <= a < b <= vocab_size; not with targets."""
    if class_range is None:
        return None
    if targets is not None:
        raise ValueError("class_range selects the logits a forward returns; to score targets over a range of "
                         "ids pass TargetRequest(ids, mask, class_range=...) instead")
    try:
        a, b = (int(i) for i in class_range)
    except (TypeError, ValueError):
        raise ValueError(f"class_range must be a pair (first id, end id), got {class_range!r}") from None
    if not 0 <= a < b <= vocab_size:
        raise ValueError(f"class_range {class_range!r} must satisfy 0 <= first < end <= vocab_size ({vocab_size})")
    return a, b


def backbone_positions(logits_to_keep: int | Tensor, T: int, *, shifted: bool,
                       device: torch.device | None = None, rows: int | None = None) -> int | Tensor:
    """The backbone positions whose raw logits are the aligned ones at the kept positions: the same
    count K, or an index tensor [K] / [B, K] (on `device`); for a shifted model max(i - 1, 0)
    (module docstring)."""
    index = kept_index(logits_to_keep, T, device, rows=rows)  # checks the range (and a per-row one's rows)
    if shifted:
        return (index - 1).clamp(min=0)
    return index if isinstance(logits_to_keep, Tensor) else int(logits_to_keep)


def logits_to_keep_kind(backbone: nn.Module) -> str | None:
    """What a backbone's forward takes as logits_to_keep: "tensor" (an index tensor: the classes of
    ddrl.models.native and the built-in Denoiser, also under FSDP2's subclass), "int" (a count:
    transformers models that name the argument) or None (nothing: compute every position and slice)."""
    base = base_model(backbone)
    if isinstance(base, Denoiser) or any(c.__module__.startswith(_NATIVE_PACKAGE) for c in type(base).__mro__):
        return "tensor"
    return "int" if forward_takes(base, "logits_to_keep") else None


_NATIVE_PACKAGE = "ddrl.models.native."


def requested_logits(run: Callable[..., Any], kind: str | None, T: int, request: int | Tensor) -> tuple[Any, Tensor]:
    """The backbone's raw logits at `request` (a count K = the last K, or an index tensor [K] /
    [B, K]) -> (output, [B, K, V]).

    A "tensor" backbone is asked for exactly the requested positions (also all T of them in another
    order: a shifted model's realignment) and honours it; a backbone that returns all T positions
    instead is sliced. An "int" backbone computes the suffix that covers them; asking for a count
    of at least T computes every position, with no request.
    """
    if isinstance(request, int):
        out = run(logits_to_keep=request) if kind is not None and request < T else run()
        logits = out.logits  # [B, W, V]: the last W positions
        return out, logits if logits.shape[1] == request else logits[:, logits.shape[1] - request:]
    count = int(request.shape[-1])
    if kind == "tensor":
        out = run(logits_to_keep=request)
        if out.logits.shape[1] == count:
            return out, out.logits
    elif kind == "int":  # the suffix that covers the positions
        suffix = T - int(request.min()) if request.numel() else 1
        out = run(logits_to_keep=suffix) if suffix < T else run()
    else:
        out = run()
    logits = out.logits  # [B, W, V]: the last W positions
    return out, take_positions(logits, request.to(logits.device) - (T - logits.shape[1]))
