"""The tiny character GPT on generated text (``protocols.tinylm``) as a task: the fast one the tests use.

``domain = "source"`` (DiLoCo: from scratch on the grammar's text) or ``"target"`` (SPSA: the shifted domain), with
``pretrain_steps`` AdamW steps on the source domain first (the base model every SPSA peer rebuilds, bit for bit).
"""

from __future__ import annotations

import threading
from typing import Iterator

import torch

from swarmd.protocols import outer, tinylm

CTX = 64  # TinyGPT's context
TEXTS_KEPT = 16  # shards whose generated text batch_at keeps (an SPSA auditor re-probes other peers' steps)


class TinyGptTask:
    def __init__(self, domain: str, pretrain_steps: int, batch: int, seed: int):
        if domain not in ("source", "target"):
            raise ValueError(f"domain must be 'source' or 'target', not {domain!r}")
        if pretrain_steps < 0 or batch < 1:
            raise ValueError("pretrain_steps must be >= 0 and batch >= 1")
        self.domain, self.pretrain_steps, self.batch, self.seed = domain, pretrain_steps, batch, seed
        target = domain == "target"
        self._texts: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()
        self.val = tinylm.encode_text(tinylm.corpus(seed + (99 if target else 424242), 30_000 if target else 40_000,
                                                    target=target))

    def model(self) -> torch.nn.Module:
        if self.pretrain_steps:
            return tinylm.pretrain(self.seed, self.pretrain_steps)
        return tinylm.TinyGPT()

    def data(self, shard: int, seed: int) -> Iterator[torch.Tensor]:
        step = 0
        while True:
            yield self.batch_at(shard, seed, step)
            step += 1

    def batch_at(self, shard: int, seed: int, step: int) -> torch.Tensor:
        """The batch a peer of ``shard`` trains on at ``step`` (``data``'s step-th batch): a function of its
        arguments, so any peer can re-probe another's SPSA step. A shard's text is generated once and kept (the
        last few shards; one task may serve several loops' threads)."""
        with self._lock:
            text = self._texts.pop((shard, seed), None)
        if text is None:
            target = self.domain == "target"
            text = tinylm.encode_text(tinylm.corpus(seed * 7919 + shard, 100_000 if target else 200_000,
                                                    target=target))
        with self._lock:
            self._texts[(shard, seed)] = text  # the most recently used last
            while len(self._texts) > TEXTS_KEPT:
                del self._texts[next(iter(self._texts))]
        return tinylm.batch_at(text, seed * 1_000_003 + shard * 7 + step, self.batch, CTX)

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
