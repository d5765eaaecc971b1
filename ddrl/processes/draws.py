"""Random draws from an explicit torch.Generator, never from the global RNG.

Each draw here happens on the generator's own device and is then moved to the requested device, so
a CPU generator can drive noise for a CUDA model and the same seed gives the same numbers wherever
the model lives. That suits small draws (estimator masks, one uniform per position). The masked
samplers' per-step noise, [B, W, V] per step, is instead drawn on the model's device from seeds
taken here (`chunk_seeds`; ddrl.sampling.utils.StepNoise): a CPU draw of that size and its copy to
the GPU would cost more than the model call.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RowGenerators:
    """One generator per consecutive chunk of `rows_per_generator` rows along dim 0.

    A batched sampler call driven by RowGenerators gives each chunk (e.g. a prompt's group of G
    completions) exactly the draws it would get alone with its own generator: rollouts then depend
    on (seed, step, group) only, not on how groups are batched or split across processes, while the
    model still runs one batched call. Every draw function below accepts it in place of a Generator
    for tensors whose first dimension is the batch.
    """

    def __init__(self, generators: list[torch.Generator], rows_per_generator: int):
        if not generators or rows_per_generator <= 0:
            raise ValueError("RowGenerators needs at least one generator and rows_per_generator >= 1")
        self.generators = list(generators)
        self.rows_per_generator = rows_per_generator
        self.device = self.generators[0].device

    def draw(self, fn, shape: tuple[int, ...], **kwargs) -> Tensor:
        """fn(shape of one chunk, generator=g, device=g.device, **kwargs) per generator, stacked along dim 0."""
        if not shape:
            raise ValueError("RowGenerators draws need the batch as the first dimension; got a scalar shape")
        return torch.cat([fn((hi - lo, *shape[1:]), generator=g, device=g.device, **kwargs)
                          for lo, hi, g in row_chunks(self, shape[0])])


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with `seed` on `device` (CUDA: the draws happen there, no host copy; any
    other device: a CPU generator)."""
    device = torch.device(device)
    # a build without CUDA has no CUDA generator: a rehearsal's fake CUDA tensors draw from a CPU one
    cuda = device.type == "cuda" and torch.backends.cuda.is_built()
    g = torch.Generator(device=device if cuda else "cpu")
    g.manual_seed(seed)
    return g


def row_chunks(generator: torch.Generator | RowGenerators | None,
               batch_size: int) -> list[tuple[int, int, torch.Generator]]:
    """(first row, end row, generator) for each chunk of a batch of `batch_size` rows: one chunk of
    every row for a plain Generator, one per generator of RowGenerators (which must cover the batch)."""
    g = check_generator(generator)
    if not isinstance(g, RowGenerators):
        return [(0, batch_size, g)]
    n = g.rows_per_generator
    if n * len(g.generators) != batch_size:
        raise ValueError(f"RowGenerators covers {n * len(g.generators)} rows ({len(g.generators)} generators x "
                         f"{n} rows) but the batch has {batch_size} rows; draw with the batch as the first dimension "
                         f"and one generator per group of rows_per_generator rows")
    return [(i * n, (i + 1) * n, gi) for i, gi in enumerate(g.generators)]


def chunk_seeds(generator: torch.Generator | RowGenerators | None, batch_size: int) -> list[tuple[int, int, int]]:
    """(first row, end row, seed) for each chunk of row_chunks(): one 62-bit seed drawn from each
    chunk's generator on its own device. Drawing advances the generator, so the next call made with
    it gets other seeds. The values are read to the host at once: one device sync for all chunks."""
    chunks = row_chunks(generator, batch_size)
    draws = [torch.randint(0, 2**62, (1,), generator=g, device=g.device) for _, _, g in chunks]
    seeds = torch.cat([d.to(draws[0].device) for d in draws]).tolist()
    return [(lo, hi, int(seed)) for (lo, hi, _), seed in zip(chunks, seeds)]


def check_generator(generator: torch.Generator | RowGenerators | None) -> torch.Generator | RowGenerators:
    """The generator itself; a clear error for anything else (None included: no global RNG)."""
    if isinstance(generator, RowGenerators):
        return generator
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            "generator must be a torch.Generator (ddrl never draws from the global RNG); "
            "pass e.g. generator=torch.Generator().manual_seed(0)"
        )
    return generator


def uniform_draw(shape: tuple[int, ...] | torch.Size, *, generator: torch.Generator,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """U[0, 1) of the given shape, drawn on the generator's device, returned on `device`."""
    g = check_generator(generator)
    if isinstance(g, RowGenerators):
        u = g.draw(torch.rand, tuple(shape), dtype=dtype)
        return u if device is None else u.to(device)
    u = torch.rand(tuple(shape), generator=g, device=g.device, dtype=dtype)
    return u if device is None else u.to(device)


def randint_draw(high: int, shape: tuple[int, ...] | torch.Size, *, generator: torch.Generator,
                 device: torch.device | str | None = None) -> Tensor:
    """Integers uniform on {0, ..., high-1}, drawn on the generator's device, returned on `device`."""
    g = check_generator(generator)
    if isinstance(g, RowGenerators):
        x = g.draw(lambda sh, **kw: torch.randint(high, sh, **kw), tuple(shape))
        return x if device is None else x.to(device)
    x = torch.randint(high, tuple(shape), generator=g, device=g.device)
    return x if device is None else x.to(device)


def sample_categorical(probs: Tensor, *, generator: torch.Generator, in_place: bool = False) -> Tensor:
    """One index per row of probs [..., N] (rows need not be normalised; zero entries are never drawn).

    Inverse-CDF sampling with one uniform per row: unlike torch.multinomial it works with a
    generator on another device and needs no reshaping to 2-D. in_place: the cdf overwrites probs
    (same numbers, no second [..., N] tensor), for a caller that does not read probs again.
    """
    cdf = probs.cumsum_(-1) if in_place else probs.cumsum(-1)  # [..., N]
    u = uniform_draw(probs.shape[:-1] + (1,), generator=generator, device=probs.device, dtype=cdf.dtype)
    # right=True: the first index whose cdf exceeds u, which skips zero-probability entries.
    idx = torch.searchsorted(cdf.contiguous(), (u * cdf[..., -1:]).contiguous(), right=True)
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)
