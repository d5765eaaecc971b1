"""DRAKES / SEPO's MDLM DNA model -> DiffusionLM, read natively from its Lightning checkpoint.

    model = ddrl.load_model("pretrained.ckpt")       # the released Lightning .ckpt (a file, not a directory)
    model.family                                      # "mdlm_dna"
    model.tokenizer.encode("ACGT")                    # [0, 1, 2, 3]; mask id 4
    model(ids).logits                                 # [B, L, 5], mask logit suppressed (MDLM's subs)

The checkpoint (ozekri/SEPO @ 4a4a40f GRPO_MDLM_DNA, made by main_gosai.py's Lightning run) holds
`state_dict` (the policy weights, `backbone.*`; grpo_train.py fine-tunes these, not `ema`), `ema`, and
`hyper_parameters.config`, a pickled Hydra DictConfig. It is read with torch.load(weights_only=True), with
omegaconf's classes mapped to inert stand-ins (read_checkpoint), so omegaconf is not needed; a checkpoint
that pickles more than that falls back to weights_only=False through omegaconf (trusted files only).
No code of the authors runs: ddrl.models.native.mdlm_dna builds the backbone from the config's
model section. The process is MDLM's absorbing one with the log-linear schedule (move chance (1 - 1e-3) t)
and the subs parameterisation (the mask is never predicted); sample with rollout.name=drakes.

save_pretrained writes ddrl's layout (config.json + model.safetensors + tokenizer.json), which
load_model reads back; export_lightning_checkpoint writes a .ckpt in the released layout.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from ddrl.models.diffusion_lm import DiffusionLM, make_process_spec
from ddrl.models.io import ModelDirectoryError, atomic_directory
from ddrl.models.native.mdlm_dna import MODEL_TYPE, MDLMDNABackbone, MDLMDNAConfig

FAMILY = "mdlm_dna"
BASES = "ACGT"
MASK_ID = 4
TOKENIZER_FILE = "tokenizer.json"
SCHEDULE = "loglinear"


class DNATokenizer:
    """A, C, G, T = 0..3 and the mask token "N" = 4 (dataloader_gosai.DNA_ALPHABET); no eos or bos."""

    mask_token_id = MASK_ID
    mask_token = "N"
    pad_token_id = MASK_ID  # only pads empty prompts (width 0): DNA rows are full length
    eos_token_id = None
    bos_token_id = None
    padding_side = "left"

    def __len__(self) -> int:
        return 5

    @property
    def vocab_size(self) -> int:
        return 5

    def get_vocab(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(BASES + self.mask_token)}

    def encode(self, text: str) -> list[int]:
        vocab = self.get_vocab()
        bad = [c for c in text if c.upper() not in vocab]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a base; DNA sequences are made of A, C, G, T (N = mask)")
        return [vocab[c.upper()] for c in text]

    def decode(self, ids: Iterable[int] | Tensor, skip_special_tokens: bool = True, **unused: Any) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        chars = BASES + self.mask_token
        return "".join(chars[int(i)] for i in ids if not (skip_special_tokens and int(i) == MASK_ID))

    def batch_decode(self, sequences: Iterable[Iterable[int]] | Tensor, skip_special_tokens: bool = True,
                     **unused: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def __call__(self, text: str | Sequence[str], padding: bool | str = False, return_tensors: str | None = None,
                 **unused: Any) -> dict[str, Any]:
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t) for t in texts]
        if len({len(x) for x in ids}) > 1:
            raise ValueError("DNA sequences of different lengths cannot be batched (no pad token)")
        masks = [[1] * len(x) for x in ids]
        if return_tensors == "pt":
            return {"input_ids": torch.tensor(ids, dtype=torch.long).reshape(len(ids), -1),
                    "attention_mask": torch.tensor(masks, dtype=torch.long).reshape(len(ids), -1)}
        return {"input_ids": ids[0] if isinstance(text, str) else ids,
                "attention_mask": masks[0] if isinstance(text, str) else masks}

    def save_pretrained(self, directory: str | Path) -> None:
        (Path(directory) / TOKENIZER_FILE).write_text(json.dumps({"type": "ddrl_dna", "bases": BASES,
                                                                  "mask": self.mask_token}) + "\n")

    def __repr__(self) -> str:
        return "DNATokenizer(A C G T, mask N = 4)"


class MDLMDNADiffusionLM(DiffusionLM):
    """DiffusionLM of the MDLM DNA CNN: unconditional (a prompt must be empty), mask id 4, subs."""

    def save_pretrained(self, directory: str | Path, *, state_dict: dict[str, Tensor] | None = None,
                        merge_adapter: bool = False) -> None:
        backbone_state = None
        if state_dict is not None:
            backbone_state = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        with atomic_directory(directory) as tmp:
            self.model.save_pretrained(tmp)
            if backbone_state is not None:
                from safetensors.torch import save_file

                save_file({k: v.detach().contiguous() for k, v in backbone_state.items()}, str(tmp / "model.safetensors"))
            self.tokenizer.save_pretrained(tmp)


def _wrap(backbone: MDLMDNABackbone) -> MDLMDNADiffusionLM:
    spec = make_process_spec("masked", mask_token_id=MASK_ID, schedule=SCHEDULE)
    return MDLMDNADiffusionLM(backbone, DNATokenizer(), mask_token_id=MASK_ID, vocab_size=5, process_spec=spec,
                              family=FAMILY, suppress_mask_logit=True)


def build_mdlm_dna(model_cfg: Any, generator_seed: int = 0) -> MDLMDNADiffusionLM:
    """A freshly initialised MDLM DNA model sized by a ddrl.config.ModelConfig with architecture=mdlm_dna, for
    `ddrl pretrain`: d_model -> hidden_dim, n_layers -> num_cnn_stacks, max_seq_len -> length. The family
    fixes the rest (DNA tokenizer, mask id 4, masked process with MDLM's loglinear schedule, subs), so the
    config must say so. The weights depend only on generator_seed (the global RNG is forked and restored)."""
    wanted = {"process": "masked", "schedule": SCHEDULE}
    for key, value in wanted.items():
        if getattr(model_cfg, key) != value:
            raise ValueError(f"model.architecture=mdlm_dna needs model.{key}={value} (MDLM's DNA model), "
                             f"got {getattr(model_cfg, key)!r}")
    config = MDLMDNAConfig(hidden_dim=model_cfg.d_model, num_cnn_stacks=model_cfg.n_layers,
                           length=model_cfg.max_seq_len, dropout=model_cfg.dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(generator_seed)
        backbone = MDLMDNABackbone(config)  # torch's default conv / linear init, as the released model's
    return _wrap(backbone)


def is_lightning_checkpoint(path: str | Path) -> bool:
    return Path(path).is_file() and Path(path).suffix == ".ckpt"


def is_mdlm_dna_dir(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == MODEL_TYPE


def config_from_hydra(cfg: Any, where: str) -> MDLMDNAConfig:
    """The released config (a DictConfig or dict) -> MDLMDNAConfig; what ddrl does not implement is an error."""
    get = (lambda node, key, default=None: node.get(key, default))  # noqa: E731  (DictConfig and dict alike)
    model = get(cfg, "model") or {}
    checks = {"backbone": (get(cfg, "backbone"), "cnn"), "parameterization": (get(cfg, "parameterization"), "subs"),
              "noise.type": (get(get(cfg, "noise") or {}, "type", SCHEDULE), SCHEDULE),
              "model.clean_data": (bool(get(model, "clean_data", False)), False),
              "model.cls_free_guidance": (bool(get(model, "cls_free_guidance", False)), False)}
    for key, (found, wanted) in checks.items():
        if found != wanted:
            raise ModelDirectoryError(f"{where}: {key}={found!r}; ddrl reads the MDLM DNA model with {key}={wanted!r}")
    return MDLMDNAConfig(hidden_dim=int(get(model, "hidden_dim", 128)), num_cnn_stacks=int(get(model, "num_cnn_stacks", 4)),
                         length=int(get(model, "length", 200)), dropout=float(get(model, "dropout", 0.0)),
                         time_conditioning=bool(get(cfg, "time_conditioning", False)))


class _PickledConfigNode:
    """An inert stand-in for omegaconf's pickled classes: it only keeps the state it is given."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


_OMEGACONF_CLASSES = ("dictconfig.DictConfig", "listconfig.ListConfig", "base.Metadata", "base.ContainerMetadata",
                      "nodes.AnyNode", "nodes.StringNode", "nodes.IntegerNode", "nodes.FloatNode", "nodes.BooleanNode",
                      "nodes.BytesNode", "nodes.PathNode", "nodes.EnumNode", "nodes.ValueNode")


def _plain(value: Any) -> Any:
    """Stand-in omegaconf nodes -> plain dicts, lists and values (interpolations stay "${...}" strings)."""
    if isinstance(value, _PickledConfigNode):
        state = value.__dict__.get("_state") or {}
        state = state[0] if isinstance(state, tuple) else state
        if "_content" in state:
            return _plain(state["_content"])
        return _plain(state.get("_val"))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _plain_dict(*unused: Any) -> dict:
    """collections.defaultdict(factory) read as a plain dict (omegaconf's flags cache)."""
    return {}


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """torch.load of a released .ckpt with weights_only=True: omegaconf's classes (hyper_parameters.config is
    a pickled DictConfig) are read into inert stand-ins, so neither omegaconf nor code from the file runs.
    A checkpoint that pickles anything else (e.g. a trainer's callback objects) is read with
    weights_only=False through omegaconf, when it is installed: load only checkpoints you trust."""
    import typing

    allowed: list[Any] = [(_PickledConfigNode, f"omegaconf.{name}") for name in _OMEGACONF_CLASSES]
    allowed += [(typing.Any, "typing.Any"), (_plain_dict, "collections.defaultdict"), torch.torch_version.TorchVersion]
    # omegaconf's metadata names element types (dict, list, int ...), pickled as protocol-2 "__builtin__" globals
    allowed += [(t, f"{module}.{name}") for module in ("__builtin__", "builtins")
                for name, t in (("dict", dict), ("list", list), ("int", int), ("long", int), ("str", str),
                                ("float", float), ("bool", bool), ("tuple", tuple)) if (module, name) != ("builtins", "long")]
    try:
        with torch.serialization.safe_globals(allowed):
            ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        try:
            import omegaconf
        except ImportError:
            raise ModelDirectoryError(f"{str(path)!r} pickles objects beyond omegaconf's config ({error}); pip install "
                                      f"omegaconf to read it with weights_only=False (trusted files only)") from None
        ckpt = torch.load(str(path), map_location="cpu", weights_only=False)  # trusted file (docstring)
        config = (ckpt.get("hyper_parameters") or {}).get("config")
        if isinstance(config, omegaconf.DictConfig):
            ckpt["hyper_parameters"]["config"] = omegaconf.OmegaConf.to_container(config, resolve=False)
        return ckpt
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if isinstance(hparams, dict):
        ckpt["hyper_parameters"] = _plain(hparams)
    return ckpt


def load_lightning_checkpoint(path: str | Path, *, device: torch.device | str | None = None,
                              dtype: torch.dtype | None = None, use_ema: bool = False) -> MDLMDNADiffusionLM:
    """A released MDLM DNA .ckpt -> DiffusionLM (module docstring). use_ema: take the EMA weights instead
    of `state_dict` (grpo_train.py uses state_dict)."""
    ckpt = read_checkpoint(path)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ModelDirectoryError(f"{str(path)!r} is not a Lightning checkpoint (no state_dict)")
    hparams = ckpt.get("hyper_parameters") or {}
    if "config" not in hparams:
        raise ModelDirectoryError(f"{str(path)!r} has no hyper_parameters.config: not an MDLM DNA checkpoint")
    config = config_from_hydra(hparams["config"], str(path))
    state = {k[len("backbone."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("backbone.")}
    backbone = MDLMDNABackbone(config)
    if use_ema:
        shadow = ckpt["ema"]["shadow_params"]  # ExponentialMovingAverage over backbone (then noise) parameters
        trainable = [n for n, p in backbone.named_parameters()]
        state.update({n: t for n, t in zip(trainable, shadow)})
    backbone.load_state_dict(state, strict=True)
    model = _wrap(backbone)
    return model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model


def load_dir(path: str | Path, *, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None) -> MDLMDNADiffusionLM:
    """A directory written by MDLMDNADiffusionLM.save_pretrained -> DiffusionLM."""
    from ddrl.models.io import read_safetensors

    raw = json.loads((Path(path) / "config.json").read_text())
    config = MDLMDNAConfig(**{f.name: raw[f.name] for f in fields(MDLMDNAConfig) if f.name in raw})
    backbone = MDLMDNABackbone(config)
    backbone.load_state_dict(read_safetensors(Path(path) / "model.safetensors"), strict=True)
    model = _wrap(backbone)
    return model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model


def export_lightning_checkpoint(model: MDLMDNADiffusionLM, path: str | Path, hydra_config: Any = None) -> None:
    """Write the model as a .ckpt in the released layout (state_dict backbone.*, hyper_parameters.config).
    hydra_config: the released config to store (a DictConfig or dict); default: a dict of ddrl's fields."""
    state = {f"backbone.{k}": v.detach().cpu() for k, v in model.model.state_dict().items()}
    config = hydra_config if hydra_config is not None else {
        "backbone": "cnn", "parameterization": "subs", "time_conditioning": model.model.config.time_conditioning,
        "noise": {"type": SCHEDULE}, "model": {k: v for k, v in asdict(model.model.config).items()
                                              if k in ("hidden_dim", "num_cnn_stacks", "length", "dropout")}}
    torch.save({"state_dict": state, "hyper_parameters": {"config": config}, "epoch": 0, "global_step": 0}, str(path))
