"""`ddrl train CONFIG --rehearse --world-size N`: one step of a recipe at its real size, on fake tensors.

The trainer's own step (Trainer.train_step: rollout with the recipe's sampler, reward, advantage, the
old/reference passes, mu x (estimate -> loss -> backward -> step)) runs on rank 0 of a fake process
group of N ranks, over a model built at the recipe's real size as fake CUDA tensors: shapes, dtypes,
devices and FSDP2/DDP/LoRA/mixed-precision/checkpointing/offload wrapping are the real run's, no data
is computed and no weight is read. It is what torchtitan's memory estimation does for its train step.
PyTorch's own trackers measure it:

    memory  torch.distributed._tools MemTracker: rank 0's peak and its split (parameters, gradients,
            optimizer state, activations, temporaries; FSDPMemTracker refuses a sampler's repeated calls),
            beside the hand model of ddrl.training.memory with the ratio of the two.
    time    RuntimeEstimator's roofline (max(FLOPs / peak, bytes / bandwidth) per aten op) with the
            device figures of DEVICE below; rollout and update apart. Two corrections to torch's: its
            compute time was 1.5x under the peak's (TORCH_FLOPS_TO_NS_SPEEDUP), and it charged views and
            `tensor.device` the bytes of their tensors (moves_no_data).
    syncs   every data-dependent read (.item(), .tolist(), bool(tensor), nonzero) that a real step makes
            the host wait for, counted by the call site that made it (HostReads).

What differs from a GPU run, on purpose, and what the rehearsal does so that memory reads as a GPU's:

  the inputs    The task is a stand-in (prompts of the recipe's prompt width, rewards 0, 1, 0, 1, ...
                so that every group has non-zero advantages). The model's config.json is the family's
                shipped official-format one (tests/fixtures/<family>/) resized to the published sizes
                of ddrl.training.memory.PLACEHOLDER_SHAPES when model.path is a /path/to/... placeholder.
  data reads    Fake tensors hold no values: a data-dependent read returns a stand-in (HostReads):
                True (False where a check refuses bad data), 1; nonzero, x[mask] and unique give every
                element (the largest shape the real read can give: where a real step selects fewer, the
                tracker is an upper bound); bincount gives balanced counts (MoE routing). Issue 33
                checked the largest ratios against the hand model: none came from these stand-ins.
  the step      The rehearsed step is a later step, not the first: it starts with the previous
                update's gradients and AdamW's moments (_steady_state), which a rollout-peaked recipe
                holds through its rollout on a GPU.
  the device    The rank's tensors are fake CPU tensors (a CPU build of torch cannot make fake CUDA
                ones through Tensor.copy_ or FSDP2's streams): same shapes, dtypes and wrapping; AdamW
                is set to its CUDA default (foreach), and its step counters, host tensors on a GPU, are
                not counted as syncs. Dropout runs as CUDA's fused native_dropout, which keeps a bool
                mask for backward, not the CPU's mask of the input's dtype (cuda_dropout). DDP's
                all-reduce is answered by a comm hook (_ddp_buckets_tracked).
  the trackers  MemTracker, not FSDPMemTracker (which refuses a sampler's repeated calls); DTensor's
                shape propagation, which runs ops on global-shape fake tensors in the fake mode it finds
                (on a GPU its own, which MemTracker skips; here the rehearsal's), is left untracked;
                under dist.cpu_offload the host's shards, their gradients and AdamW state are left out of
                the device's peak. FLOPs are counted without FlopCounterMode's module tracker, whose gradient hooks
                kept every checkpointed block's recomputation alive (_flop_counter).
  the calls     A rollout of many sampler calls (rollout.batch_rows below a rank's rows) rehearses the
                first and the last call of each row count; a call between has their shapes, so it is
                replayed: its outputs allocated (empty_like), its roofline time and host reads the last's
                (replayed_sampler_calls). The last runs with every earlier output held, as on a GPU, so the
                rollout's peak is the real one (a test compares it with every call rehearsed).
  the depth     A rehearsal's CPU time grows with layers x forwards (d1's LLaDA-8B at 32 layers and one
                sampler step a block: about a minute; LLaDA2-mini's 256 experts a layer: half an hour at
                4 and 6 layers), so --extrapolate rehearses EXTRAPOLATE_LAYERS (4 and 6) at full width and
                extrapolates; for d1 the line gives the full-depth rehearsal's figures (a test).
  time          Where the roofline is far from a GPU: attention is faked SDPA (FLOPs counted as dense
                math, no flash-attention tiling), collectives cost nothing (RuntimeEstimator does not
                model communication), and tiny ops are bandwidth-bound, with no launch overhead: the
                rollout's many small steps come out fast.
Not modelled at all: the CUDA context, NCCL's buffers and the allocator's fragmentation (a few GB).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import traceback
import weakref
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Iterator, cast
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddrl.rewards.composite import RewardResult
from ddrl.training.memory import DEFAULT_PROMPT_TOKENS, GB, MDLM_DNA, PLACEHOLDER_SHAPES, ModelShape

aten = torch.ops.aten
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
# The family's official-format directory (config.json in its hub layout, its tokenizer) for each
# placeholder of configs/paper: sized up to the published shape (memory.PLACEHOLDER_SHAPES). MMaDA's is
# the text-to-image fixture's: its tokenizer names MMaDA's special tokens (<|soi|>, <|eoi|>, <|t2i|>,
# [iPAD]) and, as MMaDA-8B's, is shorter than llm_vocab_size, the image codes following it.
FAMILY_DIRS = {"LLaDA-8B": "llada/model", "MMaDA-8B": "mmada_t2i/model", "Dream-v0-Instruct-7B": "dream/model",
               "DiffuCoder-7B": "dream/model", "LLaDA2.0-mini": "llada2/model-2.0",
               "LLaDA2.1-mini": "llada2/model-2.1", "URSA-1.7B": "ursa/model",
               "mdlm_dna": "sepo_dna/tiny_mdlm_dna.ckpt"}
# MemTracker's categories (torch.distributed._tools.mem_tracker._MemRefType) as the table names them
SPLIT_NAMES = {"PARAM": "parameters (shards, gathered blocks)", "BUFFER": "buffers", "GRAD": "gradients",
               "ACT": "activations (forward outputs kept)", "TEMP": "temporaries (backward, sampler)",
               "OPT": "optimizer state", "OTH": "other (DDP gradient buckets)"}
HEADROOM = 0.9  # a recipe fits when the tracker's peak is at most 90% of the device
# The depths --extrapolate rehearses. Not 2: there the update's peak can be a forward moment (FSDP2's
# gathered embeddings and head with the logits), which no deeper model peaks at; from 4 layers on it is
# the backward's, each layer adding its kept activations. d1 under FSDP2 from 2 and 4 layers: 20.1 GB
# (the rollout's line; the update's grew 0.25 GB a layer); from 4 and 6, the update's 0.59 GB a layer.
EXTRAPOLATE_LAYERS = (4, 6)


@dataclass(frozen=True)
class Device:
    """The GPU a rehearsal is measured against. H200 SXM: NVIDIA's H200 datasheet (nvidia.com/h200):
    141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense BF16/FP16 tensor core (1,979 is with sparsity)."""

    name: str = "H200"
    memory_bytes: float = 141e9
    bf16_tflops: float = 989.0
    fp32_tflops: float = 67.0  # FP32 non-tensor-core (datasheet); TF32 tensor core is 494.5
    hbm_gbps: float = 4800.0


DEVICE = Device()


# ------------------------------------------------------------------ the model at its real size
def sized_config(config: dict[str, Any], shape: ModelShape | None, layers: int | None) -> dict[str, Any]:
    """The family's config.json with its size fields set to `shape` (under the family's own key names:
    LLaDA's d_model / n_layers, the HF families' hidden_size / num_hidden_layers) and the layer count
    set to `layers` when given (a reduced rehearsal)."""
    out = dict(config)
    sizes: dict[tuple[str, ...], Any] = {}
    if shape is not None:
        sizes = {("d_model", "hidden_size"): shape.d_model, ("n_heads", "num_attention_heads"): shape.n_heads,
                 ("n_kv_heads", "num_key_value_heads"): shape.n_kv_heads,
                 ("mlp_hidden_size", "intermediate_size", "ffn_hidden"): shape.ffn,
                 ("embedding_size", "vocab_size"): shape.vocab, ("head_dim",): shape.head_dim,
                 ("num_experts",): shape.experts or None, ("num_experts_per_tok",): shape.experts_per_token or None,
                 ("num_shared_experts",): shape.shared_experts or None,
                 ("moe_intermediate_size",): shape.expert_ffn or None,
                 ("codebook_size", "lm_head_size"): shape.codebook or None,
                 ("n_layers", "num_hidden_layers"): shape.n_layers}
    if layers is not None:
        sizes[("n_layers", "num_hidden_layers")] = layers
    for keys, value in sizes.items():
        for key in keys:
            if key in out and value is not None:
                out[key] = value
    if shape is not None and out.get("rotary_dim") and out.get("partial_rotary_factor") and shape.head_dim:
        out["rotary_dim"] = int(shape.head_dim * out["partial_rotary_factor"])  # LLaDA2: half of each head
    for key in ("max_sequence_length", "max_position_embeddings"):  # the fixtures' short contexts: 4096 at least
        if key in out:
            out[key] = max(int(out[key]), 4096)
    if out.get("max_window_layers") is not None:
        out["max_window_layers"] = out.get("n_layers", out.get("num_hidden_layers"))
    return out


def family_source(model_path: str) -> tuple[Path, ModelShape | None]:
    """(official-format directory, published shape to resize it to): model.path itself when it is on
    disk, else the shipped directory of the placeholder's family."""
    path = Path(model_path)
    if path.is_dir():
        return path, None
    for name, sub in FAMILY_DIRS.items():
        if name.lower() in path.name.lower():
            return FIXTURES / sub, PLACEHOLDER_SHAPES[name]
    raise ValueError(f"model.path={model_path!r} is not on disk and names no family a rehearsal knows "
                     f"({', '.join(FAMILY_DIRS)}); point model.path at a model directory (only its "
                     f"config.json and tokenizer are read)")


def sized_model_dir(model_path: str, layers: int | None, into: Path) -> tuple[Path, ModelShape]:
    """A model directory in `into`: the family's files linked, its config.json resized. Returns it and
    the shape the hand model reads."""
    from ddrl.training.memory import shape_from_config

    source, shape = family_source(model_path)
    directory = into / "model"
    if source.is_file():  # a Lightning checkpoint (SEPO's MDLM DNA CNN): its own layout, at the published size
        if layers is not None:
            raise ValueError(f"{model_path} is rehearsed whole: its config has no layer count to set to {layers}")
        return _mdlm_dna_dir(directory), MDLM_DNA
    shutil.copytree(source, directory, copy_function=os.symlink)
    config = directory / "transformer" / "config.json" if (directory / "transformer").is_dir() else (
        directory / "config.json")
    sized = sized_config(json.loads(config.read_text()), shape, layers)
    config.unlink()
    config.write_text(json.dumps(sized, indent=2))
    if (directory / "transformer").is_dir() and shape is not None and shape.codebook:
        _size_pipeline_codebook(directory, shape.codebook)
    return directory, shape_from_config(sized)


def _mdlm_dna_dir(directory: Path) -> Path:
    """SEPO's MDLM DNA CNN in ddrl's layout (config.json, model.safetensors, tokenizer.json) at its published
    size: MDLMDNAConfig's defaults, DRAKES's CNN. Its 3.3M parameters are made for real (torch's default
    init; never read: the rehearsal's model is fake), and the model is rehearsed whole, not by layers
    (rehearse_extrapolated): its config has no layer count to resize."""
    from ddrl.models.mdlm_dna import DNATokenizer
    from ddrl.models.native.mdlm_dna import MDLMDNABackbone, MDLMDNAConfig
    from ddrl.training.memory import shape_from_config

    MDLMDNABackbone(MDLMDNAConfig()).save_pretrained(directory)
    DNATokenizer().save_pretrained(directory)
    shape = shape_from_config(json.loads((directory / "config.json").read_text()))
    if shape != MDLM_DNA:  # one published shape: the hand model's and the built model's
        raise AssertionError(f"MDLMDNAConfig's defaults give {shape}, memory.MDLM_DNA says {MDLM_DNA}")
    return directory


def _size_pipeline_codebook(directory: Path, codes: int) -> None:
    """An URSA pipeline's other two holders of the codebook size, which its loader checks against the
    transformer's lm_head_size: the VQ decoder's num_vq_embeddings (vae/config.json) and the metric
    path's codebook (scheduler/scheduler_model.pth "path.emb", written as zeros of the fixture's
    width: the sampler's [rows, codes, N] distances do not depend on it). The text ids keep the
    fixture's lm_vocab_size, the length of its tokenizer: the embedding and head are full size, the
    codes only start earlier in the vocabulary."""
    vae = directory / "vae" / "config.json"
    config = json.loads(vae.read_text())
    vae.unlink()
    vae.write_text(json.dumps({**config, "num_vq_embeddings": codes}, indent=2))
    weights = directory / "scheduler" / "scheduler_model.pth"
    width = torch.load(weights, map_location="cpu", weights_only=True)["path.emb"].shape[1]
    weights.unlink()
    torch.save({"path.emb": torch.zeros(codes, width)}, weights)


def stand_in_vq_dir(into: Path) -> Path:
    """A MAGVIT-v2 directory for an image recipe whose model.vq_path is a placeholder: the released layout
    (config.json naming the class, pytorch_model.safetensors) with every decoder weight's name and a
    one-element stand-in for its value. MAGVIT-v2 has no size arguments: the decoder is built at its
    real size from its class, and no value is read (_weights_unread)."""
    from safetensors.torch import save_file

    from ddrl.models.native.magvit2 import CLASS_NAME, WEIGHTS, MAGVITv2Decoder

    directory = into / "vq"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"_class_name": CLASS_NAME}))
    with torch.device("meta"):
        names = list(MAGVITv2Decoder().state_dict())
    save_file({name: torch.zeros(1) for name in names}, str(directory / WEIGHTS))
    return directory


def fake_loader(directory: Path, device: torch.device):
    """ddrl.models.load_model's stand-in for Trainer(provided=...): the model of `directory` built on the
    meta device (no weight is read), then given fake storage on `device`."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ddrl.models import load_model

    def load(_path: str, **kwargs: Any) -> Any:
        with unset_fake_temporarily(), torch.device("meta"), _weights_unread():  # real meta tensors: to_empty replaces them
            model = load_model(directory, **kwargs)
        return _outside_the_tree_fake(model.to_empty(device=device), device)

    return load


def _outside_the_tree_fake(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The frozen parts a family keeps outside its module tree, so that no .to() or wrapping moves them
    (an image decoder, URSA's metric-path codebook): fake on `device` too, as to_empty made the tree."""
    for name, value in list(vars(model).items()):
        if isinstance(value, torch.nn.Module) and name not in model._modules:
            model.__dict__[name] = value.to_empty(device=device)
        elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            model.__dict__[name] = torch.empty(value.shape, dtype=value.dtype, device=device)
    return model


@contextmanager
def _weights_unread() -> Iterator[None]:
    """The family's reader still opens the shipped tiny weight file; its weight names (the fixture's
    layer count) and its load_state_dict (the tiny shapes) would refuse the resized model. Every module
    keeps the meta parameters of the resized config instead, and no name check is made."""
    import importlib
    import pkgutil
    from torch.nn.modules.module import _IncompatibleKeys

    import ddrl.models.native as native

    families = [importlib.import_module(f"{native.__name__}.{m.name}") for m in pkgutil.iter_modules(native.__path__)]
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.nn.Module, "load_state_dict",
                                              lambda *a, **k: _IncompatibleKeys([], [])))
        for module in families:
            if hasattr(module, "check_weight_names"):
                stack.enter_context(mock.patch.object(module, "check_weight_names", lambda *a, **k: None))
        yield


# ------------------------------------------------------------------ the stand-in task
@dataclass
class StandInTask:
    """Prompts of the recipe's width and rewards 0, 1, 0, 1, ...: every group of two or more completions
    has non-zero advantages, so every estimator pass and the update run as in a real step."""

    prompt: str
    name: str = "rehearsal"
    modality: str = "text"
    image_grid: tuple[int, int] | None = None  # an image recipe's (h, w) codes (task.args.image_grid)

    @classmethod
    def of_recipe(cls, cfg: Any, prompt: str) -> "StandInTask":
        """The stand-in for cfg.task: text, or images of the recipe's grid (the model checks the modality)."""
        grid = (cfg.task.args or {}).get("image_grid")
        return cls(prompt, modality="image", image_grid=tuple(grid)) if grid else cls(prompt)

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return [{"prompt": self.prompt, "answer": ""} for _ in range(n)]

    def eval_examples(self, n: int, seed: int = 0, split: str = "test") -> list[dict[str, Any]]:
        return self.train_examples(n, seed)

    def reward(self, completions: list[Any], **_columns: Any) -> list[float]:
        return [float(i % 2) for i in range(len(completions))]

    def score(self, completions: list[Any], **columns: Any) -> RewardResult:
        return RewardResult(list(self.reward(completions, **columns)))


def prompt_of_width(tokenizer: Any, tokens: int) -> str:
    """A prompt that encodes (chat template and BOS included) to `tokens` tokens or just more."""
    from ddrl.data import tokenize_prompts

    words = tokens
    while len(tokenize_prompts(tokenizer, [" 1" * words])[0]) < tokens:
        words += tokens
    while words > 1 and len(tokenize_prompts(tokenizer, [" 1" * (words - 1)])[0]) >= tokens:
        words -= 1
    return " 1" * words


# ------------------------------------------------------------------ host syncs
class HostReads(TorchDispatchMode):
    """Above FakeTensorMode: counts each data-dependent read (aten._local_scalar_dense: .item(),
    .tolist(), bool(tensor); aten.nonzero, x[mask], unique) by the ddrl call site that made it, and
    answers it with a stand-in (True / 1 / 1.0; nonzero, x[mask], unique: every element; bincount:
    even counts, e.g. an MoE's routing, read back whole by .tolist()), or where `answers` names the call
    site the recipe's own (recipe_answers: an estimator's training rows). A scalar FakeTensorMode holds
    as a constant (a host tensor made from Python numbers, e.g. a schedule's m(t) from torch.tensor(t))
    is answered with its value and not counted. In-place random initialisation
    (uniform_, normal_) is skipped: a fake tensor has no values, and a CPU build has no CUDA generator."""

    # ddrl functions whose boolean read asks "is the data invalid?" and refuses it when True: answered
    # False there (the data a working run gives), True elsewhere.
    REFUSING_CHECKS = {"ddrl/data.py decode_image_ids", "ddrl/models/ursa.py decode_images",  # codes off the codebook
                       "ddrl/models/mmada.py decode_images", "ddrl/processes/uniform.py _check_classes",
                       "ddrl/processes/uniform.py posterior"}  # 0 <= s <= t <= 1
    SKIPPED = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float}

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self.counting = False
        self.within = 0  # inside a call already counted as one read (one_read)
        self.values: dict[int, list[int]] = {}  # stand-in values of a fake tensor the host will read whole
        self.answers: dict[str, int] = {}  # "kind file function" -> the answer there (recipe_answers)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        if not (args and isinstance(args[0], FakeTensor)):  # real data (a device mesh's ranks): the op itself
            return func(*args, **kwargs)
        if func in self.SKIPPED:
            return args[0]
        if func is aten._to_copy.default and kwargs.get("device") is not None and (
                torch.device(kwargs["device"]) != args[0].device):
            options = {k: kwargs[k] for k in ("dtype", "device") if kwargs.get(k) is not None}
            return torch.empty(args[0].shape, **{"dtype": args[0].dtype, **options})
        if func is aten._local_scalar_dense.default:
            if args[0].constant is not None:  # made on the host from Python numbers (torch.tensor(t), then
                with unset_fake_temporarily():  # arithmetic): its value is known, reading it waits for no device
                    return args[0].constant.item()
            self._record("item")
            if f"item {_ddrl_site()}" in self.answers:
                return self.answers[f"item {_ddrl_site()}"]
            dtype = args[0].dtype
            if dtype == torch.bool:
                file_line, function = _ddrl_frame().rsplit(" ", 1)
                return f"{file_line.split(':')[0]} {function}" not in self.REFUSING_CHECKS
            return 1.0 if dtype.is_floating_point else 1
        if func is aten.bincount.default:  # MoE routing counts: read back by .tolist() (one_copy)
            x, minlength = args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            out = torch.empty(max(minlength, 1), dtype=torch.long, device=x.device)
            self.values[id(out)] = _balanced(x.numel(), out.numel())
            weakref.finalize(out, self.values.pop, id(out), None)
            return out
        if func is aten._unique2.default:  # torch.unique: stand-in "every element distinct"
            self._record("unique")
            flat = args[0].reshape(-1)
            n = self.answers.get(f"unique {_ddrl_site()}", flat.numel())
            return (torch.empty(n, dtype=flat.dtype, device=flat.device),
                    torch.empty(args[0].shape, dtype=torch.long, device=flat.device),
                    torch.empty(n, dtype=torch.long, device=flat.device))
        if func is aten.nonzero.default:
            self._record("nonzero")
            x = args[0]
            count = self.answers.get(f"nonzero {_ddrl_site()}", x.numel())
            return torch.empty((count, x.dim()), dtype=torch.long, device=x.device)
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            # x[mask] is nonzero(mask) then a gather: on a GPU the host waits for the count. Stand-in:
            # every element selected, the largest shape the real read can give.
            self._record("nonzero (a read through a boolean mask)")
            return func(args[0], _every_element(args[1]))
        return func(*args, **kwargs)

    @contextmanager
    def objects(self) -> Iterator[None]:
        """Host reads made above the dispatcher. Tensor.tolist: one read (its elements come to the
        dispatcher one by one). dist.all_gather_object pickles through host tensors (a host sync on a
        GPU too), which fake tensors cannot hold: each rank's object stands in as rank 0's (a
        rehearsal's ranks are alike)."""

        def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
            self._record("all_gather_object")
            object_list[:] = [obj] * len(object_list)

        from torch._subclasses.fake_tensor import FakeTensor

        tolist = FakeTensor.tolist  # FakeTensor's own: .item() per element

        def one_copy(tensor: torch.Tensor) -> Any:  # one device-to-host copy, not one read per element
            with self.one_read("tolist"):
                return list(self.values[id(tensor)]) if id(tensor) in self.values else tolist(cast(FakeTensor, tensor))

        with mock.patch("torch.distributed.all_gather_object", all_gather_object), \
                mock.patch.object(FakeTensor, "tolist", one_copy):
            yield

    def _record(self, kind: str) -> None:
        if self.counting and not self.within and not _in_optimizer():
            self.sites[f"{kind} at {_ddrl_frame()}"] += 1

    @contextmanager
    def one_read(self, kind: str) -> Iterator[None]:
        """A call that copies a whole tensor to the host at once (.tolist()): one sync, not one per element."""
        self._record(kind)
        self.within += 1
        try:
            yield
        finally:
            self.within -= 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def recipe_answers(estimator: Any, cfg: Any, recipe_steps: int | None = None) -> dict[str, int]:
    """HostReads' answers where "every element" is not the recipe's step: an estimator's own training
    rows (train.micro_batch_rows chunks), sized from the config as a GPU run sizes them.

    TraceRL (trace, shrink k): a row's states are its distinct commit steps / k, at most
    S = ceil(min(rollout.steps, gen_length) / k) (the LLaDA-8B recipe: 512 steps of one token / 8 = 64),
    the `int(order.max()) + 1` read (its stand-in 1 gave S = 2 at any steps). A chunk of r rows, sample-
    major, holds r / S samples when S divides r or r divides S (its torch.unique; every element
    distinct gave r samples, r x S rows), else at most ceil((r - 1) / S) + 1; its states' nonzero is
    then every element. `recipe_steps`: the recipe's rollout.steps when --quick samples fewer (a quick
    run's rows would be its 16 steps' 2 states, not the recipe's 64).
    UniGRPO (random_ratio copies): a chunk's micro-batch holds its whole slice and computes r of its
    copies x samples rows (score's nonzero), not all of them (35 x 8 = 280 for r = 70)."""
    r, rollout = cfg.train.micro_batch_rows, cfg.rollout
    file = f"ddrl/estimators/{type(estimator).__module__.rsplit('.', 1)[-1]}.py"
    if not r or not hasattr(estimator, "row_chunks"):
        return {}
    if getattr(estimator, "name", "") == "trace":
        steps = min(recipe_steps or rollout.steps or rollout.gen_length, rollout.gen_length)
        states = -(-steps // estimator.shrink)
        samples = r // states if r % states == 0 else 1 if states % r == 0 else -(-(r - 1) // states) + 1
        return {f"item {file} states": states - 1, f"item {file} row_table": states - 1,
                f"unique {file} row_chunks": samples}
    return {f"nonzero {file} score": r}


def _ddrl_site() -> str:
    """The innermost ddrl frame as "file function" (HostReads.answers' key)."""
    file_line, function = _ddrl_frame().rsplit(" ", 1)
    return f"{file_line.split(':')[0]} {function}"


def _balanced(total: int, bins: int) -> list[int]:
    """Stand-in for bincount of `total` items into `bins`: as even as integers allow (an MoE's routing
    when balanced; every expert's slice sums to the same rows whatever the split, so the peak barely
    depends on it)."""
    return [total // bins + (i < total % bins) for i in range(bins)]


def _every_element(indices: list[Any]) -> list[Any]:
    """aten.index's indices with each boolean mask (k dims) replaced by the k long indices that
    nonzero(mask) gives when every element is true: a stand-in for the data-dependent count."""
    out: list[Any] = []
    for index in indices:
        if index is None or index.dtype != torch.bool:
            out.append(index)
            continue
        out += [torch.empty(index.numel(), dtype=torch.long, device=index.device)] * index.dim()
    return out


def _in_optimizer() -> bool:
    """AdamW's step counters are host tensors in a GPU run (not capturable, not fused): reading them
    is no device sync. Here every tensor is a fake CPU one, so such reads are told apart by caller."""
    return any("/torch/optim/" in frame.filename for frame in traceback.extract_stack())


def _ddrl_frame() -> str:
    """The innermost ddrl frame of the stack (file:line function), where a read was asked for."""
    root = str(Path(__file__).resolve().parents[1])
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(root) and not frame.filename.endswith("rehearse.py"):
            return f"{Path(frame.filename).relative_to(Path(root).parent)}:{frame.lineno} {frame.name}"
    return "outside ddrl"


class DeviceGuardless(torch.overrides.TorchFunctionMode):
    """Tensor.copy_ and Tensor.__setitem__ take a CUDA device guard in their Python bindings, which a
    CPU build cannot make even for fake tensors; the same aten ops called directly need none. A write
    through an advanced index lands in a temporary (fake tensors hold no values: only shapes count);
    one through a boolean mask is a host sync, counted in `reads`."""

    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            return aten.copy_.default(args[0], args[1], **kwargs)
        if func is torch.Tensor.__setitem__:
            target, index, value = args
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts):
                self.reads._record("nonzero (a write through a boolean mask)")  # on a GPU too: index_put_ syncs
                return None
            with torch._C.DisableTorchFunction():
                view = target[index]
            if isinstance(value, torch.Tensor):
                aten.copy_.default(view, value)
            else:
                aten.fill_.Scalar(view, value)
            return None
        return func(*args, **kwargs)


@contextmanager
def cuda_dropout() -> Iterator[None]:
    """F.dropout as CUDA runs it: at::native::dropout takes the fused native_dropout on a GPU (0 < p < 1),
    which keeps a bool mask for backward; a CPU build keeps a float mask of the input's dtype (LoRA's
    fp32 adapter input: 4 bytes an element, not 1). A patch, not a mode: activation checkpointing's
    recomputation in backward runs outside the torch-function modes, and must draw the same mask."""
    plain = torch.nn.functional.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p <= 0.0 or p >= 1.0 or inplace:
            return plain(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    with mock.patch.object(torch.nn.functional, "dropout", dropout):
        yield


@contextmanager
def ddp_on_fake() -> Iterator[None]:
    """DDP's constructor compares every rank's parameter shapes and broadcasts rank 0's weights through
    host reads of the data (dist._verify_params_across_processes), which fake tensors cannot give; in a
    rehearsal the ranks are alike by construction and the weights have no values. Construction only:
    the step's gradient buckets and all-reduce are DDP's own."""
    import torch.nn.parallel.distributed as ddp

    with mock.patch.object(ddp, "_verify_param_shape_across_processes", lambda *a, **k: None), \
            mock.patch.object(ddp, "_sync_module_states", lambda *a, **k: None):
        yield


def _ddp_buckets_tracked(ddp: Any, tracker: Any) -> None:
    """DDP on the fake process group: its all-reduce gives the reducer no result, so a comm hook hands
    each gradient bucket back as reduced (collectives cost nothing here anyway), and shows the tracker
    the bucket (DDP allocated it before the tracker started; "other" in the split). The reducer's
    rebuild of its buckets after the first iteration reads their data: skipped (same buckets, in the
    order of the first backward instead of the observed one; the same bytes)."""
    seen: set[int] = set()

    def hook(_state, bucket):  # unannotated on purpose: DDP checks the annotations (none, or its own)
        buffer = bucket.buffer()
        if id(buffer) not in seen:
            seen.add(id(buffer))
            tracker.track_external(buffer)
        done: Any = torch.futures.Future()
        done.set_result(buffer)
        return done

    class NoRebuild:
        def __init__(self, reducer: Any):
            self._reducer = reducer

        def _rebuild_buckets(self) -> bool:
            return False

        def __getattr__(self, name: str) -> Any:
            return getattr(self._reducer, name)

    ddp.register_comm_hook(None, hook)
    ddp.reducer = NoRebuild(ddp.reducer)


# ------------------------------------------------------------------ time
# torch.utils._runtime_estimation.flops_to_ns (torch 2.13) times an op as (flops / 2) / (0.75 x the TFLOP/s it
# is given): a multiply-add counted once against a peak that counts it twice (NVIDIA's datasheets), at 75% of
# it, i.e. 1.5x faster than the peak allows. Given peak / 1.5, its compute time is flops / peak: a lower bound.
# tests/unit/test_rehearse_parts.py times one matmul against 2 m n k / peak.
TORCH_FLOPS_TO_NS_SPEEDUP = 2 * 0.75


ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                         aten.new_empty.default, aten.new_empty_strided.default})


def moves_no_data(func: Any) -> bool:
    """An op no kernel reads memory for: a metadata query (prim::device, prim::layout), a view (its output
    aliases an input without writing it: slice, narrow, as_strided ...) or an allocation. torch's roofline
    ignores a list of views only; it charges the rest the bytes of their inputs and outputs at HBM speed,
    and `tensor.device`, which Python code asks of every big tensor, was most of a rehearsed step's time."""
    if func.namespace == "prim" or func in ALLOCATIONS:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class TotalOnly:
    """A ModTracker that tracks no module: RuntimeEstimator then adds every op's time to its total only."""

    parents: tuple[str, ...] = ()
    is_bw = False

    def register_user_hooks(self, **hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> TotalOnly:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


@contextmanager
def roofline(device: Device) -> Iterator[Any]:
    """RuntimeEstimator in roofline mode ("operator-level-cost-model") with `device`'s figures. The
    estimator reads them from the local GPU (torch._inductor.utils.get_device_tflops and
    get_gpu_dram_gbps, through torch.utils._runtime_estimation) and asserts torch.cuda.is_available();
    on this CPU they are given instead."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    import torch.utils._runtime_estimation as estimation

    def tflops(dtype: torch.dtype) -> float:  # the figure that makes torch's compute time flops / peak
        peak = device.fp32_tflops if dtype == torch.float32 else device.bf16_tflops
        return peak / TORCH_FLOPS_TO_NS_SPEEDUP

    est = RuntimeEstimator()
    est("operator-level-cost-model")
    # Total time only (the rehearsal reads est.total_runtime): no per-module split, so no ModTracker, whose
    # hooks on every module call cost most of an MoE rehearsal's time (LLaDA2: 256 expert calls a layer)
    est._mod_tracker = TotalOnly()  # type: ignore[assignment]
    available = torch.cuda.is_available

    def estimate(func: Any, args: Any, kwargs: Any) -> Any:
        if moves_no_data(func):
            return func(*args, **(kwargs or {})), 0.0
        torch.cuda.is_available = lambda: True  # only for the estimator's own assertion
        try:
            return RuntimeEstimator._roofline_estimate(func, args, kwargs)
        finally:
            torch.cuda.is_available = available

    est._estimate = estimate
    with mock.patch.object(estimation, "get_device_tflops", tflops), \
            mock.patch.object(estimation, "get_gpu_dram_gbps", lambda: device.hbm_gbps), \
            mock.patch("builtins.print"), est:  # the estimator prints its total on exit
        yield est


# ------------------------------------------------------------------ the report
@dataclass
class Rehearsal:
    """What one rehearsed step measured (bytes, seconds; rank 0 of world_size)."""

    config: str
    world_size: int
    layers: int
    strategy: str
    peak_bytes: float
    peak_split: dict[str, float]
    rollout_peak_bytes: float
    rollout_peak_split: dict[str, float]
    hand_total_bytes: float
    hand_terms: dict[str, float]
    host_reads: dict[str, int]
    rollout_s: float
    update_s: float
    update_flops: float
    tokens: int
    device: Device = field(default_factory=Device)
    settings: dict[str, Any] = field(default_factory=dict)  # the recipe's settings fit_advice reads
    optimizer_steps: int = 0  # the trainer's count after the step: the update ran to opt.step()
    optimizer_state_bytes: float = 0.0  # AdamW's state on this rank after the step (exp_avg, exp_avg_sq, step)
    measured_layers: tuple[int, ...] = ()  # the layer counts rehearsed when `layers` is extrapolated from them
    sampler_calls: int = 0  # the rollout's sampler calls (rollout.batch_rows), of which replayed_calls were
    replayed_calls: int = 0  # replayed: the last rehearsed call's shapes, time and host reads (replayed_sampler_calls)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= HEADROOM * self.device.memory_bytes

    def table(self) -> str:
        d = self.device
        how = (f"extrapolated from {' and '.join(map(str, self.measured_layers))} layers"
               if self.measured_layers else "rehearsed")
        lines = [f"rehearsal of {self.config}: rank 0 of {self.world_size}, {self.layers} layers ({how}), strategy "
                 f"{self.strategy} (fake tensors; estimates, not measurements on a {d.name})",
                 f"  {'memory at peak (MemTracker)':<44}{'GB':>9}"]
        lines += [f"    {name:<42}{v / GB:9.2f}" for name, v in self.peak_split.items() if v]
        ratio = self.peak_bytes / self.hand_total_bytes if self.hand_total_bytes else float("nan")
        if self.settings.get("cpu_offload"):
            lines.append("    (CPU offload: the parameter shards, their gradients and AdamW state are host memory, "
                         "not counted)")
        lines += [f"  {'peak (tracker)':<44}{self.peak_bytes / GB:9.2f}",
                  f"  {'  peak up to the end of the rollout':<44}{self.rollout_peak_bytes / GB:9.2f}",
                  f"  {'hand model (ddrl.training.memory)':<44}{self.hand_total_bytes / GB:9.2f}"
                  f"   tracker / hand = {ratio:.2f}"]
        lines += [f"    {name:<42}{v / GB:9.2f}" for name, v in self.hand_terms.items()]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"  {verdict} a {d.memory_bytes / GB:.0f} GB {d.name} with {100 - HEADROOM * 100:.0f}% headroom")
        if self.replayed_calls:
            lines.append(f"  rollout: {self.sampler_calls} sampler calls (rollout.batch_rows); the first and last "
                         f"rehearsed, {self.replayed_calls} between replayed (the last's shapes, time, host syncs)")
        lines.append(f"  host syncs in the step: {sum(self.host_reads.values())}"
                     + ("" if self.host_reads else " (none)"))
        lines += [f"    {n:>6} x {site}" for site, n in sorted(self.host_reads.items(), key=lambda kv: -kv[1])]
        step = self.rollout_s + self.update_s
        mfu = self.update_flops / max(self.update_s, 1e-12) / (d.bf16_tflops * 1e12)
        lines += [f"  time (RuntimeEstimator roofline, {d.bf16_tflops:.0f} TFLOP/s bf16, {d.hbm_gbps / 1000:.1f} TB/s):"
                  f" rollout {self.rollout_s:.2f} s, update {self.update_s:.2f} s, step {step:.2f} s",
                  f"    {self.tokens / max(step, 1e-12):,.0f} tokens/s per rank (rollout tokens); update MFU "
                  f"{mfu:.0%} (model FLOPs / (time x peak), collectives not modelled)"]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Rehearsal":
        """A report as rehearsal.json holds it (to_json) back as a Rehearsal."""
        fields = {k: v for k, v in data.items() if k != "fits"}
        return cls(**{**fields, "device": Device(**data["device"]),
                      "measured_layers": tuple(data.get("measured_layers", ()))})


class RecipeDoesNotFit(ValueError):
    """The tracker's peak exceeds the device's memory less the headroom."""


class FakeTensorUnsupported(RuntimeError):
    """The family's modeling code makes an op that fake tensors cannot run."""


def rehearse(config: str | Path, overrides: list[str] | None = None, world_size: int = 8, *,
             layers: int | None = None, device: Device = DEVICE, check_fit: bool = True,
             recipe_steps: int | None = None, one_share: bool = False, replay_calls: bool = True) -> Rehearsal:
    """One step of the recipe at its real size (or `layers` layers) on rank 0 of world_size fake ranks;
    the report is written to the run directory (output_dir/rehearsal/rehearsal.json). `replay_calls`
    False rehearses every sampler call (replayed_sampler_calls: the same figures, slower)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ddrl.config import RLConfig, load_config

    cfg = load_config(config, overrides, RLConfig)
    cfg.output_dir = str(Path(cfg.output_dir) / "rehearsal")
    cfg.train.wandb, cfg.train.tensorboard, cfg.train.progress = False, False, False
    cfg.resume, cfg.overwrite = False, True  # the rehearsal's directory is its own scratch space
    cfg.eval.n = 0  # one training step is rehearsed, no evaluation (nor its checks of the eval split)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    env = {"WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory(prefix="ddrl-rehearse-") as tmp:
            directory, shape = sized_model_dir(cfg.model.path, layers, Path(tmp))
            if cfg.model.vq_path is not None and not Path(cfg.model.vq_path).is_dir():
                cfg.model.vq_path = str(stand_in_vq_dir(Path(tmp)))
            return _rehearse(cfg, str(config), directory, shape, world_size, device, check_fit, recipe_steps,
                             one_share, replay_calls)
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _rehearse(cfg: Any, name: str, directory: Path, shape: ModelShape, world_size: int, device: Device,
              check_fit: bool, recipe_steps: int | None = None, one_share: bool = False,
              replay_calls: bool = True) -> Rehearsal:
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode, UnsupportedOperatorException)

    from ddrl.data import prompt_budget
    from ddrl.models import load_model
    from ddrl.training.memory import Counts, estimate_memory
    from ddrl.training.trainer import Provided, Trainer

    with torch.device("meta"), _weights_unread():
        model = load_model(directory, require_tokenizer=True)
    budget = prompt_budget(model, cfg.rollout)  # an unconditional model's is 0 (SEPO's DNA CNN: empty prompts)
    width = cfg.rollout.max_prompt_length or DEFAULT_PROMPT_TOKENS
    width = width if budget is None else min(width, budget)
    tokenizer = model.tokenizer
    task = StandInTask.of_recipe(cfg, prompt_of_width(tokenizer, width))
    # The recipe's device. A build without CUDA (this project's CI) cannot run FSDP2's CUDA streams even on
    # fake tensors: there the rank is rehearsed as fake CPU tensors, with the same shapes, dtypes and wrapping
    # (the one difference: autocast's op list is the CPU one under DDP / one process).
    cuda = torch.device("cuda", 0) if torch.backends.cuda.is_built() else torch.device("cpu")
    reads = HostReads()
    with ExitStack() as stack:
        fake = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        # copy.deepcopy of a fake tensor (the trainer's reference copy of a full fine-tuning run) copies its
        # __dict__, which holds the mode itself: one mode for every copy, as one allocator on a GPU
        stack.enter_context(mock.patch.object(FakeTensorMode, "__deepcopy__", lambda mode, memo: mode, create=True))
        # The mode memoises each fake tensor by weak reference; Module.to (the trainer's placement, peft's
        # adapter moves) swaps a fake parameter, which torch.utils.swap_tensors refuses while one exists.
        # Strong references while the trainer is built; weak ones again for the step, so that the
        # memory tracker sees its tensors freed.
        converter = fake.fake_tensor_converter.meta_converter
        converter.tensor_memo = {}  # type: ignore[assignment]  # a strong dict on purpose (above)
        stack.enter_context(reads)
        stack.enter_context(reads.objects())
        stack.enter_context(DeviceGuardless(reads))
        stack.enter_context(cuda_dropout())
        stack.enter_context(ddp_on_fake())
        trainer = Trainer(cfg, Provided(device=cuda, task=task, load_model=fake_loader(directory, cuda),
                                        memory_check=False))
        converter.tensor_memo = weakref.WeakValueDictionary(converter.tensor_memo)
        reads.answers = recipe_answers(trainer.method.estimator, cfg, recipe_steps)
        for group in trainer.opt.param_groups:  # AdamW's default on CUDA tensors (CPU ones default to the loop)
            group["foreach"] = True
        _steady_state(trainer)
        tracker = _memory_tracker(trainer)
        if isinstance(trainer.wrapped, torch.nn.parallel.DistributedDataParallel):
            _ddp_buckets_tracked(trainer.wrapped, tracker)
        phases: dict[str, Any] = {}
        est = stack.enter_context(roofline(device))
        stack.enter_context(tracker)
        calls = stack.enter_context(replayed_sampler_calls(est, reads)) if replay_calls else Counter()
        _mark_phases(trainer, est, tracker, cuda, phases)
        if one_share:
            _one_share(trainer)
        reads.counting = True
        try:
            trainer.train_step(1)
        except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as e:
            raise FakeTensorUnsupported(
                f"{name}: the model's code makes {e.func} on fake tensors, which cannot run without data "
                f"(at {_ddrl_frame_of(e)}); this family cannot be rehearsed until that op is avoided") from None
        reads.counting = False
    peak = tracker.get_tracker_snapshot("peak").get(cuda, {})
    split = _named_split(peak)
    hand = estimate_memory(cfg, shape, world_size, counts=Counts.from_module(trainer.model),
                           prompt_tokens=width)
    hand_terms = {**hand.held, **{f"{hand.peak_phase}: {k}": v for k, v in hand.phases[hand.peak_phase].items()}}
    t = cfg.train
    rows = t.prompts_per_step // world_size * t.group_size
    report = Rehearsal(config=name, world_size=world_size, layers=shape.n_layers, strategy=trainer.strategy,
                       peak_bytes=float(peak.get("Total", sum(split.values()))), peak_split=split,
                       rollout_peak_bytes=phases.get("rollout_peak", 0.0),
                       rollout_peak_split=phases.get("rollout_split", {}), hand_total_bytes=hand.total,
                       hand_terms=hand_terms, host_reads=dict(reads.sites), rollout_s=phases.get("rollout", 0.0),
                       update_s=phases.get("update", 0.0) * (t.minibatches if one_share else 1), update_flops=phases.get("update_flops", 0.0),
                       tokens=rows * cfg.rollout.gen_length, device=device, optimizer_steps=trainer.optimizer_steps,
                       settings={"strategy": trainer.strategy, "cpu_offload": cfg.dist.cpu_offload,
                                 "lora_rank": cfg.model.lora.rank, "micro_batch_size": t.micro_batch_size,
                                 "gradient_checkpointing": cfg.model.gradient_checkpointing},
                       optimizer_state_bytes=float(sum(_local_bytes(v) for state in trainer.opt.state.values()
                                                       for v in state.values() if isinstance(v, torch.Tensor))),
                       sampler_calls=calls["calls"], replayed_calls=calls["replayed"])
    _write(report, trainer.run_dir)
    if check_fit:
        require_fit(report)
    return report


def _named_split(snapshot: dict[Any, int]) -> dict[str, float]:
    """MemTracker's snapshot of one device as {category as the table names it: bytes}."""
    return {SPLIT_NAMES.get(getattr(k, "name", str(k)), str(k)): float(v) for k, v in snapshot.items() if k != "Total"}


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds: a DTensor (FSDP2's sharded state) reports its global size."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.nbytes


def _write(report: Rehearsal, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "rehearsal.json").write_text(json.dumps(report.to_json(), indent=2))


def require_fit(report: Rehearsal) -> None:
    """RecipeDoesNotFit, with the tracker's split and what would make it fit, unless it fits."""
    if report.fits:
        return
    d = report.device
    advice = "\n".join(f"  - {line}" for line in fit_advice(report))
    raise RecipeDoesNotFit(
        f"{report.table()}\n{report.config} does not fit: rank 0 peaks at {report.peak_bytes / GB:.1f} GB "
        f"(split above), more than {HEADROOM:.0%} of a {d.memory_bytes / GB:.0f} GB {d.name}. Settings that lower "
        f"it, the largest term's first:\n{advice}")


def fit_advice(report: Rehearsal) -> list[str]:
    """The settings this recipe does not use yet that shrink a term of its split, ordered by the size
    of the term they shrink (a recipe that already shards is not told to shard)."""
    s, split = report.settings, report.peak_split
    state = sum(v for k, v in split.items() if k.split(" ")[0] in ("parameters", "gradients", "optimizer"))
    acts = sum(v for k, v in split.items() if k.split(" ")[0] in ("activations", "temporaries"))
    options = [(state, "dist.strategy=fsdp (weights, gradients and AdamW state 1/N per rank)",
                s.get("strategy") != "fsdp"),
               (state, f"--world-size {2 * report.world_size} (1/{2 * report.world_size} of the sharded state)",
                s.get("strategy") == "fsdp"),
               (state, "dist.cpu_offload=true (shards, gradients and AdamW state in host memory)",
                s.get("strategy") == "fsdp" and not s.get("cpu_offload")),
               (state, "model.lora.rank=128 (LoRA: gradients and AdamW state of the adapters only)",
                not s.get("lora_rank")),
               (acts, "model.gradient_checkpointing=true (one block's activations kept, not every block's)",
                not s.get("gradient_checkpointing")),
               (acts, f"train.micro_batch_size={max(1, (s.get('micro_batch_size') or 2) // 2)} (fewer rows per "
                      f"forward and backward)", (s.get("micro_batch_size") or 2) > 1)]
    return [f"{text} [{term / GB:.1f} GB of the peak]"
            for term, text, applies in sorted(options, key=lambda o: -o[0]) if applies]


@dataclass
class FullDepthHand:
    layers: int
    estimate: Any  # ddrl.training.memory.MemoryEstimate


def full_depth_hand(cfg: Any, world_size: int) -> FullDepthHand | None:
    """The hand model beside an extrapolated rehearsal: the family's shipped config.json at the recipe's
    published shape and full depth, the rollout's prompt width; None for a checkpoint file (rehearsed
    whole, its hand figure counts the built module). Seconds, no model built: `bench/rehearse_all.py
    --hand-only` lists it for every recipe."""
    from ddrl.training.memory import estimate_memory, shape_from_config

    source, shape = family_source(cfg.model.path)
    if source.is_file():
        return None
    name = "transformer/config.json" if (source / "transformer").is_dir() else "config.json"
    full = shape_from_config(sized_config(json.loads((source / name).read_text()), shape, None))
    width = cfg.rollout.max_prompt_length or DEFAULT_PROMPT_TOKENS
    return FullDepthHand(full.n_layers, estimate_memory(cfg, full, world_size, prompt_tokens=width))


def rehearse_extrapolated(config: str | Path, overrides: list[str] | None = None, world_size: int = 8, *,
                          device: Device = DEVICE, check_fit: bool = True,
                          recipe_steps: int | None = None, one_share: bool = False) -> Rehearsal:
    """The recipe at its full depth from rehearsals at EXTRAPOLATE_LAYERS (full width), for the CPU time
    of 10 layers (module doc, "the depth"). See extrapolate for why a line holds."""
    from ddrl.config import RLConfig, load_config

    cfg = load_config(config, overrides, RLConfig)
    hand = full_depth_hand(cfg, world_size)
    if hand is None:  # a checkpoint file (SEPO's 3.3M-parameter DNA CNN): no layer count to resize, rehearsed whole
        return rehearse(config, overrides, world_size, device=device, check_fit=check_fit,
                        recipe_steps=recipe_steps, one_share=one_share)
    fewer, more = (rehearse(config, overrides, world_size, layers=n, device=device, check_fit=False,
                           recipe_steps=recipe_steps, one_share=one_share) for n in EXTRAPOLATE_LAYERS)
    report = extrapolate(fewer, more, hand.layers, hand.estimate)
    _write(report, Path(cfg.output_dir) / "rehearsal")
    if check_fit:
        require_fit(report)
    return report


def extrapolate(fewer: Rehearsal, more: Rehearsal, layers: int, hand: Any) -> Rehearsal:
    """`layers` layers from two rehearsals at the same width. Memory and time are linear in the layer
    count: each block adds its shards, its LoRA weights, gradients and AdamW state, its kept
    activations and its FLOPs; the embeddings, the logits and the sampler's state are the intercept.
    So each figure is more's plus (layers - more.layers) / (more.layers - fewer.layers) increments. The
    peak is the larger of two lines, the rollout's and the whole step's (the phase that peaks can
    change with depth). A line holds only where both rehearsals peak at the same moment of the step
    (EXTRAPOLATE_LAYERS says why not 2 layers). Host syncs too, by call site: most do not depend on
    depth (a dense model's two depths give the same counts: a test), but an MoE's routing counts are
    read once a layer a forward. `hand`: the hand model's estimate at `layers` (a MemoryEstimate)."""
    per = (layers - more.layers) / (more.layers - fewer.layers)

    def line(a: float, b: float) -> float:
        return b + (b - a) * per

    reads = {site: round(line(fewer.host_reads.get(site, 0), more.host_reads.get(site, 0)))
             for site in {**fewer.host_reads, **more.host_reads}}

    rollout = line(fewer.rollout_peak_bytes, more.rollout_peak_bytes)
    peak = max(rollout, line(fewer.peak_bytes, more.peak_bytes))
    rollout_split = {k: line(fewer.rollout_peak_split.get(k, 0.0), v) for k, v in more.rollout_peak_split.items()}
    split = rollout_split if peak == rollout else {k: line(fewer.peak_split.get(k, 0.0), v)
                                                   for k, v in more.peak_split.items()}
    if any(v < 0 for v in split.values()):  # the peak's moment moved within the update between the two depths
        split = {f"total (the split moves between {fewer.layers} and {more.layers} layers: see the rehearsals)": peak}
    hand_terms = {**hand.held, **{f"{hand.peak_phase}: {k}": v for k, v in hand.phases[hand.peak_phase].items()}}
    return Rehearsal(config=more.config, world_size=more.world_size, layers=layers, strategy=more.strategy,
                     peak_bytes=peak, peak_split=split, rollout_peak_bytes=rollout,
                     rollout_peak_split=rollout_split,
                     hand_total_bytes=hand.total,
                     hand_terms=hand_terms, host_reads={site: n for site, n in reads.items() if n > 0},
                     rollout_s=line(fewer.rollout_s, more.rollout_s), update_s=line(fewer.update_s, more.update_s),
                     update_flops=line(fewer.update_flops, more.update_flops), tokens=more.tokens,
                     device=more.device, settings=more.settings, optimizer_steps=more.optimizer_steps,
                     optimizer_state_bytes=line(fewer.optimizer_state_bytes, more.optimizer_state_bytes),
                     measured_layers=(fewer.layers, more.layers), sampler_calls=more.sampler_calls,
                     replayed_calls=more.replayed_calls)


def _ddrl_frame_of(error: BaseException) -> str:
    root = str(Path(__file__).resolve().parents[1])
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f.filename.startswith(root) and not f.filename.endswith("rehearse.py")]
    return (f"{Path(frames[-1].filename).relative_to(Path(root).parent)}:{frames[-1].lineno} {frames[-1].name}"
            if frames else "unknown")


def _steady_state(trainer: Any) -> None:
    """What every step after the first starts with, made before the tracker starts: each trainable
    parameter's gradient (the previous update's: the trainer frees it at the next update's zero_grad,
    so it is alive through the rollout) and AdamW's moments (made at its first step). Without them a
    rehearsed first step is a step no GPU repeats: a recipe whose peak is the rollout (FSDP2's gathered
    weights under full fine-tuning) measured low by gradients + AdamW state, 3 P_t 4 / N (coupled_grpo:
    11.4 GB). Made by one AdamW step on zero gradients: fake tensors, no value changes; the trainer's
    own count of optimizer steps is not touched. With dist.cpu_offload both live in host memory: none."""
    if trainer.cfg.dist.cpu_offload:
        return
    for group in trainer.opt.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    trainer.opt.step()


def _memory_tracker(trainer: Any) -> Any:
    """MemTracker over the policy (and a separate reference copy) and the optimizer. FSDPMemTracker
    would split FSDP2's sharded and unsharded parameters, but refuses a module called more than once
    per iteration, which every sampler does (one call per denoising step)."""
    models = [trainer.wrapped, *([trainer.ref_model] if trainer.ref_model is not None else [])]
    tracker = step_memory_tracker(*models, trainer.opt)
    if trainer.cfg.dist.cpu_offload:  # FSDP2's CPUOffloadPolicy: the shards live in host memory
        tracker.host_bytes = int(sum(_local_bytes(p) for m in models for p in m.parameters()))
    return tracker


def step_memory_tracker(*tracked: Any) -> Any:
    """A MemTracker (below) over `tracked` (modules, optimizers), not yet entered."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    _PARAM, _OPT, _GRAD = _MemRefType.PARAM, _MemRefType.OPT, _MemRefType.GRAD

    class FrozenAwareMemTracker(MemTracker):
        """MemTracker hooks every parameter's gradient, which a frozen one (a LoRA base) refuses; without
        the hooks a gradient is labelled when the next forward meets it (or stays a temporary). And it
        refuses a module called again in one iteration. Only the per-module stats restart; the device's
        peak, which the report reads, is kept across."""

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            """A sampler calls the model once per step: per-module stats restart (the device's peak stays)."""
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        # A module whose forward ran before such a restart has no stats left for its later hooks (its
        # backward, or a forward that outlived the restart): those per-module snapshots are skipped.
        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            if module in self.memory_tracking:
                super()._post_fw_hook(module, inputs, outputs)

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            if module is not None and module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            if module is not None and module in self.memory_tracking:
                super()._post_bw_hook(module, args)

        host_bytes = 0  # with dist.cpu_offload: the parameter shards' bytes (host memory, not the GPU's)
        propagating = 0  # inside DTensor's sharding propagation (below)

        def __enter__(self) -> Any:
            """DTensor works out an op's output shape by running it on fake tensors of the global shape
            (ShardingPropagator._propagate_tensor_meta_non_cached), in the fake mode it finds active. On
            a GPU that is a FakeTensorMode of its own, which MemTracker skips; here it is the rehearsal's,
            so MemTracker counted those global-shape stand-ins as allocations. AdamW's foreach ops over
            FSDP2's DTensor shards made N full-size copies of the trainable weights per list of
            arguments (coupled_grpo: 21 GB of "optimizer state" at 2 layers, 0.8 GB of shards each).
            Ops made inside it are left untracked."""
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            propagate = ShardingPropagator._propagate_tensor_meta_non_cached
            tracker = self

            def untracked(propagator: Any, op_schema: Any) -> Any:
                tracker.propagating += 1
                try:
                    return propagate(propagator, op_schema)
                finally:
                    tracker.propagating -= 1

            self._propagation_patch = mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached",
                                                        untracked)
            self._propagation_patch.start()
            return super().__enter__()

        def __exit__(self, *args: Any) -> None:
            try:
                super().__exit__(*args)
            finally:
                self._propagation_patch.stop()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if self.propagating:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            """The device's peak only. MemTracker also updates the local peak of every module it has met
            on every op, a loop over all of them: an MoE layer of 256 experts is over a thousand
            modules, and that loop was most of a rehearsal's time. Per-module peaks are not reported.
            Under CPU offload the host's part is left out of the device's figure: the parameter shards
            (host_bytes), the optimizer state and the sharded gradients (FSDP2 copies each reduce-scattered
            gradient to its shard's host memory; MemTracker labels a tensor a gradient as the .grad of a
            tracked parameter, i.e. of a shard; a block's unsharded gradients are the backward's
            temporaries, on the device, and stay in)."""
            for dev, snap in self._curr_mem_snap.items():
                device = dict(snap)
                if self.host_bytes:
                    device[_PARAM] = device.get(_PARAM, 0) - self.host_bytes
                    device.pop(_OPT, None)
                    device.pop(_GRAD, None)
                    device["Total"] = sum(v for k, v in device.items() if k != "Total")
                if self._peak_mem.get(dev, 0) < device["Total"]:
                    self._peak_mem[dev] = device["Total"]
                    self._peak_mem_snap[dev] = device

    tracker = FrozenAwareMemTracker()
    tracker.track_external(*tracked)
    return tracker


def _flop_counter() -> Any:
    """FlopCounterMode counting the total only. Its ModuleTracker would hang a gradient hook on the
    outputs of every module forward, the recomputations of activation checkpointing in backward
    included, whose graphs are never run backward: the hooks and the graphs hold each other through
    autograd's C++ nodes, out of the garbage collector's reach, so every checkpointed block's
    recomputed activations stayed alive to the end of the step (a rehearsal with checkpointing
    measured ~3x a step without it; on a GPU, which runs no flop counter, they are freed)."""
    from torch.utils.flop_counter import FlopCounterMode

    class NoModules:
        parents = {"Global"}  # the one scope get_total_flops sums

        def __enter__(self) -> None:
            return None

        def __exit__(self, *args: Any) -> None:
            return None

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = NoModules()  # type: ignore[assignment]  # a stand-in with the two members FlopCounterMode uses
    return counter


@contextmanager
def replayed_sampler_calls(est: Any, reads: HostReads) -> Iterator[Counter[str]]:
    """A rollout of many sampler calls (sample_in_chunks: rollout.batch_rows rows a call) with the first
    and the last call of each row count rehearsed and the calls between replayed. On fake tensors a call
    makes the same ops on the same shapes as every call of its row count: a replayed call's outputs are
    allocated again (empty_like, what sample_in_chunks holds until it joins them), and its roofline time
    and host reads are those of the last call of its row count (not the first's, which also fills what
    later calls find cached). A row count's last call runs with every earlier output held, so the rollout's
    peak is the one every call rehearsed gives (a test compares them). d1 on LLaDA2-mini at one row a call:
    16 calls, each 20 x 256 expert calls through the dispatch layers; 2 are rehearsed (29 min on a CPU
    for 4 and 6 layers: bench/RESULTS.md).
    Yields the counts: "calls" (the largest rollout's) and "replayed"."""
    import ddrl.sampling.base as base
    import ddrl.sampling.engine as engine

    counts: Counter[str] = Counter()
    in_chunks, call_chunks = base.sample_in_chunks, base._call_chunks
    planned: list[int] = []  # the rows of each call of the rollout under way

    def counted_chunks(*args: Any, **kwargs: Any) -> list[Any]:
        chunks = call_chunks(*args, **kwargs)
        planned[:] = [hi - lo for lo, hi, _ in chunks]
        return chunks

    def replaying(sampler: Any, *args: Any, **kwargs: Any) -> Any:
        planned.clear()
        made = [0]
        outputs: dict[int, Any] = {}  # row count -> the output of its latest rehearsed call
        figures: dict[int, tuple[float, Counter[str]]] = {}  # row count -> that call's (roofline ms, host reads)
        replayed: Counter[int] = Counter()  # row count -> calls replayed

        def call(*a: Any, **k: Any) -> Any:
            i, rows, sizes = made[0], len(a[1]), planned or [len(a[1])]
            made[0] += 1
            counts["calls"] = max(counts["calls"], len(sizes))
            if rows in outputs and i < max(j for j, r in enumerate(sizes) if r == rows):
                replayed[rows] += 1
                counts["replayed"] += 1
                return _allocated_like(outputs[rows])
            start, before = est.total_runtime, Counter(reads.sites)
            outputs[rows] = sampler(*a, **k)
            figures[rows] = est.total_runtime - start, reads.sites - before
            if i == len(sizes) - 1:  # every row count's last call has run: the replayed calls' figures
                for r, m in replayed.items():
                    est.total_runtime += m * figures[r][0]
                    reads.sites.update({site: m * n for site, n in figures[r][1].items()})
            return outputs[rows]

        return in_chunks(call, *args, **kwargs)

    with mock.patch.object(base, "_call_chunks", counted_chunks), \
            mock.patch.object(engine, "sample_in_chunks", replaying):
        yield counts


def _allocated_like(value: Any) -> Any:
    """`value` (a SampleOutput, a Trajectory, a tensor ...) with every tensor in it allocated again, unfilled."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: _allocated_like(getattr(value, f.name)) for f in fields(value)})
    return value


def _one_share(trainer: Any) -> None:
    """The update's first optimizer step only (rehearse's one_share, the bench's --quick for a recipe
    of many micro-batches a share): each of train.minibatches shares is the busiest rank's, the one
    every rank pads to, group_size x ceil(prompts_per_step / minibatches) rows, so every share has the
    same shapes, and the steady state already holds the gradients and AdamW's state: the peak is the
    whole update's, and its time is this share's x minibatches (rehearse scales it). Without it a fake
    step's shares are each the rank's whole batch (nonzero's stand-in), minibatches times over."""
    t = trainer.cfg.train

    def first_share(batch: Any) -> list[Any]:
        return [batch.index(slice(0, min(len(batch), t.group_size * -(-t.prompts_per_step // t.minibatches))))]

    trainer.planner.minibatch_shares = first_share


def _mark_phases(trainer: Any, est: Any, tracker: Any, device: torch.device, phases: dict[str, Any]) -> None:
    """Wrap the trainer's phase methods on this instance only, so that the roofline time and the
    tracker's peak are read at the phase boundaries of the trainer's own train_step."""

    def peak() -> float:
        return float(tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0))

    def split() -> dict[str, float]:
        return _named_split(tracker.get_tracker_snapshot("peak").get(device, {}))

    def timed(method: Any, name: str, count_flops: bool = False) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = est.total_runtime
            flops: Any = _flop_counter() if count_flops else ExitStack()
            with flops:
                out = method(*args, **kwargs)
            phases[name] = phases.get(name, 0.0) + (est.total_runtime - start) / 1e3  # ms -> s
            if count_flops:
                phases["update_flops"] = phases.get("update_flops", 0.0) + flops.get_total_flops()
            if name == "rollout":
                phases["rollout_peak"] = peak()
                phases["rollout_split"] = split()
            return out
        return run

    trainer.rollout = timed(trainer.rollout, "rollout")
    trainer.behaviour_passes = timed(trainer.behaviour_passes, "update", count_flops=True)
    trainer.update = timed(trainer.update, "update", count_flops=True)
