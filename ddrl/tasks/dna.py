"""dna_enhancer: SEPO / DRAKES's regulatory DNA design, on gosai-format CSVs and a local oracle.

Reference: ozekri/SEPO @ 4a4a40f GRPO_MDLM_DNA: dataloader_gosai.py (gosai_all.csv: `seq` plus `hepg2`,
`k562`, `sknsh` activity), oracle.py (the gReLU Enformer oracle, its 3-mer counts and high-expression
sets), grpo_train.py:305 (the reward: the *eval* oracle's HepG2 prediction), eval.ipynb (the metrics).

    task = DNAEnhancerTask(path="gosai_all.csv", split="hash", oracle="oracle.pt")   # nothing is downloaded
    task.reward(["ACGT..."])           # the oracle's prediction for column `target` (0 = HepG2) per sequence

The generation is unconditional: every example's prompt is "" and the data rows serve as the dev / sealed
test reference (DataSource: train_path/test_path, or one path= file with split="hash"; dev is held out of
the train rows). The oracle is any torch module taking one-hot [n, 4, L] (A, C, G, T) and returning
[n, tasks] (or [n, tasks, 1]), as gReLU's models do: `oracle=` a module, a TorchScript / pickled-module
file (oracle_kind "torchscript" | "module"; a pickled module is loaded with weights_only=False: trusted
files only), or a gReLU LightningModel checkpoint (oracle_kind "grelu", needs `pip install ddrl[dna]`).

Metrics (eval_breakdown, in `ddrl eval --json` under "breakdown"), as eval.ipynb computes them:
  pred_activity_median / _mean  the oracle's prediction of column `target` on the samples
  kmer3_pearson                 Pearson r between the samples' 3-mer counts and those of the data's top
                                sequences (HepG2 above the `top_quantile` quantile, 0.999 in eval.ipynb),
                                the latter scaled to the samples' count (oracle.compare_kmer)
  atac_accuracy                 share of samples with the ATAC oracle's column `atac_column` (1) > 0.5,
                                when atac_oracle= is given
  log_likelihood_median         MDLM's likelihood bound under the base model (`likelihood_model=` a path),
                                Diffusion.get_likelihood with `likelihood_steps` steps and one mask draw
Accuracy (`correct`) = predicted activity above the data's 99th HepG2 percentile (oracle.cal_highexp_kmers'
first threshold, 4.56 on gosai_all); the paper reports the median activity and ATAC accuracy instead.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ddrl.registry import TASKS
from ddrl.tasks.paper_data import DataSource, FileTask

BASES = "ACGT"


def one_hot_dna(seqs: list[str]) -> torch.Tensor:
    """ACGT strings of one length -> [n, 4, L] float (gReLU's layout)."""
    ids = torch.tensor([[BASES.index(c) for c in s] for s in seqs], dtype=torch.long)
    return torch.nn.functional.one_hot(ids, 4).float().permute(0, 2, 1)


def _load_grelu(path: str) -> Any:
    try:
        from grelu.lightning import LightningModel
    except ImportError:
        raise ValueError("oracle_kind='grelu' needs gReLU: pip install 'ddrl[dna]'") from None
    return LightningModel.load_from_checkpoint(path, map_location="cpu")


ORACLE_LOADERS: dict[str, Callable[[str], Any]] = {
    "torchscript": lambda path: torch.jit.load(path, map_location="cpu"),
    "module": lambda path: torch.load(path, map_location="cpu", weights_only=False),  # a trusted pickled module
    "grelu": _load_grelu,  # a gReLU LightningModel checkpoint
}


def load_oracle(oracle: Any, kind: str = "torchscript") -> torch.nn.Module:
    """A module, or a file of `kind` -> an eval-mode module; a file that is missing or not of that
    kind is an error naming it."""
    if isinstance(oracle, torch.nn.Module):
        return oracle.eval()
    if kind not in ORACLE_LOADERS:
        raise ValueError(f"oracle_kind={kind!r}; choose one of: {', '.join(ORACLE_LOADERS)}")
    if not Path(str(oracle)).is_file():
        raise ValueError(f"oracle file {str(oracle)!r} does not exist")
    try:
        module = ORACLE_LOADERS[kind](str(oracle))
    except ValueError:  # ours: a missing optional package
        raise
    except Exception as e:  # noqa: BLE001 - torch.jit, pickle and Lightning each raise their own kinds
        raise ValueError(f"oracle file {str(oracle)!r} cannot be read as oracle_kind={kind!r} ({_first_line(e)}); "
                         f"pass a TorchScript file (torch.jit.save: oracle_kind=torchscript), a pickled torch module "
                         f"(oracle_kind=module) or a gReLU checkpoint (oracle_kind=grelu)") from None
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"oracle file {str(oracle)!r} holds a {type(module).__name__}, not a torch module; save the "
                         f"module itself (torch.save(module) or torch.jit.save)")
    return module.eval()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_oracle(oracle: torch.nn.Module, seq: str, column: int, name: str) -> None:
    """Run the oracle once on `seq` (a data row): it must take one-hot [1, 4, L] of the data's length
    and predict column `column`, so a wrong oracle fails here, before any compute, not at the first reward."""
    try:
        pred = oracle_predictions(oracle, [seq])
    except Exception as e:  # noqa: BLE001 - the module's own error (a shape mismatch, mostly)
        raise ValueError(f"task dna_enhancer: {name} fails on the data's {len(seq)}-bp sequences, one-hot "
                         f"[1, 4, {len(seq)}] ({_first_line(e)}); use the oracle trained for sequences of this "
                         f"length") from None
    if not 0 <= column < pred.shape[1]:
        raise ValueError(f"task dna_enhancer: {name} predicts {pred.shape[1]} column(s); column {column} does not "
                         f"exist (target / atac_column count from 0)")


def oracle_predictions(oracle: torch.nn.Module, seqs: list[str], batch_size: int = 256) -> np.ndarray:
    """[n, tasks] predictions (oracle.cal_gosai_pred_new: one-hot [n, 4, L] in, squeeze the last dim)."""
    device = next((p.device for p in oracle.parameters()), torch.device("cpu"))
    out = []
    with torch.no_grad():
        for i in range(0, len(seqs), batch_size):
            pred = oracle(one_hot_dna(seqs[i:i + batch_size]).to(device)).float()
            out.append(pred.reshape(pred.shape[0], -1).cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 1))


def kmer_counts(seqs: list[str], k: int = 3) -> Counter:
    return Counter(s[i:i + k] for s in seqs for i in range(len(s) - k + 1))


def kmer_pearson(reference: Counter, n_reference: int, samples: Counter, n_samples: int) -> float:
    """oracle.compare_kmer: Pearson r over the union of k-mers, reference counts scaled by n_samples / n_ref."""
    kmers = sorted(set(reference) | set(samples))
    a = np.array([samples.get(k, 0) for k in kmers], dtype=float)
    b = np.array([reference.get(k, 0) * n_samples / n_reference for k in kmers], dtype=float)
    if len(kmers) < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


@torch.no_grad()
def mdlm_log_likelihood(model: Any, ids: torch.Tensor, steps: int = 128, *, generator: torch.Generator,
                        eps: float = 1e-5) -> torch.Tensor:
    """Diffusion.get_likelihood: Σ_steps Σ_i log p(x0_i | x_t) (m_t - m_s) / m_t with x_t ~ q(x_t | x0), one mask
    draw per step. ids [n, L] -> [n]."""
    times = torch.linspace(1, eps, steps + 1, dtype=torch.float64).tolist()
    dt = (1 - eps) / steps
    total = torch.zeros(ids.shape[0], dtype=torch.float64)
    mask_id = int(model.mask_token_id)
    for i in range(steps):
        m_t = float(1 - model.process.alpha(torch.tensor(times[i], dtype=torch.float64)))
        m_s = float(1 - model.process.alpha(torch.tensor(times[i] - dt, dtype=torch.float64)))
        u = torch.rand(ids.shape, generator=generator)
        xt = torch.where(u.to(ids.device) < m_t, torch.full_like(ids, mask_id), ids)
        logp = torch.log_softmax(model(xt).logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
        logp = torch.where(xt == mask_id, logp, torch.zeros_like(logp))  # subs: a visible base is carried (log 1)
        total += (logp * (m_t - m_s) / m_t).sum(-1).double().cpu()
    return total


@TASKS.register("dna_enhancer")
class DNAEnhancerTask(FileTask):
    name = "dna_enhancer"
    format = "compact"

    def __init__(self, path: str | None = None, train_path: str | None = None, test_path: str | None = None,
                 split: str | None = None, test_fraction: float | None = None, dev_fraction: float = 0.1,
                 oracle: Any = None, oracle_kind: str = "torchscript", target: int = 0,
                 atac_oracle: Any = None, atac_kind: str = "torchscript", atac_column: int = 1,
                 top_quantile: float = 0.999, likelihood_model: Any = None, likelihood_steps: int = 128,
                 seq_column: str = "seq", activity_column: str = "hepg2", preset: str | None = None,
                 format: str = "compact"):
        if format != "compact":
            raise ValueError(f"task dna_enhancer: format must be 'compact' (unconditional sequences), got {format!r}")
        if preset is not None:
            raise ValueError(f"task dna_enhancer has no preset (got {preset!r}): it is SEPO's own task")
        if oracle is None:
            raise ValueError("task dna_enhancer needs oracle= (a torch module or a local file; nothing is downloaded)")
        self._init_source(DataSource(self.name, path=path, train_path=train_path, test_path=test_path, split=split,
                                     test_fraction=test_fraction, dev_fraction=dev_fraction))
        self.seq_column, self.activity_column = seq_column, activity_column
        self._first: tuple[int, str] | None = None  # (length, where) of the first data row read
        self._reference: tuple[Counter, int, float] | None = None
        self.oracle = load_oracle(oracle, oracle_kind)
        self.atac_oracle = None if atac_oracle is None else load_oracle(atac_oracle, atac_kind)
        self.target, self.atac_column, self.top_quantile = int(target), int(atac_column), float(top_quantile)
        self.likelihood_model, self.likelihood_steps = likelihood_model, int(likelihood_steps)
        probe = self._data_rows()[0]["seq"]  # reads (and checks) the data now, before any compute
        check_oracle(self.oracle, probe, self.target, f"oracle {oracle!r}")
        if self.atac_oracle is not None:
            check_oracle(self.atac_oracle, probe, self.atac_column, f"atac_oracle {atac_oracle!r}")

    def _example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        seq = str(row.get(self.seq_column, "")).upper()
        if not seq or any(c not in BASES for c in seq):
            raise ValueError(f"{where}: column {self.seq_column!r} must be an ACGT sequence, got {seq[:20]!r}")
        if self._first is None:
            self._first = (len(seq), where)
        elif len(seq) != self._first[0]:
            raise ValueError(f"{where}: a {len(seq)}-bp sequence, but {self._first[1]} has {self._first[0]} bp; every "
                             f"sequence of the data has one length (what the model generates and the oracle reads)")
        if self.activity_column not in row:
            raise ValueError(f"{where}: no column {self.activity_column!r} (activity_column); the row has "
                             f"{', '.join(map(repr, row))}")
        try:
            activity = float(row[self.activity_column])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: column {self.activity_column!r} must be a number, got "
                             f"{row[self.activity_column]!r}") from None
        return {"prompt": "", "seq": seq, "activity": activity}

    def _data_rows(self) -> list[dict[str, Any]]:
        """The rows of the test split, or of the train split when there is no test file."""
        rows = self._split_rows("test" if self.source.has("test") else "train")
        if not rows and self._first is None:
            source = self.source.path or self.source.test_path or self.source.train_path or self.source.dataset
            raise ValueError(f"task dna_enhancer: the data ({source}) has no rows")
        return rows

    @property
    def gen_length(self) -> int:  # type: ignore[override]
        """The data's sequence length: what the model generates (`ddrl eval`'s default --gen-length)."""
        if self._first is None:
            self._data_rows()
        assert self._first is not None
        return self._first[0]

    def _split_key(self, example: dict[str, Any]) -> str:
        return example["seq"]

    def pretrain_pairs(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """n unconditional {"prompt": "", "completion": seq} pairs from the train rows (dev and test held out),
        for `ddrl pretrain` with model.architecture=mdlm_dna. Both of pretrain's draws (train and its held-out
        loss) come from these rows: the dev split is the held-out check."""
        return [{"prompt": "", "completion": ex["seq"]} for ex in self.train_examples(n, seed=seed)]

    def _all_rows(self) -> list[dict[str, Any]]:
        rows = list(self._split_rows("test")) if self.source.has("test") else []
        return rows + (list(self._split_rows("train")) + list(self._split_rows("dev")) if self.source.has("train")
                       else [])

    def reference(self) -> tuple[Counter, int, float]:
        """(3-mer counts of the top sequences, how many, the 99th activity percentile) of all the data's rows."""
        if self._reference is None:
            rows = self._all_rows()
            act = np.array([r["activity"] for r in rows])
            top = [r["seq"] for r in rows if r["activity"] >= np.quantile(act, self.top_quantile)]
            self._reference = (kmer_counts(top), len(top), float(np.quantile(act, 0.99)))
        return self._reference

    @property
    def success_threshold(self) -> float:  # type: ignore[override]
        return self.reference()[2]

    def _valid(self, seq: str) -> bool:
        return bool(seq) and all(c in BASES for c in seq)

    def reward(self, completions: list[str], **columns: Any) -> list[float | None]:
        """The oracle's prediction of column `target` (HepG2) per sequence; None for a malformed one."""
        ok = [i for i, s in enumerate(completions) if self._valid(s)]
        out: list[float | None] = [None] * len(completions)
        lengths = {len(completions[i]) for i in ok}
        for length in lengths:
            idx = [i for i in ok if len(completions[i]) == length]
            try:
                pred = oracle_predictions(self.oracle, [completions[i] for i in idx])[:, self.target]
            except RuntimeError as e:  # the oracle takes the data's length only
                raise ValueError(f"task dna_enhancer: the oracle fails on {length}-bp completions ({_first_line(e)}); "
                                 f"the data's sequences are {self.gen_length} bp: set rollout.gen_length="
                                 f"{self.gen_length} (--gen-length {self.gen_length})") from None
            for i, p in zip(idx, pred):
                out[i] = float(p)
        return out

    def eval_breakdown(self, rows: list[dict[str, Any]], examples: list[dict[str, Any]]) -> dict[str, Any]:
        seqs = [row["completions"][0] for row in rows if self._valid(row["completions"][0])]
        result: dict[str, Any] = {"n_valid": len(seqs)}
        if not seqs:
            return result
        act = np.array([s for s in self.reward(seqs) if s is not None])
        result.update(pred_activity_median=float(np.median(act)), pred_activity_mean=float(act.mean()))
        ref, n_ref, _ = self.reference()
        result["kmer3_pearson"] = kmer_pearson(ref, n_ref, kmer_counts(seqs), len(seqs))
        if self.atac_oracle is not None:
            atac = oracle_predictions(self.atac_oracle, seqs)[:, self.atac_column]
            result["atac_accuracy"] = float((atac > 0.5).mean())
        if self.likelihood_model is not None:
            result["log_likelihood_median"] = float(self._log_likelihood(seqs).median())
        return result

    def _log_likelihood(self, seqs: list[str]) -> torch.Tensor:
        import ddrl

        model = self.likelihood_model
        if not callable(model) or isinstance(model, str):
            model = self.likelihood_model = ddrl.load_model(model).eval()
        ids = torch.tensor([[BASES.index(c) for c in s] for s in seqs], dtype=torch.long, device=model.device)
        return mdlm_log_likelihood(model, ids, self.likelihood_steps, generator=torch.Generator().manual_seed(0))


def dna_reward(oracle: torch.nn.Module, target: int = 0) -> Callable[..., list[float | None]]:
    """A plain reward function `reward(completions, **columns)` from any oracle module (one-hot [n, 4, L] in)."""

    def reward(completions: list[str], **columns: Any) -> list[float | None]:
        out: list[float | None] = []
        for seq in completions:
            ok = bool(seq) and all(c in BASES for c in seq)
            out.append(float(oracle_predictions(oracle, [seq])[0, target]) if ok else None)
        return out

    return reward
