"""Every paper recipe (configs/paper/**.yaml) starts: config, task on tiny files in its paper's data
format, a tiny checkpoint in the official layout, and one RL step with a finite loss.

The recipes name placeholder paths (/path/to/...); the test points them at files it writes in the
papers' formats (GSM8K jsonl, MATH rows, d1's Countdown jsonl and the hub's, d1's Sudoku CSV, MBPP
jsonl, GenEval's metadata jsonl and the PickScore / OCR .txt prompt lists) and at
tests/fixtures/{llada,dream,ursa}/model and tests/fixtures/llada2/model-2.0 (official layouts: hub folders, URSA's diffusers pipeline folder);
MMaDA-8B-Base and its MAGVIT-v2 directory become the tiny official-layout pair of tests/unit/test_mmada_t2i.py.
A data file shipped with ddrl (ddrl:geneval/...) is read as it is.
A text-to-image recipe's reward becomes a tiny random CLIP directory (pickscore), a reward server on
loopback (server) serving a fixed function of the image, or an OpenAI-compatible judge on loopback
(unifiedreward) that answers every image with one fixed score.

Only the size of the run is shrunk (steps, prompts, group, lengths, LoRA rank, fp32 on CPU); the
task, its arguments, the preset, the method, its objective/estimator arguments, LoRA target modules
and the loop options are the recipe's, so a recipe with a missing task argument, a wrong field, an
unknown preset or LoRA names that match nothing fails here.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from ddrl.config import RLConfig, load_config
from tests.tiny_clip import write_tiny_clip

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs/paper"
RECIPES = sorted(PAPER.rglob("*.yaml"))
MODELS = {"llada": ROOT / "tests/fixtures/llada/model", "dream": ROOT / "tests/fixtures/dream/model",
          "ursa": ROOT / "tests/fixtures/ursa/model", "dna": ROOT / "tests/fixtures/sepo_dna/tiny_mdlm_dna.ckpt",
          "llada2": ROOT / "tests/fixtures/llada2/model-2.0"}
FILE_TASKS = ("gsm8k", "math500", "countdown", "sudoku4x4", "mbpp", "text_to_image")  # read from train/test_path
FULL_FT = ("stable_drl", "coupled_grpo", "tracerl", "udm_grpo", "unigrpo")  # released as full fine-tuning


def _family(cfg: RLConfig, path: Path) -> str:
    """Which tiny checkpoint stands in for the recipe's model (by its placeholder path)."""
    name = Path(cfg.model.path or "").name.lower()
    if "mmada" in name:  # MMaDA with its MAGVIT-v2 decoder (model.vq_path): text-to-image
        return "mmada"
    if "llada2" in name:  # LLaDA2.0/2.1-mini: the official-format tiny MoE (tests/fixtures/make_llada2.py)
        return "llada2"
    if "llada" in name:
        return "llada"
    if "dream" in name or "diffucoder" in name:
        return "dream"
    if "ursa" in name:
        return "ursa"
    if "mdlm_dna" in name:  # SEPO's own DNA model: the tiny Lightning checkpoint its fixture script made
        return "dna"
    raise AssertionError(f"{path}: model.path {cfg.model.path!r} names no known family (LLaDA, Dream/DiffuCoder, "
                         f"URSA); add its tiny checkpoint to MODELS")


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _csv(path: Path, rows: list[tuple[str, str]]) -> str:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Puzzle", "Solution"])
        w.writerows(rows)
    return str(path)


def write_task_files(task: str, d: Path, suffix: str = "") -> tuple[str, str]:
    """(train file, test file) of a few rows in the format the papers ship for `task` (suffix: the
    placeholder's, where a task reads several formats)."""
    if task == "gsm8k":  # openai/gsm8k main
        q = [("Tom has 3 apples and buys 2 more. How many apples?", "3 + 2 = <<3+2=5>>5\n#### 5"),
             ("A box holds 4 pens. How many pens are in 3 boxes?", "4 * 3 = <<4*3=12>>12\n#### 12"),
             ("Sam ran 7 km on Monday and 5 km on Tuesday. How far in all?", "7 + 5 = 12\n#### 12"),
             ("There are 9 birds; 4 fly away. How many are left?", "9 - 4 = 5\n#### 5")]
        rows = [{"question": a, "answer": b} for a, b in q]
        return _jsonl(d / "gsm8k_train.jsonl", rows[:3]), _jsonl(d / "gsm8k_test.jsonl", rows[3:])
    if task == "math500":  # ankner/math-500 train (no answer field) / HuggingFaceH4/MATH-500 test
        train = [{"problem": "What is $2+3$?", "solution": "$2+3=\\boxed{5}$."},
                 {"problem": "Compute $\\frac{6}{3}$.", "solution": "It is $\\boxed{2}$."},
                 {"problem": "What is $4^2$?", "solution": "$4^2 = \\boxed{16}$."}]
        test = [{"problem": "What is $10-7$?", "solution": "$10-7=\\boxed{3}$.", "answer": "3",
                 "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"}]
        return _jsonl(d / "math_train.jsonl", train), _jsonl(d / "math500_test.jsonl", test)
    if task == "countdown":  # Countdown-Tasks-3to4 rows (train) / d1's countdown_cd3_test.jsonl (test)
        train = [{"target": 23, "nums": [30, 100, 93]}, {"target": 12, "nums": [3, 4, 1]},
                 {"target": 10, "nums": [2, 5, 1]}]
        test = [{"input": "30,100,93", "output": "23"}, {"input": "6,7,2", "output": "40"}]
        return _jsonl(d / "countdown_train.jsonl", train), _jsonl(d / "countdown_cd3_test.jsonl", test)
    if task == "sudoku4x4":  # d1's CSVs: Puzzle,Solution, 16-char strings, 0 = blank
        train = [("1034300221404300", "1234341221434321"), ("0204301020000320", "1234341221434321"),
                 ("4001010000400402", "4321213412433412")]
        test = [("0230001220030320", "1234341221434321")]
        return _csv(d / "4x4_sudoku_unique_puzzles.csv", train), _csv(d / "4x4_test_sudoku.csv", test)
    if task == "mbpp":  # the original mbpp.jsonl rows
        rows = [{"task_id": 601 + i, "text": f"Write a function add{i}(a, b) that returns a + b + {i}.",
                 "code": f"def add{i}(a, b):\n    return a + b + {i}",
                 "test_list": [f"assert add{i}(1, 2) == {3 + i}"], "test_setup_code": "", "challenge_test_list": []}
                for i in range(3)]
        test = [{"task_id": 11, "text": "Write a function double(x) that returns 2 * x.",
                 "code": "def double(x):\n    return 2 * x", "test_list": ["assert double(2) == 4"],
                 "test_setup_code": "", "challenge_test_list": []}]
        return _jsonl(d / "mbpp_train.jsonl", rows), _jsonl(d / "mbpp_test.jsonl", test)
    if task == "text_to_image":  # GenEval's metadata jsonl, or a prompt list (PickScore, OCR), by the suffix
        rows = [{"tag": "counting", "include": [{"class": "cat", "count": n}],
                 "exclude": [{"class": "cat", "count": n + 1}], "prompt": f"a photo of {word} cats"}
                for n, word in ((2, "two"), (3, "three"), (4, "four"))]
        if suffix == ".jsonl":
            return _jsonl(d / "train_metadata.jsonl", rows[:2]), _jsonl(d / "test_metadata.jsonl", rows[2:])
        (d / "train.txt").write_text("".join(r["prompt"] + "\n" for r in rows[:2]))
        (d / "test.txt").write_text(rows[2]["prompt"] + "\n")
        return str(d / "train.txt"), str(d / "test.txt")
    raise AssertionError(f"no tiny files for task {task!r}")


def write_dna_files(d: Path, n: int = 40, length: int = 8) -> dict[str, str]:
    """gosai_all.csv's columns (seq, hepg2, k562, sknsh) and a TorchScript oracle [n, 4, L] -> [n, 3]."""
    import random

    import torch

    rng = random.Random(0)
    with (d / "gosai.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seq", "hepg2", "k562", "sknsh"])
        for _ in range(n):
            s = "".join(rng.choice("ACGT") for _ in range(length))
            w.writerow([s, s.count("G"), s.count("A"), s.count("T")])
    weights = torch.tensor([[0.0, 0.5, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    oracle = torch.nn.Conv1d(4, 3, kernel_size=1, bias=False)
    oracle.weight.data = weights[..., None]
    torch.jit.trace(torch.nn.Sequential(oracle, torch.nn.AdaptiveAvgPool1d(1)), torch.zeros(1, 4, length)).save(
        str(d / "oracle.pt"))
    return {"path": str(d / "gosai.csv"), "oracle": str(d / "oracle.pt")}


def _model_dir(family: str, tmp_path: Path) -> Path:
    """The tiny checkpoint of `family`. The Dream fixture's config allows 128 positions, fewer than a
    paper prompt's tokens; a copy with a longer max_position_embeddings (RoPE: any length) holds them.
    MMaDA: the tiny official-layout MMaDA whose tokenizer is shorter than its text rows."""
    if family == "mmada":
        from tests.unit.test_mmada_t2i import write_tiny_mmada

        return write_tiny_mmada(tmp_path / "mmada")
    if family != "dream":
        return MODELS[family]
    out = tmp_path / "dream-model"
    shutil.copytree(MODELS["dream"], out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _shrink(cfg: RLConfig, family: str, tmp_path: Path) -> list[str]:
    """Overrides that keep the recipe's method, task and options but make the run tiny."""
    t = cfg.train
    out = [f"model.path={_model_dir(family, tmp_path)}", "model.dtype=float32", "model.mixed_precision=none",
           "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=null",
           f"train.minibatches={min(t.minibatches, 2)}", f"train.num_iterations={min(t.num_iterations, 2)}",
           "train.tensorboard=false", "train.progress=false", "train.save_every=0",
           "eval.n=0", "eval.before=false", "eval.every=0", "dist.strategy=none", "dist.cpu_offload=false",
           f"output_dir={tmp_path / 'run'}"]  # one CPU process (dist.cpu_offload is FSDP2's: ESPO-LLaDA2)
    if cfg.model.lora.rank > 0:
        out += ["model.lora.rank=4", "model.lora.alpha=8"]
    if family == "ursa":  # the tiny pipeline's 4 x 4 latent grid (8 x 8 pixels); 2 of the recipe's 10 steps
        out += ["rollout.gen_length=16", "rollout.steps=2", "task.args.image_grid=[4,4]"]
    elif family == "mmada":  # 2 x 2 codes through the tiny MAGVIT-v2 (32 x 32 pixels); 2 of the recipe's 12 steps
        from tests.unit.test_mmada_t2i import write_magvit

        assert str(cfg.model.vq_path or "").startswith("/path/to/"), "model.vq_path names the MAGVIT-v2 directory"
        out += [f"model.vq_path={write_magvit(tmp_path / 'magvit')}", "rollout.gen_length=4", "rollout.steps=2",
                "task.args.image_grid=[2,2]"]
    elif family == "dna":
        out += ["rollout.gen_length=8", "rollout.steps=8"]  # the tiny checkpoint's length
    else:
        out += ["rollout.gen_length=8", "rollout.steps=8"]
        if family == "llada2":  # a block model decodes its own blocks (the fixture's 32, as the real one's)
            out.append("rollout.block_length=null")
        elif cfg.rollout.name in ("auto", "masked", "block"):
            out.append("rollout.block_length=8")
    if "block_length" in cfg.method.estimator_args and family != "llada2":
        out.append("method.estimator_args.block_length=8")  # SPG's per-block masks: one block of 8
    if t.group_filter is not None:  # 8 tokens never reach a stop token: every answer would count as cut off
        out.append("train.truncated_reward=null")
    if cfg.task.name == "dna_enhancer":  # a gosai-format CSV and a traced oracle in gReLU's layout
        out += [f"task.args.{k}={v}" for k, v in write_dna_files(tmp_path).items()]
        out += ["task.args.oracle_kind=torchscript", "task.args.atac_oracle=null"]
    if cfg.task.name in FILE_TASKS:
        for key in ("train_path", "test_path"):
            value = cfg.task.args.get(key)
            assert isinstance(value, str) and value.startswith(("/path/to/", "ddrl:")), (
                f"task.args.{key} must name the paper's file as a /path/to/... placeholder (or a file shipped "
                f"with ddrl, ddrl:NAME), got {value!r}")
        files = dict(zip(("train_path", "test_path"),
                         write_task_files(cfg.task.name, tmp_path, Path(cfg.task.args["train_path"]).suffix)))
        out += [f"task.args.{key}={file}" for key, file in files.items()
                if not cfg.task.args[key].startswith("ddrl:")]  # a shipped file is read as it is
    return out


def brightness(completions, images=None, **columns):
    """The served stand-in for GenEval / OCR: a fixed function of the decoded image."""
    return images.mean(dim=(1, 2, 3)).tolist()


def serve_judge() -> Any:
    """An OpenAI-compatible chat endpoint on loopback that scores every image 3 of 5 (UnifiedReward's stand-in)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Judge(BaseHTTPRequestHandler):
        def _send(self, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802  (the start-up check: GET /v1/models)
            self._send({"object": "list", "data": [{"id": "UnifiedReward-7b-v1.5"}]})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send({"choices": [{"message": {"role": "assistant", "content": "Final Score: 3"}}]})

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def image_reward(tmp_path):
    """Overrides that point a text-to-image recipe's reward at tiny components: pickscore -> a tiny random
    CLIP directory (checked to be a placeholder path), server -> a reward server on loopback."""
    from ddrl.rewards.server import serve_reward

    servers = []

    def overrides(cfg: RLConfig) -> list[str]:
        reward, args = cfg.task.args.get("reward"), cfg.task.args.get("reward_args") or {}
        if reward == "pickscore":
            assert str(args.get("model", "")).startswith("/path/to/"), "reward_args.model names the checkpoint"
            return [f"task.args.reward_args.model={write_tiny_clip(tmp_path / 'clip')}"]
        if reward == "server":
            assert args.get("url"), "reward_args.url names the server"
            servers.append(serve_reward(brightness, background=True))
            return [f"task.args.reward_args.url={servers[-1].url}"]
        if reward == "unifiedreward":
            assert str(args.get("url", "")).endswith("/v1"), "reward_args.url names the judge's endpoint"
            servers.append(serve_judge())
            return [f"task.args.reward_args.url=http://127.0.0.1:{servers[-1].server_address[1]}/v1"]
        raise AssertionError(f"no tiny stand-in for the text_to_image reward {reward!r}")

    yield overrides
    for server in servers:
        server.shutdown()
        server.server_close()


def _recipe_id(p: Path) -> str:
    return str(p.relative_to(PAPER))


def test_every_method_has_its_main_recipe():
    mains = {p.stem for p in PAPER.glob("*.yaml")}
    assert len(mains) == 16, sorted(mains)
    for sub in (p for p in PAPER.iterdir() if p.is_dir()):
        assert any(m.startswith(sub.name + "_") for m in mains), f"configs/paper/{sub.name}/ has no main recipe"


def test_full_attention_recipes_keep_the_exact_sampler_and_say_why():
    """No cache is exact on a bidirectional model; Fast-dLLM's caches change the samples the loss is
    computed for (bench/RESULTS.md), so a main recipe on LLaDA samples without one and its header says why."""
    for path in sorted(PAPER.glob("*_llada8b.yaml")):
        cfg = load_config(path, cls=RLConfig)
        if cfg.rollout.name != "masked":
            continue
        assert cfg.rollout.cache == "none" and cfg.rollout.threshold is None, path
        assert "# Rollout: cache none, chosen from bench/RESULTS.md" in path.read_text(), path


def test_dream_recipes_state_the_filters_their_rollouts_ran_with():
    """DiffuCoder's coupled_grpo.py and GDSD's TLC trainer call diffusion_generate with top_p 0.95 and no
    top_k, which then came from transformers 4.x's legacy generation default, 50 (tests/fixtures/dream
    pins that behaviour of their code); ddrl's Dream sampler defaults to no top-k, so the recipes say it."""
    dream = [p for p in RECIPES if load_config(p, cls=RLConfig).rollout.name == "dream"]
    assert {_recipe_id(p) for p in dream} == {"coupled_grpo_llada8b.yaml", "gdsd_tlc/countdown.yaml"}
    for path in dream:
        rollout = load_config(path, cls=RLConfig).rollout
        assert (rollout.top_k, rollout.top_p) == (50, 0.95), f"{path}: top_k / top_p as the peer's rollout ran"


@pytest.mark.parametrize("path", RECIPES, ids=_recipe_id)
def test_recipe_states_its_units_and_precision(path):
    """The header converts the paper's optimizer steps to ddrl's rollouts; precision follows the rules."""
    text = path.read_text()
    header = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    assert "optimizer step" in header, f"{path}: the header must state the paper's optimizer steps and the conversion"
    cfg = load_config(path, cls=RLConfig)
    if path.parent != PAPER:  # per-task recipes inherit the method's main recipe
        assert re.search(rf"^base: \.\./{path.parent.name}_\w+\.yaml$", text, re.M), (
            f"{path}: a per-task recipe starts with base: ../{path.parent.name}_<model>.yaml")
    if cfg.model.lora.rank == 0:
        assert (cfg.model.dtype, cfg.model.mixed_precision, cfg.dist.strategy) == ("float32", "bf16", "fsdp"), (
            f"{path}: full fine-tuning keeps fp32 master weights with bf16 compute under FSDP")
    else:
        assert cfg.model.dtype == "bfloat16", f"{path}: LoRA recipes keep a bf16 base"
    method = path.stem.rsplit("_", 1)[0] if path.parent == PAPER else path.parent.name
    if method in FULL_FT:
        assert cfg.model.lora.rank == 0, f"{path}: {method} was released as full fine-tuning"
    t = cfg.train
    assert t.prompts_per_step % t.minibatches == 0


@pytest.mark.parametrize("path", RECIPES, ids=_recipe_id)
def test_recipe_starts_on_tiny_files_and_checkpoint(path, tmp_path, image_reward):
    from ddrl.training.trainer import Trainer

    cfg = load_config(path, cls=RLConfig)
    family = _family(cfg, path)
    extra = image_reward(cfg) if cfg.task.name == "text_to_image" else []
    small = load_config(path, _shrink(cfg, family, tmp_path) + extra, RLConfig)
    trainer = Trainer(small)
    assert trainer.task.name == cfg.task.name
    preset = cfg.task.args.get("preset")
    if preset is not None:
        assert trainer.task.preset is not None and trainer.task.preset.paper == preset
    if cfg.model.lora.rank > 0:  # every target name adapts a layer of the real family's backbone
        adapted = {n.rsplit(".", 1)[-1] for n, m in trainer.model.model.named_modules() if hasattr(m, "lora_A")}
        assert adapted == set(cfg.model.lora.target_modules), (
            f"{path}: LoRA adapted {sorted(adapted)}, the recipe names {sorted(cfg.model.lora.target_modules)}")
    if small.train.group_filter is not None:
        # The tiny model's answers all score 0, so the filter would drop every group and skip the
        # update: the task's reward still runs, then each group gets one right and one wrong answer.
        task_reward = trainer.task.reward

        def one_right_one_wrong(completions, **columns):
            task_reward(completions, **columns)
            return [float(i % 2) for i in range(len(completions))]

        trainer.task.reward = one_right_one_wrong
    metrics = trainer.train_step(1)
    assert metrics.get("update/skipped") != 1.0, metrics
    assert "loss/total" in metrics and math.isfinite(metrics["loss/total"]), metrics
    assert metrics["optimizer_steps"] == small.train.num_iterations * small.train.minibatches


def _uneven_on_8(path: Path) -> bool:
    cfg = load_config(path, cls=RLConfig)
    return cfg.dist.strategy != "none" and cfg.train.prompts_per_step % 8 != 0


@pytest.mark.parametrize("path", [p for p in RECIPES if _uneven_on_8(p)], ids=_recipe_id)
def test_a_multi_gpu_recipe_that_cannot_run_on_8_names_the_process_counts_that_work(path, monkeypatch):
    """Each process holds whole prompt groups, so prompts_per_step must divide over the processes
    (ddrl.training.distributed.check_whole_groups). A recipe whose batch does not split over an 8-GPU
    node says in its header which counts work, and `ddrl train` on 8 stops at start-up naming them,
    before the data or the model is read (the placeholder paths are never opened)."""
    from ddrl.training import trainer as trainer_mod
    from ddrl.training.distributed import DistInfo

    cfg = load_config(path, cls=RLConfig)
    n = cfg.train.prompts_per_step
    counts = [w for w in range(1, n + 1) if n % w == 0]
    named = ", ".join(map(str, counts[:-1])) + f" or {counts[-1]}"
    assert f"# Processes: run on {named}" in path.read_text(), f"{path}: the header must name the counts {counts}"
    monkeypatch.setattr(trainer_mod, "init_distributed", lambda *a, **k: DistInfo(rank=0, world_size=8))
    with pytest.raises(ValueError, match=rf"cannot be split over 8 processes.*Run on {named} processes"):
        trainer_mod.Trainer(cfg)
