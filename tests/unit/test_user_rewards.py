"""A user's reward, seen from ddrl: FunctionTask's constructor says an image task; a reward bug scores
None (invalid), never 0.0 or a perfect inf, and is logged once per kind; text_to_image and `ddrl
serve-reward` resolve module:function with one function (ddrl.rewards.catalog.build_image_reward)."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

from ddrl.tasks.user import FunctionTask

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]


@pytest.fixture
def lines():
    """The warning lines of ddrl.tasks.user (read on the logger itself: `ddrl` does not propagate once the
    command line set up its handler)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("ddrl.tasks.user")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def task(reward_fn, **kwargs):
    return FunctionTask("mine", reward_fn, ROWS, [{"prompt": "c", "answer": 3}], **kwargs)


# ---------------------------------------------------------------- the constructor says an image task
def test_the_constructor_takes_modality_and_image_grid():
    image = task(lambda c, **_: [1.0] * len(c), modality="image", image_grid=(4, 6))
    assert image.modality == "image" and image.image_grid == (4, 6) and image.gen_length == 24
    text = task(lambda c, **_: [1.0] * len(c))
    assert text.modality == "text" and text.image_grid is None and text.gen_length == 256


@pytest.mark.parametrize("kwargs,message", [
    ({"modality": "video"}, r"modality='video'; choose one of text, image"),
    ({"image_grid": (4, 4)}, r"image_grid=\(4, 4\) is for an image task; pass modality=\"image\""),
    ({"modality": "image"}, r"an image task needs image_grid=\(h, w\)"),
    ({"modality": "image", "image_grid": (4, 0)}, r"needs image_grid=\(h, w\).*got \(4, 0\)"),
    ({"modality": "image", "image_grid": (4, 4), "gen_length": 32}, r"gen_length=32 but image_grid 4x4 is 16 codes"),
])
def test_the_constructor_refuses_what_cannot_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        task(lambda c, **_: [1.0] * len(c), **kwargs)


# ---------------------------------------------------------------- a reward bug is visible
def broken(completions, **_):
    raise KeyError("answr")


@pytest.mark.parametrize("reward_fn,kind,example", [
    (broken, "raised", "raised KeyError: 'answr'"),
    (lambda c, **_: [1.0], "wrong_count", "returned 1 scores for 2 completions"),
    (lambda c, **_: 1.0, "wrong_count", "returned a float, not a list of 2 scores"),
    (lambda c, **_: ["good", "bad"], "not_a_number", "returned 'good' (str), not a number"),
    (lambda c, **_: [float("inf"), float("nan")], "not_finite", "returned inf, not a finite number"),
])
def test_a_failing_reward_scores_none_and_says_why_once(reward_fn, kind, example, lines):
    t = task(reward_fn)
    assert t.reward(["x", "y"], answer=[1, 2]) == [None, None]
    assert t.reward(["x", "y"], answer=[1, 2]) == [None, None]
    assert len(lines) == 1, lines  # once per kind, however many batches fail
    assert "task 'mine'" in lines[0] and example in lines[0] and f"({kind})" in lines[0], lines[0]
    assert t.failures.seen == {kind: 4}


def test_each_kind_is_logged_once_and_good_rows_keep_their_scores(lines):
    t = task(lambda c, **_: [0.5, "x", float("inf"), None, True])
    assert t.reward(["a"] * 5) == [0.5, None, None, None, 1.0]  # None is "not applicable", not a failure
    assert t.reward(["a"] * 5) == [0.5, None, None, None, 1.0]
    assert len(lines) == 2 and "not_a_number" in lines[0] and "not_finite" in lines[1]


def test_an_inf_reward_is_not_correct():
    t = task(lambda c, **_: [float("inf"), 1.0])
    assert t.correct(["x", "y"]) == [False, True]


def test_evaluation_does_not_count_an_invalid_reward_as_correct():
    """`ddrl eval` accuracy on a tiny model: an inf reward (acc=1.00 before) and a raising one score 0."""
    import ddrl

    model = ddrl.load_model(ROOT / "checkpoints/mini_sudoku-masked")
    rows = ddrl.tasks.get_task("mini_sudoku").test_examples(3)
    for reward_fn in (lambda c, **_: [float("inf")] * len(c), broken):
        t = FunctionTask("sudoku_bug", reward_fn, rows, rows, format="compact", gen_length=16)
        result = ddrl.evaluate(model, t, n=3, sampler={"steps": 2}, examples=rows)
        assert result["accuracy"] == 0.0, result


# ---------------------------------------------------------------- module:function, one resolver
USER_REWARDS = """
    def redness(completions, images=None, **_):
        return [0.5] * len(completions)

    def scaled(scale):
        return lambda completions, **_: [scale] * len(completions)

    def constant(value):
        return value

    not_callable = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_xyz.py").write_text(textwrap.dedent(USER_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("user_rewards_xyz", None)


def test_text_to_image_resolves_module_function_as_serve_reward_does(user_module, tmp_path):
    from ddrl.rewards.catalog import build_image_reward
    from ddrl.tasks import get_task

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    t2i = get_task("text_to_image", image_grid=[4, 4], reward="user_rewards_xyz:redness", path=str(prompts),
                   split="hash")
    assert t2i.reward(["", ""], images=None) == [0.5, 0.5]
    factory = get_task("text_to_image", image_grid=[4, 4], reward="user_rewards_xyz:scaled",
                       reward_args={"scale": 0.25}, path=str(prompts), split="hash")
    assert factory.reward([""]) == [0.25]
    assert build_image_reward("user_rewards_xyz:redness") is sys.modules["user_rewards_xyz"].redness


@pytest.mark.parametrize("spec,args,message", [
    ("no_such_module_xyz:f", {}, r"cannot import 'no_such_module_xyz'.*on PYTHONPATH \(PYTHONPATH=\. for"),
    ("user_rewards_xyz:missing", {}, r"module 'user_rewards_xyz' has no attribute 'missing'"),
    ("user_rewards_xyz:not_callable", {}, r"'user_rewards_xyz:not_callable' is of type int, not a function"),
    ("user_rewards_xyz:scaled", {"size": 2}, r"'user_rewards_xyz:scaled': bad arguments \{'size': 2\}"),
    ("user_rewards_xyz:redness", {"scale": 2}, r"missing 1 required .*; with arguments, module:function is a "
                                               r"factory that returns the reward"),
    ("user_rewards_xyz:constant", {"value": 2}, r"called with \{'value': 2\} returned an object of type int, not "
                                                r"a reward function"),
    ("user_rewards_xyz:", {}, r"not an import path"),
    ("redness", {}, r"reward 'redness' is not known; choose one of: pickscore, .*, or name your own function as "
                    r"module:function"),
])
def test_a_bad_reward_name_is_a_clear_error(spec, args, message, user_module, tmp_path):
    from ddrl.tasks import get_task

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    with pytest.raises(ValueError, match=message):
        get_task("text_to_image", image_grid=[4, 4], reward=spec, reward_args=args, path=str(prompts), split="hash")
    with pytest.raises(ValueError, match=message):  # and in a list part
        get_task("text_to_image", image_grid=[4, 4], reward=[{"name": spec, "args": args}], path=str(prompts),
                 split="hash")


def test_serve_reward_uses_the_same_resolver(user_module, capsys):
    from ddrl.cli import main

    assert main(["serve-reward", "--reward", "user_rewards_xyz:missing"]) == 2
    assert "--reward 'user_rewards_xyz:missing': module 'user_rewards_xyz' has no attribute" in capsys.readouterr().err
    assert main(["serve-reward", "--reward", "server"]) == 2
