"""The smallest real task: linear regression onto a hidden vector, from noisy samples. Every peer draws its own
samples; the validation loss is the squared distance of the model from the hidden vector, so it shows whether the
swarm learns together. Cheap enough to run hundreds of peers in one process (``swarmd sim``)."""

from __future__ import annotations

from typing import Iterator

import torch

from swarmd.protocols.tasks import batch_seed


class RegressionTask:
    def __init__(self, dim: int, batch: int, noise: float):
        if dim < 1 or batch < 1 or noise < 0:
            raise ValueError("need dim >= 1, batch >= 1, noise >= 0")
        self.dim, self.batch, self.noise = dim, batch, noise
        self.target = torch.randn(dim, generator=torch.Generator().manual_seed(4242))

    def model(self) -> torch.nn.Module:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(self.dim))
        return model

    def data(self, shard: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + shard)
        while True:
            yield self._draw(g)

    def batch_at(self, shard: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``shard`` at ``step``, a function of its arguments (SPSA re-probes another peer's step)."""
        return self._draw(torch.Generator().manual_seed(batch_seed(seed, shard, step)))

    def _draw(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch, self.dim, generator=g)
        return x, x @ self.target + self.noise * torch.randn(self.batch, generator=g)

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return ((x @ model.w - y) ** 2).mean()

    def evaluate(self, model) -> float:
        return float(((model.w.detach().cpu() - self.target) ** 2).sum())


def make_task(dim: int = 64, batch: int = 16, noise: float = 0.5) -> RegressionTask:
    return RegressionTask(dim, batch, noise)

