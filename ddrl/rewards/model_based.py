"""Rewards computed by neural networks: a batched interface and two adapters.

`ModelReward` is an nn.Module whose forward is the reward contract,
`reward(completions, **columns) -> list[float | None]`: it scores completions in batches of
`batch_size` under torch.no_grad in eval mode (the module's train/eval state is restored after),
on the device of its parameters. A batch that fails is retried one completion at a time, and a
completion that still fails scores `on_error` (0.0), so a reward model never crashes a step.

Adapters:
- `HFSequenceClassifierReward`: a Hugging Face sequence-classification reward model (one logit:
  the score; several: the probability of `label`), fed prompt + completion as a text pair.
- `ClipStyleImageReward`: cosine similarity between an image embedding of the completion and a
  text embedding of a column (the prompt), as CLIP-score rewards do for text-to-image RL.
- `CLIPImageReward` (`pickscore_reward`, `clip_score_reward`): a transformers `CLIPModel` from a
  local directory scoring the decoded images of an image task (`images=[n, 3, H, W]` in [0, 1]) against
  the prompt: logit_scale * cos(image, text) / max_score, as UDM-GRPO's scorers do (PickScore
  max_score 26, CLIP score 100; diffnext/rewards/reward_image.py @ d1bec49).

Only ddrl/models/hf.py imports transformers at module level; the HF adapter imports it lazily, and
only when it is given a directory/hub name rather than built objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ddrl.rewards.composite import column_value


class ModelReward(nn.Module):
    """Base class: subclasses implement `score_batch(completions, columns) -> [b] scores`."""

    def __init__(self, batch_size: int = 32, on_error: float | None = 0.0):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.on_error = on_error

    @property
    def device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def score_batch(self, completions: list[str], columns: dict[str, list[Any]]) -> Tensor | list[float | None]:
        raise NotImplementedError

    def _score(self, completions: list[str], columns: dict[str, list[Any]]) -> list[float | None]:
        scores = self.score_batch(completions, columns)
        if isinstance(scores, Tensor):
            scores = scores.detach().float().cpu().reshape(-1).tolist()
        scores = list(scores)
        if len(scores) != len(completions):
            raise ValueError(f"score_batch returned {len(scores)} scores for {len(completions)} completions")
        return [None if s is None else float(s) for s in scores]

    def forward(self, completions: list[str], **columns: Any) -> list[float | None]:
        was_training = self.training
        self.eval()
        out: list[float | None] = []
        try:
            with torch.no_grad():
                for lo in range(0, len(completions), self.batch_size):
                    rows = range(lo, min(lo + self.batch_size, len(completions)))
                    batch = [completions[i] for i in rows]
                    cols = {k: [column_value(v, i) for i in rows] for k, v in columns.items()}
                    try:
                        out.extend(self._score(batch, cols))
                    except Exception:  # noqa: BLE001 - isolate the completion that breaks the batch
                        for j in range(len(rows)):
                            try:
                                out.extend(self._score([batch[j]], {k: [v[j]] for k, v in cols.items()}))
                            except Exception:  # noqa: BLE001
                                out.append(self.on_error)
        finally:
            self.train(was_training)
        return out


class HFSequenceClassifierReward(ModelReward):
    """A Hugging Face sequence-classification reward model.

    model: a local directory / hub name (loaded with transformers' Auto classes) or a built
    model, with `tokenizer` then required. With one output logit the reward is that logit; with
    several, the softmax probability of `label` (default: the last class, "positive" by convention).
    When the columns hold `prompt_column` (default "prompt"), prompt and completion are encoded as
    a text pair, as reward models are trained; `use_prompt=False` scores the completion alone.
    """

    def __init__(self, model: str | Path | nn.Module, tokenizer: Any = None, *, batch_size: int = 16,
                 max_length: int = 512, label: int | None = None, use_prompt: bool = True,
                 prompt_column: str = "prompt", on_error: float | None = 0.0, **from_pretrained: Any):
        super().__init__(batch_size=batch_size, on_error=on_error)
        if isinstance(model, (str, Path)):
            # Lazy import: ddrl's rule is that only ddrl/models/hf.py imports transformers at module level.
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
            model = AutoModelForSequenceClassification.from_pretrained(str(model), **from_pretrained)
        if tokenizer is None:
            raise ValueError("HFSequenceClassifierReward(model=<module>) needs tokenizer=")
        if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token  # decoder reward models often ship without a pad token
        self.model: Any = model  # a transformers classifier, called through its own API
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.label = label
        self.use_prompt = use_prompt
        self.prompt_column = prompt_column

    def score_batch(self, completions: list[str], columns: dict[str, list[Any]]) -> Tensor:
        prompts = columns.get(self.prompt_column) if self.use_prompt else None
        if prompts is not None and all(isinstance(p, str) for p in prompts):
            enc = self.tokenizer(prompts, completions, truncation=True, max_length=self.max_length,
                                 padding=True, return_tensors="pt")
        else:
            enc = self.tokenizer(completions, truncation=True, max_length=self.max_length,
                                 padding=True, return_tensors="pt")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        logits = self.model(**enc).logits.float()  # [b, C]
        if logits.shape[-1] == 1:
            return logits[:, 0]
        label = logits.shape[-1] - 1 if self.label is None else self.label
        return logits.softmax(-1)[:, label]


def _default_decode_image(text: str) -> Tensor | None:
    from ddrl.rewards.image import N_LEVELS, decode_image

    levels = decode_image(text)
    return None if levels is None else torch.tensor(levels, dtype=torch.float32).view(8, 8) / (N_LEVELS - 1)


class ClipStyleImageReward(ModelReward):
    """cos(image_encoder(image), text_encoder(text)) in [-1, 1].

    image_encoder: images [b, ...] float -> embeddings [b, D].
    text_encoder:  whatever `tokenize_text(texts)` returns (default: the list of strings) -> [b, D].
    decode_image:  completion -> image tensor, or None when malformed (scored `on_error`);
                   default: the digits task's 64 gray symbols -> [8, 8] in [0, 1].
    text_column:   the column whose text the image should match (default "prompt").
    """

    def __init__(self, image_encoder: nn.Module, text_encoder: nn.Module, *,
                 decode_image: Callable[[str], Tensor | None] = _default_decode_image,
                 tokenize_text: Callable[[list[str]], Any] | None = None, text_column: str = "prompt",
                 batch_size: int = 64, on_error: float | None = 0.0):
        super().__init__(batch_size=batch_size, on_error=on_error)
        self.image_encoder = image_encoder
        self.text_encoder = text_encoder
        self.decode_image = decode_image
        self.tokenize_text = tokenize_text
        self.text_column = text_column

    def score_batch(self, completions: list[str], columns: dict[str, list[Any]]) -> list[float | None]:
        texts = columns.get(self.text_column)
        if texts is None:
            raise ValueError(f"ClipStyleImageReward needs the {self.text_column!r} column")
        images = [self.decode_image(c) for c in completions]
        valid = [i for i, im in enumerate(images) if im is not None]
        out: list[float | None] = [self.on_error] * len(completions)
        if not valid:
            return out
        pixels = torch.stack([im for im in images if im is not None]).to(self.device)  # [v, ...] (the rows `valid`)
        words = [str(texts[i]) for i in valid]
        text_in = self.tokenize_text(words) if self.tokenize_text is not None else words
        if isinstance(text_in, Tensor):
            text_in = text_in.to(self.device)
        img = self.image_encoder(pixels)  # [v, D]
        txt = self.text_encoder(text_in)  # [v, D]
        sims = torch.nn.functional.cosine_similarity(img.float(), txt.float(), dim=-1)  # [v]
        for i, s in zip(valid, sims.tolist()):
            out[i] = s
        return out


class CLIPImageReward(ModelReward):
    """logit_scale * cos(image, prompt) / max_score from a transformers CLIPModel, for image tasks.

    model:      a local CLIP directory (config.json + weights + the processor's files: PickScore_v1,
                clip-vit-large-patch14, ...) or a built CLIPModel, with `processor` then required.
    max_score:  the divisor that puts the score near [0, 1]: 26 for PickScore, 100 for CLIP score.
    The images come from the `images` keyword (reward(completions, images=..., caption=...)), one per
    completion; text from `text_column` ("caption": the text-to-image task's prompt text; "prompt" when
    a direct call names it so). The processor resizes and normalises as the scorer was
    trained (its CLIPImageProcessor); text is cut to 77 tokens, as theirs.
    """

    def __init__(self, model: str | Path | nn.Module, processor: Any = None, *, max_score: float = 26.0,
                 text_column: str = "caption", batch_size: int = 8, on_error: float | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(batch_size=batch_size, on_error=on_error)
        if isinstance(model, (str, Path)):
            from transformers import CLIPModel, CLIPProcessor  # lazy: only models/hf.py imports it eagerly

            if not Path(model).is_dir():
                raise FileNotFoundError(f"CLIP reward model directory {model} does not exist; nothing is "
                                        f"downloaded: pass a local copy (e.g. of yuvalkirstain/PickScore_v1)")
            processor = processor or CLIPProcessor.from_pretrained(str(model))
            model = CLIPModel.from_pretrained(str(model), dtype=dtype or torch.float32)
        if processor is None:
            raise ValueError("CLIPImageReward(model=<module>) needs processor=")
        if not max_score > 0:
            raise ValueError(f"max_score must be > 0, got {max_score}")
        self.model: Any = model.eval()  # a transformers CLIP model (get_image_features, logit_scale, ...)
        self.processor = processor
        self.max_score = float(max_score)
        self.text_column = text_column

    def score_batch(self, completions: list[str], columns: dict[str, list[Any]]) -> Tensor:
        from ddrl.rewards.pixels import to_pil

        images = columns.get("images")
        texts = columns.get(self.text_column) or columns.get("prompt")  # a direct call may name it prompt
        if images is None or any(im is None for im in images):
            raise ValueError("CLIPImageReward scores images: call it on an image task (images=[n, 3, H, W])")
        if texts is None:
            raise ValueError(f"CLIPImageReward needs the {self.text_column!r} column")
        dtype = next(self.model.parameters()).dtype
        pixels = self.processor(images=to_pil(torch.stack(list(images))), return_tensors="pt")["pixel_values"]
        words = self.processor(text=[str(t) for t in texts], padding=True, truncation=True, max_length=77,
                               return_tensors="pt")
        image = self.model.get_image_features(pixel_values=pixels.to(self.device, dtype))  # [b, D]
        text = self.model.get_text_features(**{k: v.to(self.device) for k, v in words.items()})  # [b, D]
        image, text = (getattr(x, "pooler_output", x) for x in (image, text))  # transformers 5 may wrap them
        cos = torch.nn.functional.cosine_similarity(image.float(), text.float(), dim=-1)  # [b]
        return self.model.logit_scale.float().exp() * cos / self.max_score


def pickscore_reward(model: str | Path, **kwargs: Any) -> CLIPImageReward:
    """PickScore (Kirstain et al. 2023) from a local PickScore_v1 directory: logit_scale * cos / 26."""
    return CLIPImageReward(model, max_score=26.0, **kwargs)


def clip_score_reward(model: str | Path, **kwargs: Any) -> CLIPImageReward:
    """CLIP score from a local CLIP directory (e.g. clip-vit-large-patch14): logit_scale * cos / 100."""
    return CLIPImageReward(model, max_score=100.0, **kwargs)
