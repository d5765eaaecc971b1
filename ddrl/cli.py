"""The `ddrl` command line.

    ddrl pretrain CONFIG [key=value ...]      train a denoiser (masked / uniform / block) on task data
    ddrl train CONFIG [key=value ...] [--output-dir DIR] [--resume]   RL fine-tuning; writes a run directory
    ddrl train --dry-run CONFIG [key=value ...] [--world-size N]   per-rank GPU memory plan, no weights read
    ddrl eval --model DIR --task NAME [--n N] [--split test] [--json] [sampler overrides]
    ddrl eval --model DIR --task NAME --protocol d1 [--json]   a paper's evaluation (ddrl.eval.protocols)
    ddrl sample --model DIR --prompt TEXT [--output PNG] [sampler overrides]   (an image model writes a PNG grid)
    ddrl demo                                  the main job on the CPU
    ddrl methods                               every registered objective/estimator with its paper
    ddrl compare                               every method on the same tiny task and budget
    ddrl serve-reward --reward MODULE:FUNCTION  a reward function as an HTTP server (JSON + PNG)

Bad input ends with one line `ddrl: error: ...` naming the problem and the fix (exit code 2): a
ValueError, KeyError or OSError (a missing or unreadable file, a port in use) or a reward server that
is not reachable, raised anywhere below a command, is printed that way (_user_errors).
`module:function` names (--task, --reward, task.name=...) import from the working directory too, as
`python -m` does (searched after the installed modules).
Log lines (which layers LoRA wraps, steps that made no update, ...) go to stderr as `ddrl: ...`:
INFO and above on rank 0, warnings only with --quiet and on the other ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable

EPILOG = "Configs live in configs/ (pretrain/, rl/, paper/). Any config key can be overridden as key=value."


def _sampler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampler overrides (default: greedy, sized to the task)")
    g.add_argument("--sampler", dest="name",
                   help="auto (the model's own; default) | masked | block | emerge | maskgit | uniform | dream | "
                        "diffusion_gemma | llada2_edit | metric_path | drakes")
    g.add_argument("--steps", type=int, help="model calls in total")
    g.add_argument("--gen-length", dest="gen_length", type=int, help="completion tokens")
    g.add_argument("--block-length", dest="block_length", type=int, help="semi-autoregressive block length")
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--cfg-scale", dest="cfg_scale", type=float, help="classifier-free guidance weight")
    g.add_argument("--remasking", help="low_confidence | random | sdar_dynamic (SDAR's rule, with --threshold)")
    g.add_argument("--threshold", type=float, help="confidence-threshold parallel decoding")
    g.add_argument("--cache", help="KV cache: none | prefix | dual | auto")
    g.add_argument("--alg", help="dream sampler: origin | entropy | maskgit_plus | topk_margin")
    g.add_argument("--alg-temp", dest="alg_temp", type=float, help="dream sampler: temperature of the commit order")
    g.add_argument("--top-p", dest="top_p", type=float, help="nucleus filter (dream, sdar_dynamic)")
    g.add_argument("--top-k", dest="top_k", type=int, help="top-k filter (dream, sdar_dynamic)")
    g.add_argument("--batch-rows", dest="batch_rows", type=int,
                   help="rows per sampler call (default: all at once; 1 bounds the memory of image rollouts)")
    g.add_argument("--rng", help="emerge's random-number layout: ddrl (default) | released (MaskGRPO's image "
                                  "rollouts: a seed gives the authors' tokens)")
    g.add_argument("--max-prompt-length", dest="max_prompt_length", type=int,
                   help="keep the last N tokens of a longer prompt, as TRL and d1 do (default: a prompt "
                        "too long for the model is an error)")


_SAMPLER_KEYS = ("name", "steps", "gen_length", "block_length", "temperature", "cfg_scale", "remasking",
                 "threshold", "cache", "alg", "alg_temp", "top_p", "top_k", "max_prompt_length", "batch_rows", "rng")


def _model_args(p: argparse.ArgumentParser, help: str) -> None:
    """--model and how it loads (load_model's keywords), the same for eval and sample."""
    p.add_argument("--model", required=True, help=help)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the modeling code a Hugging Face directory ships (never needed for LLaDA, MMaDA, "
                        "Dream, SDAR/TraDo or DiffusionGemma)")
    p.add_argument("--vq-path", dest="vq_path", default=None,
                   help="image decoder directory: MMaDA's MAGVIT-v2 (the MMaDA then generates images), or an "
                        "URSA pipeline's AutoencoderVQ other than its vae/")
    p.add_argument("--t2i-attend-padding", dest="t2i_attend_padding", action="store_true", default=None,
                   help="text-to-image MMaDA: attend the [iPAD] prompt padding, as MaskGRPO's released rows do")


def _load(args: argparse.Namespace) -> Any:
    from ddrl.models import load_model

    return load_model(args.model, trust_remote_code=args.trust_remote_code, vq_path=args.vq_path,
                      t2i_attend_padding=args.t2i_attend_padding)


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand that also takes -q/--quiet after its name (`ddrl train --quiet CONFIG`)."""
    p = sub.add_parser(name, **kwargs)
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="log warnings only (no INFO lines)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddrl", description="RL fine-tuning of discrete diffusion models "
                                     "(masked, block and uniform) with every published method.", epilog=EPILOG)
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only (no INFO lines)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _command(sub, "pretrain", help="train a denoiser on task data", epilog=EPILOG,
                       description="Train a masked / uniform / block denoiser on prompt/completion pairs.")
    p.add_argument("config", help="YAML config (e.g. configs/pretrain/mini_sudoku_masked.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100")

    p = _command(sub, "train", help="RL fine-tuning; writes a run directory", epilog=EPILOG,
                       description="RL fine-tuning. `objective=NAME` switches the method (see `ddrl methods`).")
    p.add_argument("config", help="YAML config (e.g. configs/rl/stable_drl_mini_sudoku.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=20 objective=espo")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print the per-rank GPU memory estimate and exit (no weights read; ddrl.training.memory)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in the run directory (= resume=true)")
    p.add_argument("--output-dir", dest="output_dir", default=None, help="the run directory (= output_dir=DIR)")
    p.add_argument("--rehearse", action="store_true",
                   help="run one step of the recipe at its real size on fake tensors as rank 0 of --world-size "
                        "ranks: measured memory, host syncs, roofline time (ddrl.training.rehearse)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --rehearse: that many layers at full width (a quick, reduced rehearsal)")
    p.add_argument("--extrapolate", action="store_true",
                   help="with --rehearse: rehearse 4 and 6 layers and extrapolate to the full depth (a full-depth "
                        "rehearsal's figures, for the cost of 10 layers)")
    p.add_argument("--world-size", dest="world_size", type=_positive(int), default=1,
                   help="with --dry-run or --rehearse: number of GPUs")
    p.add_argument("--gpu-memory", dest="gpu_memory", type=_positive(float), default=80.0,
                   help="with --dry-run: GB per GPU to compare against (80: A100/H100; 141: H200)")

    p = _command(sub, "eval", help="evaluate a model on a task",
                       description="Accuracy (pass@1), pass@k and mean reward on a task's held-out split.")
    _model_args(p, "model directory (built-in or Hugging Face)")
    p.add_argument("--task", required=True, help="task name (see ddrl.tasks) or module:factory")
    p.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="task constructor argument")
    p.add_argument("--protocol", default=None,
                   help="a paper's evaluation protocol (d1): its generation lengths, block, steps, prompt, parsers, "
                        "metric and whole test set; --gen-length picks one of its lengths")
    p.add_argument("--n", type=int, default=None,
                   help="examples to evaluate (default 200; with --protocol the whole test set)")
    p.add_argument("--k", type=int, default=1, help="samples per example for pass@k (default 1)")
    p.add_argument("--split", default="test", choices=["test", "dev", "train"],
                   help="which split (default test, the sealed one for reported numbers; dev for choices)")
    p.add_argument("--seed", type=int, default=0, help="example and sampling seed")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts per sampler call (default 64; with --protocol the paper's)")
    p.add_argument("--output", help="write per-example results to this JSONL file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _sampler_args(p)

    p = _command(sub, "sample", help="sample completions for a prompt")
    _model_args(p, "model directory")
    p.add_argument("--prompt", required=True, help="prompt text (in the model's format)")
    p.add_argument("--n", type=int, default=1, help="number of samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--output", default="sample.png",
                   help="an image model's samples go to this PNG grid (default sample.png); text is printed")
    _sampler_args(p)

    p = _command(sub, "demo", help="the main job: RL on a tiny model on the CPU, before/after table",
                       description="Measure the shipped tiny model, fine-tune it with RL, measure again.")
    p.add_argument("--method", default=None, help="objective (default stable_drl; udm_grpo for --task digits)")
    p.add_argument("--task", default="mini_sudoku", choices=["mini_sudoku", "digits"], help="demo task")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default from the demo config)")
    p.add_argument("--output-dir", default=None, help="run directory (default runs/demo-<task>-<method>)")
    p.add_argument("--eval-n", type=int, default=None, help="examples per evaluation, dev and sealed test (default from the demo config)")

    p = _command(sub, "methods", help="list objectives and estimators with their papers")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = _command(sub, "compare", help="run every method on the same tiny task and budget")
    p.add_argument("--methods", default=None, help="comma-separated objectives (default: all text methods)")
    p.add_argument("--steps", type=int, default=30, help="RL steps per method")
    p.add_argument("--output-dir", default="runs/compare", help="where runs, table and picture go")
    p.add_argument("--config", default="configs/rl/compare_mini_sudoku.yaml", help="base config")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds, the same for every method")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")

    p = _command(sub, "serve-reward", help="serve a reward function over HTTP (JSON + PNG)", epilog=EPILOG,
                 description="Run a reward function as a server that RewardServerClient(url) calls: "
                             "GET /health, POST /score (ddrl/rewards/server.py).")
    p.add_argument("--reward", required=True,
                   help="pickscore | clip_score (--arg model=DIR) | hpsv2 (--arg checkpoint=FILE) | hpsv3 "
                        "(--arg checkpoint=FILE) | unifiedreward (--arg url=http://.../v1) | module:function, a "
                        "reward function or, with --arg, a factory that returns one (ddrl/rewards/catalog.py)")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="factory argument")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=18085, help="port (0 = any free one; default 18085)")
    return parser


def setup_logging(quiet: bool = False) -> None:
    """ddrl's loggers to stderr, once per process: INFO on rank 0 (WARNING with quiet), WARNING on the
    other ranks of torchrun, so each line is printed once."""
    rank0 = os.environ.get("RANK", "0") == "0"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ddrl: %(message)s"))
    logger = logging.getLogger("ddrl")
    logger.handlers[:] = [handler]  # calling main() again (tests, notebooks) does not double the lines
    logger.setLevel(logging.WARNING if quiet or not rank0 else logging.INFO)
    logger.propagate = False


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above 0, refused by argparse's one-line usage error otherwise."""

    def parse(text: str) -> Any:
        value = kind(text)  # not a number: argparse's "invalid int value"
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def _split_quoted_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`"--task-arg reward_args={url: ...}"`, an option and its value quoted as one word, as two words.

    A shell line that quotes the whole pair (to keep a YAML value's spaces) hands argparse one word that
    starts with -- and holds a space, which argparse reads as a positional argument and refuses. Only a
    known option that takes a value is split, and never the value of the option before it."""
    takes_value = {flag for action in parser._actions if isinstance(action.choices, dict)  # the subcommands
                   for sub in action.choices.values() for a in sub._actions if a.nargs != 0
                   for flag in a.option_strings}
    out: list[str] = []
    for word in argv:
        flag, space, value = word.partition(" ")
        if space and flag in takes_value and not (out and out[-1] in takes_value):
            out += [flag, value]
        else:
            out.append(word)
    return out


def _import_from_working_directory() -> None:
    """`module:function` names (--task, --reward, task.name=...) import my_tasks.py from the working
    directory, as `python -m ddrl` does: the `ddrl` console script's sys.path starts at its own bin/
    folder instead. Searched last, so a file there never shadows an installed module."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _user_errors() -> tuple[type[BaseException], ...]:
    """What bad input and a bad environment raise: printed as one `ddrl: error:` line, exit code 2.
    ValueError (bad values; ConfigError, UnicodeDecodeError), KeyError, OSError (a missing or unreadable
    file, a port in use) and a reward server that is not reachable."""
    from ddrl.rewards.server import RewardServerError

    return ValueError, KeyError, OSError, RewardServerError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_split_quoted_options(parser, sys.argv[1:] if argv is None else list(argv)))
    if extra and isinstance(getattr(args, "overrides", None), list) and all("=" in w and not w.startswith("-")
                                                                             for w in extra):
        args.overrides += extra  # key=value after a flag (`ddrl train CFG --resume train.steps=20`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    setup_logging(args.quiet)
    _import_from_working_directory()
    caller_group = _in_process_group()
    code = _run(args)
    if _in_process_group() and not caller_group:  # the command made one (torchrun, an offload group): end it
        from ddrl.training.distributed import end_process_group, exit_without_finalizing

        end_process_group()
        if argv is None:  # the ddrl program, not a call from Python
            exit_without_finalizing(code)  # gloo's threads could abort the interpreter's exit (its docstring)
    return code


def _in_process_group() -> bool:
    """Whether this process is in a torch.distributed group (never importing it to find out)."""
    tdist = sys.modules.get("torch.distributed")
    return tdist is not None and tdist.is_available() and tdist.is_initialized()


def _run(args: argparse.Namespace) -> int:
    """The command's exit code; the errors users cause are one line and a code, not a traceback."""
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("ddrl: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"ddrl: error: {msg}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if type(e).__name__ in ("NonFiniteError", "DeadRewardError"):  # the run stopped itself, and says why
            print(f"ddrl: error: {e}", file=sys.stderr)
            return 3
        raise


def _cmd_pretrain(args: argparse.Namespace) -> int:
    from ddrl.training.pretrain import pretrain

    final = pretrain(args.config, args.overrides)
    print(f"model written to {final}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    if getattr(args, "rehearse", False):
        from ddrl.training.rehearse import RecipeDoesNotFit, rehearse, rehearse_extrapolated

        try:
            overrides = [*args.overrides, *_train_flags(args)]
            report = (rehearse_extrapolated(args.config, overrides, args.world_size) if args.extrapolate
                      else rehearse(args.config, overrides, args.world_size, layers=args.layers))
        except RecipeDoesNotFit as e:
            print(e, file=sys.stderr)
            return 1
        print(report.table())
        return 0
    if getattr(args, "dry_run", False):
        from ddrl.training.memory import dry_run

        print(dry_run(args.config, [*args.overrides, *_train_flags(args)], args.world_size, args.gpu_memory))
        return 0
    from ddrl.training.trainer import train

    run_dir = train(args.config, [*args.overrides, *_train_flags(args)])
    if os.environ.get("RANK", "0") == "0":
        print(f"run directory: {run_dir}")
    return 0  # main ends the process group


def _train_flags(args: argparse.Namespace) -> list[str]:
    """--resume and --output-dir (the flags TRL users know) as the overrides they stand for, after
    the others, so the flag wins over a key=value that says otherwise."""
    flags = ["resume=true"] if args.resume else []
    if args.output_dir is not None:
        flags.append(f"output_dir={json.dumps(args.output_dir)}")  # quoted: a YAML scalar stays a string
    return flags


def _task_kwargs(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--task-arg {item!r} must look like key=value")
        k, v = item.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def _cmd_eval(args: argparse.Namespace) -> int:
    from ddrl.eval import default_sampler, evaluate
    from ddrl.contract import model_view
    from ddrl.sampling.checks import FLAGS, check_sampler
    from ddrl.tasks import get_task

    task = get_task(args.task, **_task_kwargs(args.task_arg))  # fail fast on a bad task name
    if args.protocol is not None:
        return _eval_protocol(args, task)
    model = _load(args)
    sampler = default_sampler(model, task, key=FLAGS, **{k: getattr(args, k) for k in _SAMPLER_KEYS})
    check_sampler(sampler, FLAGS, block_size=model_view(model).block_size)  # named as flags
    result = evaluate(model, task, n=200 if args.n is None else args.n, sampler=sampler, seed=args.seed, k=args.k,
                      batch_size=64 if args.batch_size is None else args.batch_size, output_jsonl=args.output,
                      split=args.split)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"task {result['task']}  n={result['n']}  accuracy={result['accuracy']:.3f}  "
              f"mean_reward={_reward_text(result)}  ({result['seconds']:.1f}s)")
        if args.k > 1:
            print(f"pass@{args.k}={result[f'pass@{args.k}']:.3f}")
    return 0


def _reward_text(result: dict[str, Any]) -> str:
    """mean_reward for a person: "none" when no completion got a valid reward (null in --json)."""
    return "none (no valid reward)" if result["mean_reward"] is None else f"{result['mean_reward']:.3f}"


def _eval_protocol(args: argparse.Namespace, task: Any) -> int:
    """`ddrl eval --protocol NAME`: every generation length of the paper's protocol, on its test set."""
    from ddrl.eval.protocols import evaluate_protocol, get_protocol
    from ddrl.sampling.checks import FLAGS

    protocol = get_protocol(args.protocol)  # an unknown name lists the registered ones, before loading
    if args.split != "test":
        raise ValueError(f"protocol {protocol.name!r} scores the paper's test set; drop --split {args.split}")
    overrides = {k: getattr(args, k) for k in _SAMPLER_KEYS if k != "gen_length"}
    lengths = None if args.gen_length is None else [args.gen_length]
    model = _load(args)
    result = evaluate_protocol(model, task, protocol, n=args.n, seed=args.seed, k=args.k, batch_size=args.batch_size,
                               lengths=lengths, overrides=overrides, output_jsonl=args.output, key=FLAGS)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"task {result['task']}  protocol {result['protocol']}  n={result['n']}")
    for length, r in result["lengths"].items():
        print(f"  gen_length {length:>4}: accuracy={r['accuracy']:.3f}  mean_reward={_reward_text(r)}  "
              f"({r['seconds']:.1f}s)")
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from ddrl.data import check_modality, model_modalities
    from ddrl.eval.runner import default_sampler
    from ddrl.contract import model_view
    from ddrl.sampling.checks import FLAGS, check_sampler
    from ddrl.sampling.engine import RolloutEngine

    model = _load(args)
    model.eval()

    class _Len:  # default size without a task: 32 new tokens, or what the context leaves
        gen_length = 32
        modality = "text"
        image_grid: tuple[int, int] | None = None
        if model_view(model).max_seq_len:
            gen_length = max(1, min(32, model.max_seq_len - len(model.tokenizer.encode(args.prompt)) - 1))

    # an image model's samples are images (written as a PNG grid below): sized and checked as an image task's
    grid = _image_grid(model, args.gen_length) if "text" not in model_modalities(model) else None
    if grid is not None:
        _Len.modality, _Len.image_grid, _Len.gen_length = "image", grid, grid[0] * grid[1]
    check_modality(model, _Len())  # what the model cannot generate is refused before sampling
    cfg = default_sampler(model, _Len(), key=FLAGS, **{k: getattr(args, k) for k in _SAMPLER_KEYS})
    check_sampler(cfg, FLAGS, block_size=model_view(model).block_size)  # named as flags
    # the path training and evaluation sample through (ddrl.sampling.engine); one generator for the n rows
    engine = RolloutEngine(model, cfg, sampler=cfg.name, task=_Len(), option_names=("--max-prompt-length", "--gen-length"))
    prompt = engine.encode([args.prompt])
    out = engine.generate(prompt.ids, prompt.mask, torch.Generator().manual_seed(args.seed), rows_per_prompt=args.n)
    pixels = out.completions.images  # [n, 3, H, W] for an image model, else None
    if pixels is not None:
        from ddrl.rewards.pixels import save_image_grid

        assert grid is not None  # an image task's completions
        path = save_image_grid(pixels, args.output, captions=[args.prompt] * len(pixels))
        print(f"{len(pixels)} image(s) of {grid[0]}x{grid[1]} codes written to {path}")
        return 0
    for text in out.completions.texts:
        print(text)
    return 0


def _image_grid(model: Any, gen_length: int | None) -> tuple[int, int]:
    """(h, w) image codes per sample: the model's image_shape, else a square of --gen-length codes."""
    import math

    from ddrl.contract import model_view

    grid = model_view(model).image_grid
    shape = None if grid is None else grid.image_shape
    if shape is not None and gen_length in (None, shape[0] * shape[1]):
        return int(shape[0]), int(shape[1])
    side = math.isqrt(gen_length or 0)
    if gen_length is None or side * side != gen_length or shape is not None:
        want = f"{shape[0]}x{shape[1]} = {shape[0] * shape[1]}" if shape is not None else "a square h*h"
        got = "none" if gen_length is None else gen_length
        raise ValueError(f"this model samples images: --gen-length is its image codes per sample, {want} (64 for "
                         f"an 8x8 grid, as checkpoints/digits-ursa; 1024 for 32x32, URSA at 512 px); got {got}")
    return side, side


def _cmd_demo(args: argparse.Namespace) -> int:
    from ddrl.demo import run_demo

    run_demo(task=args.task, method=args.method, steps=args.steps, output_dir=args.output_dir, eval_n=args.eval_n)
    return 0


def _cmd_methods(args: argparse.Namespace) -> int:
    from ddrl.objectives import describe_methods
    from ddrl.registry import ESTIMATORS

    objectives = describe_methods()  # one row per registered objective, from the Objective contract
    estimators = [{"name": n, "paper": getattr(c, "paper", ""), "formula": getattr(c, "formula", ""),
                   "passes": getattr(c, "passes", "")} for n, c in ESTIMATORS.items()]
    if args.json:
        print(json.dumps({"objectives": objectives, "estimators": estimators}, indent=1))
        return 0
    print("Objectives (method.objective / objective=NAME):")
    for o in objectives:
        print(f"  {o['name']:<14} {o['paper']}")
        if o["source"]:
            print(f"  {'':<14} released code: {o['source']}")
        print(f"  {'':<14} loss: {o['formula']}")
        print(f"  {'':<14} default estimator: {o['estimator']}, advantage: {o['advantage']}")
    print("\nEstimators (method.estimator=NAME):")
    for e in estimators:
        print(f"  {e['name']:<18} {e['paper']}  [{e['passes']} forward passes]")
        print(f"  {'':<18} {e['formula']}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from ddrl.compare import run_compare

    methods = args.methods.split(",") if args.methods else None
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"ddrl compare: --seeds takes comma-separated integers, e.g. 0,1,2; got {args.seeds!r}") from None
    run_compare(config=args.config, methods=methods, steps=args.steps, output_dir=args.output_dir,
                seeds=seeds, extra_overrides=args.overrides)
    return 0


def _cmd_serve_reward(args: argparse.Namespace) -> int:
    from ddrl.rewards.catalog import build_image_reward
    from ddrl.rewards.server import serve_reward

    if args.reward == "server":  # a server of a server only adds a hop
        raise ValueError("--reward server: serve the reward itself (a catalog name or module:function)")
    reward = build_image_reward(args.reward, _task_kwargs(args.arg), what="--reward")  # as task.args.reward
    server = serve_reward(reward, args.host, args.port, name=args.reward)
    print(f"serving reward {args.reward} at {server.url} (GET /health, POST /score)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


COMMANDS = {"pretrain": _cmd_pretrain, "train": _cmd_train, "eval": _cmd_eval, "sample": _cmd_sample,
            "demo": _cmd_demo, "methods": _cmd_methods, "compare": _cmd_compare, "serve-reward": _cmd_serve_reward}


if __name__ == "__main__":
    raise SystemExit(main())
