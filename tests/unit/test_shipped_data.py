"""Data files shipped with ddrl (ddrl.tasks.data): GenEval's evaluation prompts, byte for byte as
MaskGRPO ships them, named `ddrl:geneval/evaluation_metadata.jsonl` in any file task's arguments."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from ddrl.tasks import get_task
from ddrl.tasks.data import ROOT, resolve_data_path, shipped_files

GENEVAL = "ddrl:geneval/evaluation_metadata.jsonl"


def _reward(completions, **columns):
    return [0.0] * len(completions)


def test_geneval_ships_its_553_prompts_with_provenance():
    assert shipped_files() == [GENEVAL]
    path = resolve_data_path(GENEVAL)
    data = open(path, "rb").read()
    # martian422/MaskGRPO @ b74ba3c dataset/GenEval/evaluation_metadata.jsonl (its README says so)
    assert hashlib.sha256(data).hexdigest() == "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13"
    rows = [json.loads(line) for line in data.decode().splitlines()]
    assert len(rows) == len({r["prompt"] for r in rows}) == 553
    assert Counter(r["tag"] for r in rows) == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94,
                                               "position": 100, "color_attr": 100}
    readme = (ROOT / "geneval" / "README.md").read_text()
    assert "b74ba3cb56c70b79f4cd7dfac7d8f0fd9a6876e7" in readme and "MIT" in readme


def test_a_file_task_reads_the_shipped_file_by_name(tmp_path):
    train = tmp_path / "train_metadata.jsonl"
    train.write_text("".join(json.dumps({"tag": "counting", "include": [{"class": "cat", "count": n}],
                                         "prompt": f"a photo of {n} cats {i}"}) + "\n"
                             for i in range(40) for n in (2,)))
    task = get_task("text_to_image", image_grid=[32, 32], reward=_reward, train_path=str(train), test_path=GENEVAL)
    test = task.all_test_examples()
    assert len(test) == 553 and test[0]["caption"] == test[0]["prompt"] == "a photo of a bench"
    assert test[0]["metadata"] == {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
    dev = task.dev_examples(100)  # dev is held out of the train prompts, never the shipped test file
    assert dev and all(ex["prompt"].startswith("a photo of 2 cats") for ex in dev)
    only_test = get_task("text_to_image", image_grid=[32, 32], reward=_reward, path=GENEVAL)  # `ddrl eval`
    assert len(only_test.all_test_examples()) == 553


def test_an_unknown_shipped_name_lists_the_shipped_files():
    for bad in ("ddrl:geneval/train_metadata.jsonl", "ddrl:../config.py", "ddrl:geneval/README.md"):
        with pytest.raises(ValueError, match=r"not a data file shipped with ddrl; shipped: ddrl:geneval/evaluation"):
            get_task("text_to_image", image_grid=[32, 32], reward=_reward, test_path=bad)
    assert resolve_data_path("/data/mine.jsonl") == "/data/mine.jsonl"
