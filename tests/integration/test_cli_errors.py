"""What a new user meets on the command line (issue 32, part 4): bad input is one `ddrl: error:` line
naming the file or value and the fix, with rc != 0 and no traceback; README commands work as written;
no answer that only looks right (a blank sample, one greedy sample repeated, a 0.0 mean of no rewards).

Most cases run `ddrl.cli.main` in this process (an uncaught exception fails the test as a traceback
would); the working-directory import runs `python -P -m ddrl`, which starts sys.path as the `ddrl`
console script does, without the working directory.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddrl.cli import main
from tests.configs.test_paper_recipes import write_dna_files

ROOT = Path(__file__).resolve().parents[2]
SUDOKU = ROOT / "checkpoints/mini_sudoku-masked"
URSA = ROOT / "checkpoints/digits-ursa"
DNA_MODEL = ROOT / "tests/fixtures/sepo_dna/tiny_mdlm_dna.ckpt"  # max_seq_len 8, the data's length


def run(capsys, *argv) -> tuple[int, str, str]:
    """main(argv) -> (rc, stdout, stderr); argparse's own errors (SystemExit) count as a return code."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dna_eval(files: dict[str, str], *extra: str) -> list[str]:
    return ["eval", "--model", DNA_MODEL, "--task", "dna_enhancer", "--task-arg", f"path={files['path']}",
            "--task-arg", f"oracle={files['oracle']}", "--n", 4, *extra]


def write_rows(path: Path, rows: list[str]) -> str:
    path.write_text("seq,hepg2,k562,sknsh\n" + "".join(f"{r}\n" for r in rows))
    return str(path)


def damaged_copy(src: Path, dst: Path, weights: str, how: str) -> Path:
    shutil.copytree(src, dst)
    file = dst / weights
    if how == "truncated":  # a copy cut short: the header promises more bytes than are there
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        file.write_bytes(b"not a safetensors file at all" * 10)
    return dst


# --------------------------------------------------------------------------------------------
# Bad input: one line naming the problem and the fix, rc != 0
# --------------------------------------------------------------------------------------------


def _truncated_weights(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    model = damaged_copy(SUDOKU, tmp / "m", "model.safetensors", "truncated")
    return ["sample", "--model", model, "--prompt", "1.3..2.....4.1.2"], [str(model / "model.safetensors"), "damaged"]


def _garbage_weights(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    weights = "transformer/diffusion_pytorch_model.safetensors"
    model = damaged_copy(URSA, tmp / "u", weights, "garbage")
    return ["sample", "--model", model, "--prompt", "3", "--gen-length", 64], [str(model / weights), "damaged"]


def _non_utf8_data(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    bad = tmp / "latin1.csv"
    bad.write_bytes(Path(dna["path"]).read_bytes() + "ACGTACGT,caf\xe9,0,0\n".encode("latin-1"))
    return dna_eval({**dna, "path": str(bad)}), [str(bad), "not UTF-8", f"byte {bad.stat().st_size - 6}",
                                                 "line 42"]


def _row_of_another_length(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    data = write_rows(tmp / "short.csv", ["ACGTACGT,1,0,0", "ACGTACG,2,0,0", "GGGGCCCC,3,0,0"])
    return dna_eval({**dna, "path": data}), [data, "record 2 (line 3)", "7-bp", "8 bp"]


def _bad_number(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    data = write_rows(tmp / "nan.csv", ["ACGTACGT,1,0,0", "ACGTACGA,high,0,0"])
    return dna_eval({**dna, "path": data}), [data, "record 2 (line 3)", "'hepg2'", "'high'"]


def _oracle_of_another_length(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    oracle = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 16, 3))  # reads 16-bp sequences only
    torch.jit.trace(oracle, torch.zeros(1, 4, 16)).save(str(tmp / "oracle16.pt"))
    return dna_eval({**dna, "oracle": str(tmp / "oracle16.pt")}, "--temperature", 1), ["8-bp", "oracle16.pt"]


def _garbage_oracle(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    (tmp / "oracle.pt").write_bytes(b"\x00garbage" * 50)
    return dna_eval({**dna, "oracle": str(tmp / "oracle.pt")}), [str(tmp / "oracle.pt"), "oracle_kind='torchscript'"]


def _greedy_unconditional_eval(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    # every DNA prompt is "": greedy decoding gives one sequence 4 times (distinct = 1)
    return dna_eval(dna), ["share one prompt", "--temperature 1"]


def _too_long_for_the_model(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    return dna_eval(dna, "--temperature", 1, "--gen-length", 20), ["--gen-length=20", "max_seq_len=8", "at most 8"]


def _world_size_zero(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    return ["train", "--dry-run", ROOT / "configs/rl/grpo_mini_sudoku.yaml", "--world-size", 0], ["--world-size",
                                                                                                  "above 0"]


def _pickscore_without_model(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    return ["serve-reward", "--reward", "pickscore"], ["pickscore", "'model'", "--arg KEY=VALUE"]


def _port_in_use(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    return ["serve-reward", "--reward", "ddrl.rewards.pixels:to_uint8", "--port", "{busy}"], ["in use", "--port"]


def _reward_server_down(tmp: Path, dna: dict[str, str]) -> tuple[list, list[str]]:
    url = f"http://127.0.0.1:{closed_port()}"
    return (["eval", "--model", URSA, "--task", "text_to_image", "--task-arg", "image_grid=[8,8]",
             "--task-arg", "test_path=ddrl:geneval/evaluation_metadata.jsonl", "--task-arg", "reward=server",
             "--task-arg", f"reward_args={{url: {url}}}"], [url, "not reachable", "ddrl serve-reward"])


BAD_INPUTS = [_truncated_weights, _garbage_weights, _non_utf8_data, _row_of_another_length, _bad_number,
              _oracle_of_another_length, _garbage_oracle, _greedy_unconditional_eval, _too_long_for_the_model,
              _world_size_zero, _pickscore_without_model, _port_in_use, _reward_server_down]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.__name__.strip("_") for c in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_fix(case, tmp_path, capsys):
    argv, expected = case(tmp_path, write_dna_files(tmp_path))
    with socket.socket() as busy:  # a port another process holds
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [str(a).replace("{busy}", str(busy.getsockname()[1])) for a in argv]
        rc, out, err = run(capsys, *argv)
    lines = [line for line in err.splitlines() if "error" in line]
    assert rc not in (0, None) and "Traceback" not in err and len(lines) == 1, err
    assert all(text in lines[0] for text in expected), (expected, err)


# --------------------------------------------------------------------------------------------
# README commands, as written
# --------------------------------------------------------------------------------------------


def test_module_function_names_import_from_the_working_directory(tmp_path):
    """`ddrl serve-reward --reward my_rewards:redness` and `--task my_tasks:make` find my_rewards.py and
    my_tasks.py in the working directory without PYTHONPATH (shown by reaching the attribute lookup)."""
    (tmp_path / "my_rewards.py").write_text("def redness(completions, **_):\n    return [0.0] * len(completions)\n")
    (tmp_path / "my_tasks.py").write_text("def make(**_):\n    raise ValueError('my_tasks.make was called')\n")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # this checkout's ddrl
    for argv, expected in ((["serve-reward", "--reward", "my_rewards:nope"], "has no attribute 'nope'"),
                           (["eval", "--model", SUDOKU, "--task", "my_tasks:make"], "my_tasks.make was called")):
        # -P: sys.path without the working directory, as the `ddrl` console script starts
        proc = subprocess.run([sys.executable, "-P", "-m", "ddrl", *map(str, argv)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert expected in proc.stderr, proc.stderr


def test_a_quoted_task_arg_pair_is_read_as_the_option_and_its_yaml_value(capsys):
    """README: `"--task-arg reward_args={url: http://127.0.0.1:18085}"`, quoted whole. The mapping reaches
    the task: the client it builds reports the (closed) server, not argparse an unknown argument."""
    url = f"http://127.0.0.1:{closed_port()}"
    rc, _, err = run(capsys, "eval", "--model", URSA, "--task", "text_to_image", "--task-arg image_grid=[8,8]",
                     "--task-arg", "test_path=ddrl:geneval/evaluation_metadata.jsonl", "--task-arg reward=server",
                     f"--task-arg reward_args={{url: {url}}}")
    assert rc == 2 and f"reward server at {url} is not reachable" in err, err


def test_train_takes_resume_and_output_dir_flags(monkeypatch, tmp_path, capsys):
    """`ddrl train CONFIG --output-dir DIR --resume` = output_dir=DIR resume=true (flags win over overrides;
    key=value overrides may follow the flags)."""
    import ddrl.training.trainer as trainer
    from ddrl.config import load_config

    seen = {}

    def fake_train(config, overrides):
        seen["cfg"] = load_config(config, overrides)
        return tmp_path

    monkeypatch.setattr(trainer, "train", fake_train)
    out = tmp_path / "yes"  # a directory named like a YAML boolean stays a string
    rc, _, err = run(capsys, "train", ROOT / "configs/rl/grpo_mini_sudoku.yaml", "output_dir=elsewhere",
                     "--output-dir", out, "--resume", "train.steps=3")  # an override after the flags, as TRL's
    assert rc == 0, err
    assert seen["cfg"].output_dir == str(out) and seen["cfg"].resume is True and seen["cfg"].train.steps == 3


def test_a_config_finds_its_relative_paths_from_any_directory(monkeypatch, tmp_path):
    """`ddrl train /repo/configs/rl/x.yaml` from another directory: model.path checkpoints/... is found
    above the config file (as `ddrl demo` finds it); output_dir stays relative to the working directory."""
    from ddrl.config import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs/rl/stable_drl_mini_sudoku.yaml")
    assert Path(cfg.model.path) == SUDOKU
    assert not Path(cfg.output_dir).is_absolute()
    (tmp_path / "checkpoints/mini_sudoku-masked").mkdir(parents=True)  # one in the working directory wins
    assert load_config(ROOT / "configs/rl/stable_drl_mini_sudoku.yaml").model.path == "checkpoints/mini_sudoku-masked"


# --------------------------------------------------------------------------------------------
# No plausible wrong answers
# --------------------------------------------------------------------------------------------


def test_sample_of_an_image_model_writes_a_png_grid(tmp_path, capsys):
    from PIL import Image

    png = tmp_path / "digits.png"
    rc, out, err = run(capsys, "sample", "--model", URSA, "--prompt", "3", "--n", 3, "--gen-length", 64,
                       "--temperature", 1, "--output", png)
    assert rc == 0, err
    assert str(png) in out and not [line for line in out.splitlines() if not line.strip()], out
    with Image.open(png) as grid:
        assert grid.format == "PNG" and grid.width >= 3 * 8


def test_dna_eval_sizes_the_completion_from_the_data(tmp_path, capsys):
    """No --gen-length: the task's sequences (8 bp) size the completion, not a 200-bp default."""
    rc, out, err = run(capsys, *dna_eval(write_dna_files(tmp_path), "--temperature", 1, "--json"))
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["sampler"]["gen_length"] == 8 and result["valid_rewards"] == 4


@pytest.mark.parametrize("config", ["configs/rl/sepo_dna_motifs.yaml", "configs/rl/grpo_dna_motifs.yaml",
                                    "configs/paper/sepo/dna_enhancer.yaml"])
def test_shipped_dna_configs_evaluate_by_sampling(config):
    """The DNA task is unconditional: a greedy evaluation would be one sequence repeated."""
    from ddrl.config import load_config

    assert load_config(ROOT / config).eval.temperature == 1.0


def test_training_refuses_a_greedy_evaluation_of_an_unconditional_task_before_any_step(tmp_path):
    import ddrl

    files = write_dna_files(tmp_path)
    overrides = [f"model.path={DNA_MODEL}", "model.mixed_precision=none", "train.steps=2", "train.prompts_per_step=2",
                 "train.group_size=2", "train.tensorboard=false", "train.progress=false", "eval.n=4",
                 "eval.temperature=0", "eval.before=false", "dist.strategy=none", f"output_dir={tmp_path / 'run'}",
                 "rollout.gen_length=8", "rollout.steps=8", f"task.args.path={files['path']}",
                 f"task.args.oracle={files['oracle']}"]
    with pytest.raises(ValueError, match="share one prompt.*eval.temperature=1.0"):
        ddrl.train(str(ROOT / "configs/rl/sepo_dna_motifs.yaml"), overrides=overrides)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_reports_null_mean_reward_when_no_reward_is_valid():
    from ddrl.eval.runner import summarize

    rows = [{"rewards": [None, float("nan")], "correct": [False, False]},
            {"rewards": [None, None], "correct": [True, False]}]
    assert summarize(rows) == {"n": 2, "accuracy": 0.5, "mean_reward": None, "valid_rewards": 0}
    rows[0]["rewards"][0] = 0.25
    assert summarize(rows)["mean_reward"] == 0.25 and summarize(rows)["valid_rewards"] == 1


def test_a_prompt_file_that_is_not_utf8_names_its_byte(tmp_path):
    from ddrl.tasks.paper_data import read_records

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a red cube\n".encode() + "a caf\xe9 at night\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"prompts.txt' is not UTF-8 text: byte 16 \(line 2\) is 0xe9"):
        read_records(prompts)
