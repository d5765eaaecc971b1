"""The digits evaluation's per-class rate and diversity (DigitsTask.eval_breakdown, via evaluate).

Expected values are worked out by hand from images whose pixel differences are placed on purpose,
not computed by the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddrl.rewards.image import CLASS_SYMBOLS, encode_image
from ddrl.tasks import get_task
from ddrl.tasks.digits import MAX_DIVERSITY_IMAGES, class_breakdown, image_diversity

ROOT = Path(__file__).resolve().parents[2]


def flipped(pixels: list[int], level: int = 16) -> list[int]:
    """A blank image with `level` at the given pixel indices."""
    image = [0] * 64
    for i in pixels:
        image[i] = level
    return image


A = flipped([])  # blank
B = flipped([0, 1, 2, 3])  # 4 pixels from A
C = flipped([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])  # 10 from A, 14 from B


def test_image_diversity_of_hand_made_images():
    d = image_diversity(np.array([A, B, C]))
    assert d["distinct_frac"] == 1.0 and d["n_images"] == 3
    assert d["pairwise_hamming"] == pytest.approx((4 + 10 + 14) / 3)
    # a duplicate: pairs (A, A) = 0, (A, B) = 4 twice
    dup = image_diversity(np.array([A, A, B]))
    assert dup["distinct_frac"] == pytest.approx(2 / 3)
    assert dup["pairwise_hamming"] == pytest.approx(8 / 3)


def test_a_collapsed_class_reads_zero_diversity():
    d = image_diversity(np.array([B] * 5))
    assert d["distinct_frac"] == pytest.approx(1 / 5) and d["pairwise_hamming"] == 0.0


def test_image_diversity_counts_gray_level_changes_as_differences():
    # a pixel at another gray level differs as much as one switched on
    assert image_diversity(np.array([flipped([5], 3), flipped([5], 4)]))["pairwise_hamming"] == 1.0


def test_image_diversity_needs_two_images():
    with pytest.raises(ValueError, match="at least 2"):
        image_diversity(np.array([A]))


def test_class_breakdown_rates_min_class_and_diversity_summary():
    labels = [0, 0, 0, 0, 1, 1, 2, 2, 2, 2]
    hits = [True, True, True, False, False, False, True, False, True, False]
    images = {0: [A, B, C], 1: [B, B], 2: [A, A, A, A]}
    out = class_breakdown(hits, labels, images)
    assert {c: (v["rate"], v["n"]) for c, v in out["per_class"].items()} == {"0": (0.75, 4), "1": (0.0, 2),
                                                                               "2": (0.5, 4)}
    assert all(v["lo"] <= v["rate"] <= v["hi"] for v in out["per_class"].values())
    assert out["min_class"] == 1 and out["min_class_rate"] == 0.0
    assert out["diversity"]["1"] == {"distinct_frac": 0.5, "pairwise_hamming": 0.0, "n_images": 2}
    assert out["distinct_frac_mean"] == pytest.approx((1.0 + 0.5 + 0.25) / 3)
    assert out["distinct_frac_min"] == 0.25
    assert out["pairwise_hamming_mean"] == pytest.approx((28 / 3 + 0 + 0) / 3)
    assert out["pairwise_hamming_min"] == 0.0


def test_class_breakdown_caps_the_pairwise_work():
    many = [flipped([i % 64]) for i in range(MAX_DIVERSITY_IMAGES + 50)]
    out = class_breakdown([True] * len(many), [3] * len(many), {3: many})
    assert out["diversity"]["3"]["n_images"] == MAX_DIVERSITY_IMAGES


def rows_for(images: list[list[int] | str], correct: list[bool]) -> list[dict]:
    texts = [im if isinstance(im, str) else encode_image(im) for im in images]
    return [{"completions": [t], "correct": [c]} for t, c in zip(texts, correct)]


def test_task_hook_reads_rows_and_skips_malformed_images():
    task = get_task("digits")
    examples = [{"prompt": CLASS_SYMBOLS[y], "label": y} for y in (7, 7, 7, 7, 4, 4)]
    rows = rows_for([A, B, "not an image", C, A, A], [True, False, False, True, True, True])
    out = task.eval_breakdown(rows, examples)
    assert out["per_class"]["7"]["rate"] == 0.5 and out["per_class"]["7"]["n"] == 4
    assert out["per_class"]["4"]["rate"] == 1.0 and out["min_class"] == 7
    assert out["diversity"]["7"]["n_images"] == 3  # the malformed one is left out
    assert out["diversity"]["7"]["pairwise_hamming"] == pytest.approx(28 / 3)
    assert out["diversity"]["4"] == {"distinct_frac": 0.5, "pairwise_hamming": 0.0, "n_images": 2}


def test_task_hook_uses_every_sample_of_a_row_for_diversity_and_the_first_for_the_rate():
    task = get_task("digits")
    examples = [{"prompt": CLASS_SYMBOLS[2], "label": 2}] * 2
    rows = [{"completions": [encode_image(A), encode_image(B)], "correct": [True, False]},
            {"completions": [encode_image(C), encode_image(C)], "correct": [False, True]}]
    out = task.eval_breakdown(rows, examples)
    assert out["per_class"]["2"]["rate"] == 0.5
    assert out["diversity"]["2"]["n_images"] == 4
    # pairs: AB 4, AC 10, AC 10, BC 14, BC 14, CC 0
    assert out["diversity"]["2"]["pairwise_hamming"] == pytest.approx(52 / 6)


def test_task_hook_rejects_examples_without_labels():
    with pytest.raises(ValueError, match="label"):
        get_task("digits").eval_breakdown(rows_for([A], [True]), [{"prompt": "<c1>"}])


def test_evaluate_carries_the_breakdown(tmp_path):
    """evaluate() adds the task's breakdown; its per-class rates agree with the rows it wrote."""
    import ddrl
    from ddrl.eval import evaluate

    model = ddrl.load_model(ROOT / "checkpoints/digits-uniform")
    task = get_task("digits")
    path = tmp_path / "rows.jsonl"
    result = evaluate(model, task, n=20, split="dev", sampler={"steps": 2, "temperature": 1.0}, seed=3,
                      output_jsonl=path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    labels = [ex["label"] for ex in task.dev_examples(20, seed=3)]
    b = result["breakdown"]
    assert sorted(b["per_class"]) == [str(c) for c in range(10)] and sum(v["n"] for v in b["per_class"].values()) == 20
    for c in range(10):
        hits = [r["correct"][0] for r, y in zip(rows, labels) if y == c]
        assert b["per_class"][str(c)]["rate"] == pytest.approx(sum(hits) / len(hits))
    assert 0.0 <= b["distinct_frac_min"] <= b["distinct_frac_mean"] <= 1.0
    assert 0.0 <= b["pairwise_hamming_min"] <= b["pairwise_hamming_mean"] <= 64.0
    json.dumps(result)  # `ddrl eval --json` prints it


def test_evaluate_has_no_breakdown_for_a_task_without_the_hook():
    import ddrl
    from ddrl.eval import evaluate

    class Plain(type(get_task("digits"))):
        eval_breakdown = None  # the hook switched off

    model = ddrl.load_model(ROOT / "checkpoints/digits-uniform")
    result = evaluate(model, Plain(), n=4, split="dev", sampler={"steps": 2, "temperature": 1.0})
    assert "breakdown" not in result
