"""The tiny character GPT on generated text (``protocols.tinylm``) as a task: the fast one the tests use.

``domain = "source"`` (DiLoCo: from scratch on the grammar's text) or ``"target"`` (SPSA: the shifted domain), with
``pretrain_steps`` AdamW steps on the source domain first (the base model every SPSA peer rebuilds, bit for bit).
"""

from __future__ import annotations

from typing import Iterator

import torch

from protocols import outer, tinylm

CTX = 64  # TinyGPT's context


class TinyGptTask:
    def __init__(self, domain: str, pretrain_steps: int, batch: int, seed: int):
        if domain not in ("source", "target"):
            raise ValueError(f"domain must be 'source' or 'target', not {domain!r}")
        if pretrain_steps < 0 or batch < 1:
            raise ValueError("pretrain_steps must be >= 0 and batch >= 1")
        self.domain, self.pretrain_steps, self.batch, self.seed = domain, pretrain_steps, batch, seed
        target = domain == "target"
        self.val = tinylm.encode_text(tinylm.corpus(seed + (99 if target else 424242), 30_000 if target else 40_000,
                                                    target=target))

    def model(self) -> torch.nn.Module:
        if self.pretrain_steps:
            return tinylm.pretrain(self.seed, self.pretrain_steps)
        return tinylm.TinyGPT()

    def data(self, shard: int, seed: int) -> Iterator[torch.Tensor]:
        target = self.domain == "target"
        text = tinylm.encode_text(tinylm.corpus(seed * 7919 + shard, 100_000 if target else 200_000, target=target))
        step = 0
        while True:
            yield tinylm.batch_at(text, seed * 1_000_003 + shard * 7 + step, self.batch, CTX)
            step += 1

    def loss(self, model, batch: torch.Tensor) -> torch.Tensor:
        return model.loss(batch)

    def evaluate(self, model) -> float:
        return tinylm.evaluate(model, self.val, 4, 32)

    def fragments(self, model, count: int) -> list[list[str]]:
        """Streaming DiLoCo's strided pattern: block i in fragment i % count, the rest in fragment 0."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return [[names[i] for i in group] for group in outer.fragments(names, count)]


def make_task(domain: str = "source", pretrain_steps: int = 0, batch: int = 16, seed: int = 1) -> TinyGptTask:
    return TinyGptTask(domain, pretrain_steps, batch, seed)
