"""Image rewards for the digits task: a held-out classifier's p(prompted class | image).

The setting of UDM-GRPO (uniform discrete diffusion RL for class-conditional generation): the
reward is a classifier's probability of the class the image was prompted with, and "prompt
following" is the fraction of images classified as their prompted class.

Data: scikit-learn's 8x8 digits (1,797 images, gray levels 0..16, bundled, no download). A fixed,
stratified 50/50 split gives the *generator* split (the only images a generative model may see)
and the *classifier* split; the classifier split is again split 80/20 into fit and held-out parts.
The classifier is a multinomial logistic regression on the fit part (deterministic lbfgs);
`digits_classifier_accuracy()` measures it on the held-out part. Logistic regression rather than
an MLP: about as accurate here (96% vs 97% held-out) and much less confident on noise (mean max-p
0.52 vs 0.92 on uniform-noise images), which makes the reward harder to hack.

An image is written as 64 single-character gray symbols, "a" (level 0) .. "q" (level 16), row-major.
On the URSA path (task digits_image) the reward reads decoded pixels instead (`images=` [n, 3, 8, 8] in
[0, 1]): the gray level of a pixel is round(16 x its channel mean) (`pixels_to_levels`), then the same
classifier.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ddrl.rewards.composite import column_value

N_LEVELS = 17  # gray levels 0..16
N_PIXELS = 64  # 8x8
N_CLASSES = 10
GRAY_SYMBOLS = [chr(ord("a") + level) for level in range(N_LEVELS)]
CLASS_SYMBOLS = [f"<c{d}>" for d in range(N_CLASSES)]
SPLIT_SEED = 0
_LEVEL_OF = {s: i for i, s in enumerate(GRAY_SYMBOLS)}


def encode_image(pixels: Any) -> str:
    """64 gray levels (0..16) -> a 64-character string."""
    flat = [int(v) for v in np.asarray(pixels).reshape(-1)]
    if len(flat) != N_PIXELS or not all(0 <= v < N_LEVELS for v in flat):
        raise ValueError(f"expected {N_PIXELS} gray levels in 0..{N_LEVELS - 1}")
    return "".join(GRAY_SYMBOLS[v] for v in flat)


def decode_image(text: str) -> list[int] | None:
    """A 64-character gray-symbol string -> 64 gray levels; None if malformed (length, characters)."""
    if not isinstance(text, str) or len(text) != N_PIXELS:
        return None
    levels = [_LEVEL_OF.get(ch) for ch in text]
    return None if any(v is None for v in levels) else levels  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def digits_splits() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"generator", "classifier_fit", "classifier_heldout"} -> (images [N, 64] int, labels [N] int)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images, labels = data.data.astype(np.int64), data.target.astype(np.int64)
    index = np.arange(len(labels))
    gen, clf = train_test_split(index, test_size=0.5, random_state=SPLIT_SEED, stratify=labels)
    fit, held = train_test_split(clf, test_size=0.2, random_state=SPLIT_SEED, stratify=labels[clf])
    return {name: (images[np.sort(ix)], labels[np.sort(ix)])
            for name, ix in (("generator", gen), ("classifier_fit", fit), ("classifier_heldout", held))}


@functools.lru_cache(maxsize=1)
def digits_classifier() -> Any:
    """The reward's classifier (fitted once per process, deterministically)."""
    from sklearn.linear_model import LogisticRegression

    images, labels = digits_splits()["classifier_fit"]
    clf = LogisticRegression(C=1.0, max_iter=2000)
    clf.fit(images / (N_LEVELS - 1), labels)
    return clf


def digits_classifier_accuracy() -> float:
    """Accuracy of the reward classifier on its held-out images (never used to fit it)."""
    images, labels = digits_splits()["classifier_heldout"]
    return float((digits_classifier().predict(images / (N_LEVELS - 1)) == labels).mean())


def digits_class_probabilities(completions: list[str]) -> list[np.ndarray | None]:
    """p(class | image) [10] for each well-formed completion; None for malformed ones."""
    images = [decode_image(c) for c in completions]
    valid = [i for i, im in enumerate(images) if im is not None]
    out: list[np.ndarray | None] = [None] * len(completions)
    if valid:
        x = np.asarray([images[i] for i in valid], dtype=np.float64) / (N_LEVELS - 1)
        for i, p in zip(valid, digits_classifier().predict_proba(x)):
            out[i] = p
    return out


def pixels_to_levels(images: Any) -> np.ndarray:
    """Pixels [n, C, 8, 8] in [0, 1] (a tensor or array) -> gray levels [n, 64] int: round(16 x channel mean)."""
    x = np.asarray(images.detach().cpu().float() if hasattr(images, "detach") else images, dtype=np.float64)
    if x.ndim != 4 or x.shape[2] * x.shape[3] != N_PIXELS:
        raise ValueError(f"expected images [n, C, 8, 8], got shape {list(x.shape)}")
    levels = np.rint(x.mean(axis=1).reshape(len(x), N_PIXELS) * (N_LEVELS - 1))
    return np.clip(levels, 0, N_LEVELS - 1).astype(np.int64)


def digits_pixel_reward(completions: list[str], images: Any = None, label: Any = None,
                        **_: Any) -> list[float | None]:
    """p(prompted class | decoded pixels) from the held-out classifier (pixels_to_levels, then as
    digits_classifier_reward); None without a label."""
    if images is None:
        raise ValueError("digits_pixel_reward scores decoded pixels: it needs images=[n, 3, 8, 8] (an image task)")
    return digits_classifier_reward([encode_image(im) for im in pixels_to_levels(images)], label=label)


def as_label(value: Any) -> int | None:
    """A class label 0..9 from a column value, or None."""
    try:
        label = int(value)
    except (TypeError, ValueError):
        return None
    return label if 0 <= label < N_CLASSES else None


def digits_classifier_reward(completions: list[str], label: Any = None, **_: Any) -> list[float | None]:
    """p(prompted class | image) from the held-out classifier; 0.0 for malformed images, None without a label."""
    try:
        probs = digits_class_probabilities(completions)
    except Exception:  # noqa: BLE001 - a reward never raises
        return [0.0] * len(completions)
    out: list[float | None] = []
    for i, p in enumerate(probs):
        y = as_label(column_value(label, i))
        out.append(None if y is None else (0.0 if p is None else float(p[y])))
    return out


def digits_predicted_class(completions: list[str]) -> list[int | None]:
    """The classifier's argmax class per completion; None for malformed ones."""
    try:
        return [None if p is None else int(np.argmax(p)) for p in digits_class_probabilities(completions)]
    except Exception:  # noqa: BLE001
        return [None] * len(completions)


def prompt_following(completions: list[str], label: Any) -> float:
    """Fraction of images classified as their prompted class (malformed images count as misses)."""
    if not completions:
        return 0.0
    predicted = digits_predicted_class(completions)
    hits = sum(p is not None and p == as_label(column_value(label, i)) for i, p in enumerate(predicted))
    return hits / len(completions)
