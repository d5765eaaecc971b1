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
"""

from __future__ import annotations

import random
from typing import Any

from ddrl.registry import TASKS
from ddrl.rewards.composite import column_value
from ddrl.rewards.image import (CLASS_SYMBOLS, GRAY_SYMBOLS, N_CLASSES, N_PIXELS, as_label,
                                digits_classifier_reward, digits_predicted_class, digits_splits, encode_image)
from ddrl.tasks import Task, check_format


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
    uniform_symbols = list(GRAY_SYMBOLS)

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
