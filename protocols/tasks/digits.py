"""A non-language task: scikit-learn's bundled 8x8 handwritten digits (1,797 images, offline), classified by a
small MLP. Every fifth image is held out for validation; each peer samples training batches with its own RNG."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from swarmd.protocols.tasks import batch_seed


class DigitsTask:
    def __init__(self, hidden: int, batch: int):
        from sklearn.datasets import load_digits

        if hidden < 1 or batch < 1:
            raise ValueError("hidden and batch must be >= 1")
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        val = torch.arange(len(y)) % 5 == 0
        self.train_x, self.train_y = x[~val], y[~val]
        self.val_x, self.val_y = x[val], y[val]
        self.hidden, self.batch = hidden, batch

    def model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, self.hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(self.hidden, 10))

    def data(self, shard: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + shard)
        while True:
            yield self._draw(g)

    def batch_at(self, shard: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``shard`` at ``step``, a function of its arguments (SPSA re-probes another peer's step)."""
        return self._draw(torch.Generator().manual_seed(batch_seed(seed, shard, step)))

    def _draw(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.train_y), (self.batch,), generator=g)
        return self.train_x[idx], self.train_y[idx]

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model) -> float:
        device = next(model.parameters()).device
        return float(F.cross_entropy(model(self.val_x.to(device)), self.val_y.to(device)))

    def accuracy(self, model) -> float:
        device = next(model.parameters()).device
        return float((model(self.val_x.to(device)).argmax(1).cpu() == self.val_y).float().mean())


def make_task(hidden: int = 64, batch: int = 32) -> DigitsTask:
    return DigitsTask(hidden, batch)
