"""A task whose model is one parameter vector of ``size`` values, for the exchange benchmark: with the ``none``
codec an update is exactly 4 x size bytes (plus a few bytes of header per part), and an inner step costs O(size),
so a round's time is the exchange's."""

import torch


class VectorTask:
    def __init__(self, size: int):
        self.size = size

    def model(self) -> torch.nn.Module:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(self.size))
        return model

    def data(self, shard: int, seed: int):
        """A different direction per peer and step, so every part of every update has its own bytes: the peer's
        own random vector, rotated by another offset at each step (one copy; drawing ``size`` fresh normal values
        each step took 150 ms of CPU for 25 MB, more than a round's exchange costs a peer, on the cores the
        exchange shares)."""
        g = torch.Generator().manual_seed(seed * 1000 + shard)
        base = torch.randn(self.size, generator=g)
        step = 0
        while True:
            step += 1
            yield torch.roll(base, step * 7919)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        # mean(w * batch) without its product the size of the vector: the same value and the same gradient
        return torch.dot(model.w, batch) / self.size


class SgdVectorTask(VectorTask):
    """The same, trained by plain SGD (no optimizer state): what fits is then the exchange's memory, not AdamW's."""

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-3)


def make_task(size: int = 1_000_000, sgd: bool = False) -> VectorTask:
    return SgdVectorTask(size) if sgd else VectorTask(size)
