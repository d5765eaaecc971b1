"""The command line a user (and the benchmarks) rely on: eval --json, sample, methods."""

import json
import subprocess
import sys

from tests.integration.conftest import ROOT


def ddrl(*args):
    return subprocess.run([sys.executable, "-m", "ddrl", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_eval_json_prints_one_object(tiny_sudoku_model, tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = ddrl("eval", "--model", tiny_sudoku_model, "--task", "mini_sudoku", "--n", 6, "--json", "--output", out)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"task", "n", "accuracy", "mean_reward"} <= set(result) and result["n"] == 6
    assert 0.0 <= result["accuracy"] <= 1.0 and len(out.read_text().splitlines()) == 6
    lo, hi = result["accuracy_interval"]  # 95%, over Sudoku solution grids: never a point at n=6
    assert result["split"] == "test" and lo <= result["accuracy"] <= hi and hi - lo > 0.2
    assert result["interval"]["n"] == 6 and result["interval"]["method"] == "cluster_bootstrap_or_wilson"


def test_sample_fits_the_context_by_default(tiny_sudoku_model):
    proc = ddrl("sample", "--model", tiny_sudoku_model, "--prompt", "1.3..2.....4.1.2", "--n", 2)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all(set(line) <= set("1234.") for line in lines)


def test_sample_with_gen_length_sizes_steps_and_blocks(tiny_sudoku_model):
    proc = ddrl("sample", "--model", tiny_sudoku_model, "--prompt", "1.3..2.....4.1.2", "--gen-length", 16)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) <= 16


def test_methods_lists_every_objective_with_its_paper():
    proc = ddrl("methods", "--json")
    assert proc.returncode == 0, proc.stderr
    names = {o["name"]: o for o in json.loads(proc.stdout)["objectives"]}
    assert {"grpo", "espo", "spg", "stable_drl", "udm_grpo", "sepo", "gdsd", "maskgrpo", "dipod"} <= set(names)
    assert "arXiv" in names["stable_drl"]["paper"]


def test_prompt_longer_than_context_is_a_clear_error(tiny_sudoku_model):
    proc = ddrl("sample", "--model", tiny_sudoku_model, "--prompt", "1" * 60)
    assert proc.returncode == 2 and ("max_seq_len" in proc.stderr or "prompt" in proc.stderr), proc.stderr


def test_demo_runs_end_to_end_on_the_shipped_model(tmp_path):
    """`ddrl demo` in miniature: shipped model, one RL step, both held-out scores, table, curve."""
    proc = ddrl("demo", "--steps", 1, "--eval-n", 16, "--output-dir", tmp_path / "demo")
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.strip().startswith(("before RL", "after 1 steps"))]
    assert len(table) == 2 and all(line.count("%") == 2 for line in table), proc.stdout
    # the converged base: nearly every held-out puzzle solved with the 16-step reference sampler
    assert float(table[0].split()[-1].rstrip("%")) >= 90.0, proc.stdout
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 0
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["eval_before/accuracy"] <= 1.0  # logged with step 1
    assert rows[0]["eval/accuracy_lo"] <= rows[0]["eval/accuracy"] <= rows[0]["eval/accuracy_hi"]
    gain = [line for line in proc.stdout.splitlines() if "gain on the test split, same 16 examples" in line]
    assert len(gain) == 1 and "[" in gain[0] and "n=16" in gain[0], proc.stdout


def test_train_logs_what_lora_wraps_and_quiet_silences_it(tiny_sudoku_model, tmp_path):
    """The CLI configures logging: INFO lines (LoRA's wrapped layers) on stderr; --quiet keeps warnings only."""
    args = [ROOT / "configs/rl/grpo_mini_sudoku.yaml", f"model.path={tiny_sudoku_model}", "train.steps=1",
            "train.prompts_per_step=2", "train.group_size=2", "eval.n=0", "eval.before=false", "train.progress=false",
            "train.tensorboard=false", "model.lora.rank=2", "model.lora.alpha=4"]
    loud = ddrl("train", *args, f"output_dir={tmp_path / 'loud'}")
    assert loud.returncode == 0, loud.stderr
    assert "ddrl: LoRA wraps" in loud.stderr, loud.stderr
    quiet = ddrl("train", "--quiet", *args, f"output_dir={tmp_path / 'quiet'}")
    assert quiet.returncode == 0, quiet.stderr
    assert "LoRA wraps" not in quiet.stderr, quiet.stderr


def test_eval_names_sampler_settings_as_flags(tiny_sudoku_model):
    proc = ddrl("eval", "--model", tiny_sudoku_model, "--task", "mini_sudoku", "--n", 2, "--sampler", "block")
    assert proc.returncode == 2, proc.stderr
    assert "--sampler='block' does not fit" in proc.stderr and "rollout." not in proc.stderr, proc.stderr
    proc = ddrl("eval", "--model", tiny_sudoku_model, "--task", "mini_sudoku", "--n", 2, "--threshold", 2)
    assert proc.returncode == 2 and "--threshold must be in (0, 1]" in proc.stderr, proc.stderr


def test_demo_digits_runs_on_the_ursa_path(tmp_path):
    """`ddrl demo --task digits`: the shipped URSA pipeline, metric-path rollouts, pixel reward, one RL step."""
    proc = ddrl("demo", "--task", "digits", "--steps", 1, "--eval-n", 16, "--output-dir", tmp_path / "demo")
    assert proc.returncode == 0, proc.stderr
    assert "checkpoints/digits-ursa" in proc.stdout and "prompt following" in proc.stdout, proc.stdout
    assert "gain on the test split, same 16 examples" in proc.stdout, proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/mean" in r for r in rows), rows[:2]
    report = [json.loads(line) for line in (tmp_path / "demo" / "eval" / "report-step-1.jsonl").read_text().splitlines()]
    assert len(report) == 16 and all(len(r["completions"][0]) == 64 for r in report)  # gray-level strings
