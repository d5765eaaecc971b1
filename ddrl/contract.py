"""The model contract, in code: what every family's model provides, and what an image model adds.

ddrl.models implements it; every layer that reads a model (sampling, estimators, processes, data,
logits, eval, training) reads it through this module, which imports nothing of ddrl, so the import
graph stays free of circles (tests/unit/test_import_graph.py).

Two levels, because ddrl's samplers also take a bare denoiser (LLaDA's reference `generate`
signature, a Hugging Face model, a user's module, a test's stand-in):

* `Denoiser`: `model(input_ids, attention_mask=None).logits` [B, T, V]. Nothing else is required.
* `DiffusionModel`: what every family's model provides (ddrl.models.DiffusionLM and its
  subclasses: the built-in model, the Hugging Face families, MDLM DNA, URSA). A family without a
  capability says so with a typed empty value (`block_size: None`, `completion_suffix: ()`,
  `canvas_length: None`, ...), never by missing the attribute; `require` turns an absent one into a
  `CapabilityError` that names it.
* `ImageCodec` (optional): an image model's decoder, `decode_images(codes)` and `image_token_range`
  (URSA, MMaDA with its VQ model). `ImageGrid`: a model that knows its own code grid (URSA).

**The scoring entry.** A `DiffusionModel` is called as

    model(input_ids, attention_mask=None, *, logits_to_keep=None, targets=None, class_range=None, **backbone_kwargs)

(ddrl.models.diffusion_lm.DiffusionLM.forward). Which of the three scoring arguments a model takes
is declared, not read off its signature: `ScoringModel.scoring_arguments`. A `DiffusionModel` takes
all three (`SCORING_ARGUMENTS`); any other model takes none, and ddrl.logits slices and scores its
full logits itself.

**Reading a model.** Code outside ddrl.models reads a model through `model_view(model)`, a typed
view: a `DiffusionModel`'s own attributes, or a bare denoiser's documented defaults. It is the one
place where attributes are read by name off an object that may not implement the contract.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor

# The keyword arguments of the scoring entry (module docstring), as DiffusionModel.scoring_arguments names them.
LOGITS_TO_KEEP, TARGETS, CLASS_RANGE = "logits_to_keep", "targets", "class_range"
SCORING_ARGUMENTS: frozenset[str] = frozenset({LOGITS_TO_KEEP, TARGETS, CLASS_RANGE})

# The samplers of each process, the model's own first (rollout.name=auto): a family whose FamilyFacts
# name none decodes with its process's. A block-causal model decodes its own blocks.
PROCESS_SAMPLERS: dict[str, tuple[str, ...]] = {
    "masked": ("masked", "emerge", "maskgit"),
    "block": ("block",),
    "uniform": ("uniform",),
    "metric_path": ("metric_path",),  # URSA: the CTMC jumps over its codebook's distances
}


class CapabilityError(ValueError):
    """A model lacks a capability a caller needs (`capability`: the contract's attribute); the message
    names it, the model's family, and the fix."""

    def __init__(self, capability: str, message: str):
        super().__init__(message)
        self.capability = capability


@runtime_checkable
class Denoiser(Protocol):
    """The least a sampler needs: `model(input_ids [B, T], attention_mask=None).logits` [B, T, V]."""

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Any: ...


@runtime_checkable
class ScoringModel(Protocol):
    """A model that computes only what a caller scores: its forward takes the keyword arguments it names
    (a subset of SCORING_ARGUMENTS; module docstring)."""

    scoring_arguments: ClassVar[frozenset[str]]


@runtime_checkable
class DiffusionModel(Protocol):
    """What every family's model provides (module docstring). Shapes: B rows, T positions, V = vocab_size."""

    scoring_arguments: ClassVar[frozenset[str]]  # SCORING_ARGUMENTS
    family: str  # "ddrl", "llada", "dream", "sdar", "llada2", "mmada", "diffusion_gemma", "ursa", "mdlm_dna", ...
    vocab_size: int  # logits width V
    mask_token_id: int  # the absorbing-state id (a uniform / metric-path family: its pad id)
    pad_token_id: int | None
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]  # ids that end a completion, eos first
    bov_token_id: int | None  # the id that opens an image (URSA), None elsewhere
    tokenizer: Any  # SymbolTokenizer or a Hugging Face tokenizer (None for a bare backbone)
    logits_shifted: bool  # the backbone's position i predicts token i + 1 (Dream, URSA); undone in forward
    block_size: int | None  # block-causal attention's block length; None = full attention
    attention: str  # how a mask reaches the backbone (ddrl.models.feeds): "native", "canvas", ...
    canvas_length: int | None  # DiffusionGemma's canvas; None elsewhere
    completion_suffix: tuple[int, ...]  # fixed ids after the completion in every pass (MMaDA's <|eoi|>); ()
    cfg_unconditional_prompt: tuple[int, ...] | None  # the guidance pass's prompt; None = the masked prompt
    logits_range: tuple[int, int] | None  # ids outside [first, end) are never sampled; None = all
    emerge_schedule: str | None  # the emerge sampler's pace when it is not the process's schedule
    samplers: tuple[str, ...]  # the samplers that decode it as trained, its own first (FamilyFacts.samplers)
    process_spec: dict[str, Any]  # {"name": <registered process>, **kwargs}

    @property
    def process(self) -> Any: ...  # the forward process (ddrl.processes.ForwardProcess) built from process_spec

    @property
    def max_seq_len(self) -> int | None: ...  # longest prompt + completion; None when the backbone says nothing

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, logits_to_keep: Any = None,
                 targets: Any = None, class_range: tuple[int, int] | None = None, **backbone_kwargs: Any) -> Any:
        """-> an output with .logits [B, K, V] aligned (position i predicts token i) at the kept positions
        (ddrl.logits.LogitsToKeep), [B, K, b - a] for class_range (a, b), or .target_logprobs [B, K] for
        targets (ddrl.ops.logprobs.TargetRequest) and no logits; .past_key_values when the backbone gives one."""
        ...


@runtime_checkable
class ImageCodec(Protocol):
    """An image model's decoder: code c of its codebook is vocabulary id image_token_range[0] + c."""

    image_token_range: tuple[int, int] | None

    def decode_images(self, codes: Tensor) -> Tensor:
        """Codebook indices [B, h, w] (long) -> pixels [B, 3, H, W] float32 in [0, 1]."""
        ...


@runtime_checkable
class ImageGrid(Protocol):
    """A model that lays its image codes on a grid of its own: (h, w), or None for a square one (URSA)."""

    image_shape: tuple[int, int] | None


class ModelView:
    """What ddrl reads of a model, typed. For a DiffusionModel these are its own attributes; a bare
    denoiser may carry any of them (a Hugging Face model its config's vocab_size, a test's stand-in a
    block_size), and lacks the rest: those read as the documented empty value. This is the one
    place attributes are read by name off an object that may not implement the contract."""

    __slots__ = ("model",)

    def __init__(self, model: Any):
        self.model = model

    def _get(self, name: str, default: Any = None) -> Any:
        return getattr(self.model, name, default)  # a bare denoiser: module docstring

    @property
    def family(self) -> str | None:
        value: str | None = self._get("family")
        return value

    @property
    def vocab_size(self) -> int | None:
        value: int | None = self._get("vocab_size")
        return value

    @property
    def mask_token_id(self) -> int | None:
        value: int | None = self._get("mask_token_id")
        return value

    @property
    def pad_token_id(self) -> int | None:
        value: int | None = self._get("pad_token_id")
        return value

    @property
    def eos_token_id(self) -> int | None:
        value: int | None = self._get("eos_token_id")
        return value

    @property
    def stop_token_ids(self) -> Any:
        """The model's stop ids as it states them (None: not stated; ddrl.data.model_stop_ids falls back to eos)."""
        return self._get("stop_token_ids")

    @property
    def bov_token_id(self) -> int | None:
        value: int | None = self._get("bov_token_id")
        return value

    @property
    def tokenizer(self) -> Any:
        return self._get("tokenizer")

    @property
    def logits_shifted(self) -> bool:
        return bool(self._get("logits_shifted", False))

    @property
    def block_size(self) -> int | None:
        return self._get("block_size") or None

    @property
    def attention(self) -> str | None:
        value: str | None = self._get("attention")
        return value

    @property
    def canvas_length(self) -> int | None:
        value: int | None = self._get("canvas_length")
        return value

    @property
    def completion_suffix(self) -> tuple[int, ...]:
        return tuple(self._get("completion_suffix") or ())

    @property
    def cfg_unconditional_prompt(self) -> Any:
        return self._get("cfg_unconditional_prompt")

    @property
    def logits_range(self) -> tuple[int, int] | None:
        value: tuple[int, int] | None = self._get("logits_range")
        return value

    @property
    def image_token_range(self) -> tuple[int, int] | None:
        value: tuple[int, int] | None = self._get("image_token_range")
        return value

    @property
    def emerge_schedule(self) -> str | None:
        value: str | None = self._get("emerge_schedule")
        return value

    @property
    def max_seq_len(self) -> int | None:
        value: int | None = self._get("max_seq_len")
        return value

    @property
    def backbone(self) -> Any:
        """The module under a DiffusionModel (its `model`: raw logits, no suppression); a bare denoiser is its own."""
        return self._get("model", self.model)

    @property
    def process(self) -> Any:
        """The model's forward process; None for a bare denoiser."""
        return self._get("process")

    @property
    def process_name(self) -> str:
        """The registered name of the model's process ("masked" for a bare denoiser)."""
        name: str = (self._get("process_spec") or {}).get("name", "masked")
        return name

    @property
    def samplers(self) -> tuple[str, ...]:
        """The samplers that decode the model as trained, its own first: the ones it states (every
        DiffusionModel: FamilyFacts.samplers, else its process's), else a bare denoiser's by its layout
        (block-causal: "block"; else its process's, the masked ones by default)."""
        own = self._get("samplers")
        if own:
            return tuple(own)
        layout = "block" if self.block_size else self.process_name
        return PROCESS_SAMPLERS.get(layout, PROCESS_SAMPLERS["masked"])  # a user's process: the masked ones

    @property
    def image_codec(self) -> ImageCodec | None:
        """The model's image decoder (it is the model), or None without one."""
        model = self.model
        return model if isinstance(model, ImageCodec) and model.image_token_range is not None else None

    @property
    def image_grid(self) -> ImageGrid | None:
        """The model when it lays image codes on a grid of its own (ImageGrid), else None."""
        return self.model if isinstance(self.model, ImageGrid) else None

    def stated(self, name: str) -> Any:
        """The model's attribute `name`, else its config's: a bare Hugging Face model states vocab_size and
        its length limit only in its config (None when neither says)."""
        value = self._get(name)
        return value if value is not None else getattr(self._get("config"), name, None)

    def require(self, capability: str, fix: str = "") -> Any:
        """The named attribute; a CapabilityError naming it (and the family) when the model has none."""
        value = getattr(self, capability)
        if value is None or value == ():
            raise CapabilityError(capability, f"this {self.family or 'bare'} model has no {capability}"
                                              f"{'; ' + fix if fix else ''}")
        return value


def model_view(model: Any) -> ModelView:
    """The typed view of a DiffusionModel or a bare denoiser (ModelView)."""
    return ModelView(model)


def scoring_arguments(model: Any) -> frozenset[str]:
    """The scoring keyword arguments a model's forward takes (ScoringModel); none for any other model.

    Declared by the model's class: a wrapper whose forward is its own (a test's nudge, a user's module
    that forwards attribute reads to a DiffusionLM) declares nothing unless it says so, so it gets the
    full logits, sliced by the caller, as before."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the compiled module declares
    # Declared by the class (an attribute or a property), not forwarded by an instance's __getattr__.
    return frozenset(model.scoring_arguments) if hasattr(type(model), "scoring_arguments") else frozenset()
