"""Which family a checkpoint directory holds, and what ddrl must know about each family.

The family is read from config.json (model_type, architectures, auto_map; a ddrl save also
records it in its "ddrl" section). Its facts decide how ddrl.models.hf builds the backbone and
the DiffusionLM around it:

| family          | backbone                      | mask id            | logits       | process | also              |
| ---             | ---                           | ---                | ---          | ---     | ---               |
| llada           | native (native/llada.py)      | 126336             | aligned      | masked  | LLaDA, LLaDA-1.5  |
| mmada           | native (LLaDA backbone)       | 126336             | aligned      | masked  | image codebook    |
| dream           | native (native/dream.py)      | 151666             | shifted by 1 | masked  | DiffuCoder        |
| sdar            | native (native/sdar.py)       | config / tokenizer | aligned      | block   | TraDo; block size |
| llada2          | native (native/llada2.py)     | tokenizer          | aligned      | block   | LLaDA2.0/2.1 MoE; block 32 |
| diffusion_gemma | transformers' own class       | config / tokenizer | aligned      | uniform | "canvas" feed     |
| ursa            | native (native/ursa.py)       | (pad id)           | shifted by 1 | metric_path | pipeline folder, VQ decoder |
| generic         | transformers (+ remote code)  | config / tokenizer | aligned      | masked  | "native" feed     |
| mdlm_dna        | ddrl.models.mdlm_dna (DNA CNN) | 4                 | aligned      | masked  | DRAKES / SEPO; `drakes` sampler |

**Samplers.** `FamilyFacts.samplers` names the samplers that decode the family as trained, its own
first (DiffusionLM.samplers; rollout.name=auto picks the first); a family that names none decodes
with its process's (ddrl.contract.PROCESS_SAMPLERS).

(The mask id of config.json, when it names one, comes before the family's. URSA is a diffusers
pipeline folder with no top-level config.json: ddrl.models.ursa reads it, not ddrl.models.hf.)

**Native families** (llada, mmada, dream, sdar) are built by ddrl's own model code from the
official directory (config.json + safetensors with the authors' weight names) and never run code
from it, whatever trust_remote_code says. Their tokenizer is read without remote code too
(ddrl.models.hf_tokenizer). Their model vocabularies are padded past the tokenizer (Dream: 151,936
ids for a ~151,665-token tokenizer), so sampling is kept inside the tokenizer's ids
(`tokenizer_vocab_only`: logits_range = (0, len(tokenizer))); MMaDA's image generation sets
logits_range to its image codebook instead.

**Block size** (SDAR/TraDo): `checkpoint_block_size` is the rule, the one ddrl.models.native.sdar
reads too: config.json "block_size" (every released SDAR/TraDo names 4), else the one a ddrl save
recorded in its "ddrl" section, else the one asked for (model.block_size); a block family with
none of them is an error before any weights are read. LLaDA2 (whose config.json names none) has a
default: generation_config.json "block_length", else 32, the block_length of its generate().

**MMaDA images.** MMaDA's image tokens are an 8192-entry VQ codebook placed right after the text
tokenizer: code c is token len(tokenizer) + c (126349 + c for MMaDA-8B, whose tokenizer has 126,349
tokens), `image_token_range(config, len(tokenizer))`. That is the authors' rule everywhere in their
text-to-image path (Gen-Verse/MMaDA @ 3cdb870 models/modeling_mmada.py t2i_generate, with
num_new_special_tokens hard-coded 0; training/train_mmada_stage4.py; MaskGRPO's trainer hard-codes
126349). It is not config.json's llm_vocab_size (126464: the text rows of the embedding, padded past
the tokenizer), so the first 115 codes share ids with those padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddrl.models.diffusion_lm import check_requested_block_size


@dataclass(frozen=True)
class FamilyFacts:
    mask_token_id: int | None = None  # the family's mask id; None = config.json / tokenizer
    logits_shifted: bool = False  # position i predicts token i + 1 (AR-initialised: Dream)
    attention: str = "native"  # how a mask reaches the backbone: a name in ddrl.models.feeds.FEEDS
    process: str = "masked"  # masked | block | uniform | metric_path
    image_codebook: bool = False  # MMaDA: image tokens at a vocabulary offset
    native: bool = False  # built by ddrl's own model code (ddrl.models.native.NATIVE_FAMILIES)
    native_module: str | None = None  # ddrl.models.native.<module> registers the family's class
    tokenizer_vocab_only: bool = False  # sample only ids < len(tokenizer) (the model's vocabulary is padded)
    default_block_size: int | None = None  # a block family whose config.json names none (LLaDA2: 32)
    # The samplers that decode the family as trained, its own first (rollout.name=auto picks it); None =
    # its process's (ddrl.contract.PROCESS_SAMPLERS). DiffusionModel.samplers reads them.
    samplers: tuple[str, ...] | None = None
    editing_samplers: tuple[str, ...] | None = None  # a checkpoint that edits tokens (LLaDA2.1: token_editing)


FAMILIES: dict[str, FamilyFacts] = {
    "llada": FamilyFacts(mask_token_id=126336, native=True, native_module="llada", tokenizer_vocab_only=True),
    "mmada": FamilyFacts(mask_token_id=126336, image_codebook=True, native=True, native_module="llada",
                         tokenizer_vocab_only=True),
    # Dream also decodes with its own diffusion_generate, which its peers' recipes name (rollout.name=dream).
    "dream": FamilyFacts(mask_token_id=151666, logits_shifted=True, native=True, native_module="dream",
                         tokenizer_vocab_only=True, samplers=("masked", "dream", "emerge")),
    "sdar": FamilyFacts(process="block", native=True, native_module="sdar", tokenizer_vocab_only=True),
    # LLaDA2.0: threshold block decoding; 2.1 (token editing): its own sampler (ddrl.sampling.llada2).
    "llada2": FamilyFacts(process="block", native=True, native_module="llada2", tokenizer_vocab_only=True,
                          default_block_size=32, samplers=("block", "llada2_edit"),
                          editing_samplers=("llada2_edit", "block")),
    # DiffusionGemma denoises one canvas (its own sampler; ddrl's uniform sampler records a trajectory).
    "diffusion_gemma": FamilyFacts(attention="canvas", process="uniform", samplers=("diffusion_gemma", "uniform")),
    "ursa": FamilyFacts(logits_shifted=True, process="metric_path", image_codebook=True, native=True,
                        native_module="ursa"),
    "generic": FamilyFacts(),
    # DRAKES / SEPO's unconditional DNA model (read by ddrl.models.mdlm_dna, never through ddrl.models.hf):
    # MDLM's DDPM steps with soft final steps.
    "mdlm_dna": FamilyFacts(samplers=("drakes",)),
}

# Substrings of model_type / architectures / auto_map that name a family, tried in this order
# (MMaDA and LLaDA2 before LLaDA: their classes mention it). TraDo models are SDAR models.
_FAMILY_NAMES = (("mmada", "mmada"), ("llada2", "llada2"), ("llada", "llada"), ("dream", "dream"), ("sdar", "sdar"), ("trado", "sdar"),
                 ("diffusion_gemma", "diffusion_gemma"), ("diffusiongemma", "diffusion_gemma"))

# MMaDA-8B's codebook size when its config.json does not spell it out.
_MMADA_CODEBOOK = 8192


def detect_family(config: dict[str, Any]) -> str:
    """config.json dict -> a key of FAMILIES ("generic" when nothing matches)."""
    names = [str(config.get("model_type", ""))] + [str(a) for a in config.get("architectures") or []]
    names += [str(v) for v in (config.get("auto_map") or {}).values()]
    text = " ".join(names).lower()
    for needle, family in _FAMILY_NAMES:
        if needle in text:
            return family
    model_type = str(config.get("model_type", ""))
    return model_type if model_type in FAMILIES else "generic"


def family_facts(family: str) -> FamilyFacts:
    return FAMILIES.get(family, FAMILIES["generic"])


def checkpoint_block_size(config: dict[str, Any], facts: FamilyFacts, requested: int | None = None,
                          where: str = "the checkpoint", generation: dict[str, Any] | None = None) -> int | None:
    """The block length the checkpoint was trained with (None = full attention); module docstring.
    generation: the directory's generation_config.json, for a family with a default_block_size.

    A requested block size that contradicts the checkpoint's is an error (before any compute)."""
    stored = config.get("block_size") or (config.get("ddrl") or {}).get("block_size")
    if facts.process != "block":
        stored = None
    elif stored is None and facts.default_block_size:
        stored = (generation or {}).get("block_length") or facts.default_block_size
    elif stored is None:
        if requested is None:
            raise ValueError(f"{where} is a block diffusion model, but its config.json names no block_size; set "
                             f"model.block_size to the block size it was trained with (4 for the released SDAR/TraDo)")
        return int(requested)
    check_requested_block_size(requested, stored, where)
    return None if stored is None else int(stored)


def image_token_range(config: dict[str, Any], tokenizer_length: int) -> tuple[int, int]:
    """MMaDA's image codebook as (first id, end id) of the full vocabulary: (len(tokenizer),
    len(tokenizer) + codebook_size) (module docstring). A codebook that would end past the model's
    vocabulary (config.json vocab_size) is an error naming both."""
    first = int(tokenizer_length)
    end = first + int(config.get("codebook_size", _MMADA_CODEBOOK))
    vocab = config.get("vocab_size")
    if vocab is not None and end > int(vocab):
        raise ValueError(f"MMaDA's image codes start after the tokenizer ({first} tokens) and end at id {end}, past the "
                         f"model's vocab_size={vocab}; the tokenizer is not this checkpoint's own")
    return first, end


def remote_code_files(config: dict[str, Any]) -> list[str]:
    """The .py files that config.json's auto_map would run ("modeling_x.Cls" -> modeling_x.py)."""
    files: list[str] = []
    for value in (config.get("auto_map") or {}).values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if not ref:
                continue
            module = str(ref).split("--")[-1].rsplit(".", 1)[0]  # "repo--modeling_x.Cls" names a hub repo
            name = module.replace(".", "/") + ".py"
            if name not in files:
                files.append(name)
    return files
