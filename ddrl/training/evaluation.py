"""The RL run's two evaluations, kept apart so that no choice is made on the reported numbers:

    eval.split         (dev by default) before training, every eval.every steps and at the end: eval/*,
                       the history a run's choices read (saved in checkpoints)
    eval.report_split  (test by default) the sealed split, before and after training only: report/*

Both score the policy with ddrl.eval.evaluate, each rank its share of the examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager

from ddrl.config import RLConfig, SamplerConfig
from ddrl.training.distributed import DistInfo, gathered_parameters


class TrainingEvaluation:
    """Scores `model` on the task during an RL run; `history` (eval.split) and `report` (eval.report_split,
    "before" and "after") keep the results: n, accuracy, its 95% interval, mean reward."""

    def __init__(self, cfg: RLConfig, task: Any, model: Any, autocast: ContextManager, dist: DistInfo,
                 run_dir: Path):
        self.cfg, self.task, self.model, self.autocast = cfg, task, model, autocast
        self.dist, self.run_dir = dist, run_dir
        self.history: list[dict[str, Any]] = []  # eval.split's scores, for choices
        self.report: dict[str, dict[str, Any]] = {}  # eval.report_split's, before and after: for reporting
        self.split = self._resolve_split()
        self._check_samples_can_differ()

    def _resolve_split(self) -> str:
        """eval.split, or test with a notice when the task has no dev split (a user's task given only
        train and test lists): its periodic scores then come from the split it reports."""
        from ddrl.tasks.base import split_examples

        split = self.cfg.eval.split
        if split != "dev" or self.cfg.eval.n <= 0:
            return split
        try:
            split_examples(self.task, "dev", 1, self.cfg.seed)
        except (ValueError, NotImplementedError) as why:
            if self.dist.is_main:
                print(f"eval: {why}; evaluating on test instead (eval.split=test silences this)")
            return "test"
        return split

    def _sampler(self) -> SamplerConfig:
        """The rollout's sampler at eval.temperature and eval.steps."""
        e = self.cfg.eval
        return SamplerConfig(**{**vars(self.cfg.rollout), "temperature": e.temperature,
                                "steps": e.steps or self.cfg.rollout.steps})

    def _check_samples_can_differ(self) -> None:
        """A greedy evaluation of an unconditional task (one sample repeated) is refused before training,
        not after it (ddrl.eval.runner.check_samples_can_differ)."""
        from ddrl.eval.runner import check_samples_can_differ
        from ddrl.tasks.base import split_examples

        e = self.cfg.eval
        if e.n > 1 and e.temperature == 0:
            examples = split_examples(self.task, self.split, e.n, self.cfg.seed if e.seed is None else e.seed)
            check_samples_can_differ(self.task, examples, self._sampler())

    def before_training(self) -> dict[str, Any]:
        """eval_before/* and report_before/*: the model before RL, logged on the first training row."""
        before = {f"eval_before/{k.split('/')[1]}": v for k, v in self.evaluate(0).items()}
        before.update({f"report_before/{k.split('/')[1]}": v for k, v in self.report_scores(0).items()})
        return before

    def after_training(self, step: int) -> dict[str, Any]:
        """eval/* and report/* of the final step."""
        return {**self.evaluate(step), **self.report_scores(step)}

    def report_scores(self, step: int) -> dict[str, Any]:
        """The sealed split (eval.report_split), scored before and after training only: report/* and
        self.report["before" | "after"] (n, accuracy, its 95% interval). Never used for a choice."""
        split = self.cfg.eval.report_split
        if split is None or self.cfg.eval.n <= 0:
            return {}
        metrics = self.evaluate(step, split=split, tag="report", n=self.cfg.eval.report_n)
        self.report["before" if step == 0 else "after"] = self._last_result
        return metrics

    def evaluate(self, step: int, split: str | None = None, tag: str = "eval", n: int | None = None) -> dict[str, Any]:
        from ddrl.eval import evaluate

        e = self.cfg.eval
        if e.n <= 0:
            return {}
        n = n or e.n
        split = split or self.split
        sampler = self._sampler()
        name = f"step-{step}.jsonl" if tag == "eval" else f"{tag}-step-{step}.jsonl"
        samples_path = self.run_dir / "eval" / name if self.dist.is_main else None
        with self.autocast, gathered_parameters(self.model):  # FSDP2: ranks make different numbers of calls
            # each rank evaluates its share of the examples; the results are gathered on every rank
            result = evaluate(self.model, self.task, n=n, sampler=sampler,
                              seed=self.cfg.seed if e.seed is None else e.seed,
                              output_jsonl=samples_path, split=split, shard=self.dist.enabled)
        self._last_result = {"step": step, "split": split,
                             **{k: result[k] for k in ("n", "accuracy", "accuracy_interval", "mean_reward")}}
        lo, hi = result["accuracy_interval"]  # 95% (ddrl.stats.score_estimate)
        metrics = {f"{tag}/accuracy": result["accuracy"], f"{tag}/accuracy_lo": lo, f"{tag}/accuracy_hi": hi,
                   f"{tag}/mean_reward": result["mean_reward"]}
        if "breakdown" in result:  # a task's eval_breakdown (digits: per-class rate, diversity)
            self._last_result["breakdown"] = result["breakdown"]
            metrics.update({f"{tag}/{k}": v for k, v in result["breakdown"].items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if tag != "eval":
            return metrics
        self.history.append(self._last_result)
        if self.dist.is_main and samples_path is not None and e.samples_to_log:
            lines = samples_path.read_text().splitlines()[: e.samples_to_log]
            with (self.run_dir / "samples.jsonl").open("a") as f:
                for line in lines:
                    f.write(f'{{"step": {step}, "sample": {line}}}\n')
        return metrics

    def last_accuracy(self) -> str:
        """The latest eval.split accuracy, for the progress bar ("-" before the first)."""
        return f"{self.history[-1]['accuracy']:.2f}" if self.history else "-"
