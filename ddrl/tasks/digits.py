"""digits: class-conditional 8x8 image generation (scikit-learn's digits, gray levels as tokens).

Prompt: one class symbol, "<c3>". Completion: 64 gray-level symbols "a" (0) .. "q" (16), row-major.
Reward: the held-out classifier's p(prompted class | image) (ddrl/rewards/image.py); a completion
is correct ("prompt following") when the classifier's argmax is the prompted class.

Held out here means the *images*: pretraining pairs come from the generator split only, and the
classifier that scores and measures is fit on the other half, which the generative model never
sees. Prompts are class labels, so train, dev and test prompts are the same ten symbols by nature;
dev_examples and test_examples give balanced sets (shuffled rounds of the ten classes) from
different seeds. What keeps a dev score from being a test score here is the sampling noise alone:
the evaluation must draw dev and test samples from different sampler seeds.
Uniform diffusion runs over the 17 gray symbols (`uniform_symbols`, a contiguous run after the
class symbols in `symbols()`).

`eval_breakdown` (read by ddrl.eval.evaluate) adds what prompt following alone hides: the rate of
each prompted class and the diversity of the images drawn for one class, so that a policy that
collapses to one template per class, or gives up on a class, shows in the same report.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from ddrl.registry import TASKS
from ddrl.rewards.composite import column_value
from ddrl.rewards.image import (CLASS_SYMBOLS, GRAY_SYMBOLS, N_CLASSES, N_LEVELS, N_PIXELS, as_label, decode_image,
                                digits_classifier_reward, digits_pixel_reward, digits_predicted_class, digits_splits,
                                encode_image, pixels_to_levels)
from ddrl.tasks import Task, check_format


MAX_DIVERSITY_IMAGES = 256  # per class: caps the pairwise distances at 256 * 255 / 2 pairs


def image_diversity(images: np.ndarray) -> dict[str, float]:
    """Distinct fraction and mean pairwise Hamming distance (pixels that differ, of 64) of images [m, 64].

    Distinct fraction alone misses near-templates (one pixel apart is "distinct"); the distance shows
    how far apart the samples really are. Needs m >= 2."""
    m = len(images)
    if m < 2:
        raise ValueError(f"diversity needs at least 2 images, got {m}")
    distances = (images[:, None, :] != images[None, :, :]).sum(-1)  # [m, m]
    upper = distances[np.triu_indices(m, k=1)]  # [m * (m - 1) / 2]
    return {"distinct_frac": len({tuple(row) for row in images.tolist()}) / m,
            "pairwise_hamming": float(upper.mean()), "n_images": m}


def class_breakdown(hits: list[bool], labels: list[int],
                    images_by_class: dict[int, list[list[int]]]) -> dict[str, Any]:
    """Per-class prompt following (rate, Wilson 95% interval, n), the weakest class, and per-class
    diversity with its mean and min over classes (classes with < 2 well-formed images are skipped)."""
    from ddrl.stats import rate_estimate

    per_class: dict[str, dict[str, float]] = {}
    for c in sorted(set(labels)):
        class_hits = [h for h, y in zip(hits, labels) if y == c]
        est = rate_estimate(sum(class_hits), len(class_hits))
        per_class[str(c)] = {"rate": est.mean, "lo": est.lo, "hi": est.hi, "n": est.n}
    weakest = min(per_class, key=lambda c: per_class[c]["rate"])
    diversity = {str(c): image_diversity(np.asarray(ims[:MAX_DIVERSITY_IMAGES]))  # [m, 64]
                 for c, ims in sorted(images_by_class.items()) if len(ims) >= 2}
    out: dict[str, Any] = {"per_class": per_class, "min_class": int(weakest),
                           "min_class_rate": per_class[weakest]["rate"], "diversity": diversity}
    if diversity:
        for key in ("distinct_frac", "pairwise_hamming"):
            values = [d[key] for d in diversity.values()]
            out[f"{key}_mean"], out[f"{key}_min"] = float(np.mean(values)), float(np.min(values))
    return out


def _balanced_labels(n: int, rng: random.Random) -> list[int]:
    """Labels in shuffled rounds of all ten classes: balanced, and a prefix of any longer draw."""
    labels: list[int] = []
    while len(labels) < n:
        round_ = list(range(N_CLASSES))
        rng.shuffle(round_)
        labels.extend(round_)
    return labels[:n]


@TASKS.register("digits")
class DigitsTask(Task):
    """Args: format ("compact" only)."""

    name = "digits"
    gen_length = N_PIXELS
    uniform_symbols: list[str] | None = list(GRAY_SYMBOLS)

    def __init__(self, format: str = "compact"):
        self.format = check_format(self.name, format, ("compact",))

    def _examples(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        return [{"prompt": CLASS_SYMBOLS[y], "label": y} for y in _balanced_labels(n, rng)]

    def train_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples(n, random.Random(f"digits-train-{seed}"))

    def dev_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples(n, random.Random(f"digits-dev-{seed}"))

    def test_examples(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return self._examples(n, random.Random(f"digits-test-{seed}"))

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        return digits_classifier_reward(completions, **columns)

    def correct(self, completions: list[str], **columns: Any) -> list[bool]:
        label = columns.get("label")
        predicted = digits_predicted_class(completions)
        return [p is not None and p == as_label(column_value(label, i)) for i, p in enumerate(predicted)]

    def eval_breakdown(self, rows: list[dict[str, Any]], examples: list[dict[str, Any]]) -> dict[str, Any]:
        """ddrl.eval.evaluate's rows -> per-class rate (first sample, as accuracy counts it) and
        diversity among all well-formed samples of each prompted class (class_breakdown)."""
        found = [as_label(ex.get("label")) for ex in examples]
        if any(y is None for y in found) or len(rows) != len(examples):
            raise ValueError("eval_breakdown needs one row per example and a label 0..9 on every example")
        labels = [y for y in found if y is not None]
        hits = [bool(row["correct"][0]) for row in rows]
        images: dict[int, list[list[int]]] = {}
        for row, y in zip(rows, labels):
            for text in row["completions"]:
                image = decode_image(text)
                if image is not None:
                    images.setdefault(y, []).append(image)
        return class_breakdown(hits, labels, images)

    def symbols(self) -> list[str]:
        return CLASS_SYMBOLS + GRAY_SYMBOLS

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """n (class symbol, image) pairs from the generator split, in seeded epochs over it."""
        images, labels = digits_splits()["generator"]
        rng = random.Random(f"digits-pretrain-{seed}")
        out: list[dict[str, str]] = []
        while len(out) < n:
            order = list(range(len(labels)))
            rng.shuffle(order)
            out.extend({"prompt": CLASS_SYMBOLS[int(labels[i])], "completion": encode_image(images[i])}
                       for i in order[: n - len(out)])
        return out


@TASKS.register("digits_image")
class DigitsImageTask(DigitsTask):
    """The digits task on UDM-GRPO's own system (docs/udm_digits_ursa.md): the completion is an 8x8 image of
    codes from the model's gray-level codebook (code k = gray level k: ddrl.models.ursa_init), decoded to
    pixels by the model's VQ decoder; reward and prompt following read the pixels (digits_pixel_reward).
    Same prompts, splits and eval_breakdown as digits: rows keep each image as its gray-level string
    (image_texts)."""

    name = "digits_image"
    modality = "image"
    image_grid = (8, 8)
    image_levels = N_LEVELS  # the codebook: one code per gray level
    uniform_symbols = None  # the images are codes of the model's codebook, not symbols

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        return digits_pixel_reward(completions, **columns)

    def correct(self, completions: list[str], **columns: Any) -> list[bool]:
        images = columns.pop("images", None)
        if images is None:
            raise ValueError("digits_image scores decoded pixels: correct() needs images=[n, 3, 8, 8]")
        return super().correct([encode_image(im) for im in pixels_to_levels(images)], **columns)

    def image_texts(self, images: Any) -> list[str]:
        """Pixels [n, 3, 8, 8] -> gray-level strings (what evaluation rows and eval_breakdown read)."""
        return [encode_image(im) for im in pixels_to_levels(images)]

    def symbols(self) -> list[str]:
        """The prompt words (the tokenizer of ddrl.models.ursa_init); images are codes, not symbols."""
        return list(CLASS_SYMBOLS)

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n (class symbol, codes) pairs: the digits pairs with each image as its 64 gray levels = codes."""
        return [{"prompt": p["prompt"], "codes": decode_image(p["completion"])}
                for p in super().pretrain_pairs(n, seed)]
