"""Random draws from an explicit torch.Generator, never from the global RNG.

Each draw happens on the generator's own device and is then moved to the requested device, so a
CPU generator can drive noise for a CUDA model and the same seed gives the same numbers wherever
the model lives.
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
        rows = self.rows_per_generator
        if not shape or shape[0] != rows * len(self.generators):
            raise ValueError(f"RowGenerators covers {rows * len(self.generators)} rows but a draw of shape "
                             f"{tuple(shape)} was requested; draw with the batch as the first dimension")
        return torch.cat([fn((rows, *shape[1:]), generator=g, device=g.device, **kwargs) for g in self.generators])


def check_generator(generator: torch.Generator | None) -> torch.Generator:
    if isinstance(generator, RowGenerators):
        return generator  # type: ignore[return-value]
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


def sample_categorical(probs: Tensor, *, generator: torch.Generator) -> Tensor:
    """One index per row of probs [..., N] (rows need not be normalised; zero entries are never drawn).

    Inverse-CDF sampling with one uniform per row: unlike torch.multinomial it works with a
    generator on another device and needs no reshaping to 2-D.
    """
    cdf = probs.cumsum(-1)  # [..., N]
    u = uniform_draw(probs.shape[:-1] + (1,), generator=generator, device=probs.device, dtype=cdf.dtype)
    # right=True: the first index whose cdf exceeds u, which skips zero-probability entries.
    idx = torch.searchsorted(cdf.contiguous(), (u * cdf[..., -1:]).contiguous(), right=True)
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)
