"""A tiny character-level GPT and an offline, generated text task with a shifted target domain.

Everything here is deterministic given a seed, so every peer can rebuild the same base model bit for bit on the same
torch build (and checks it against the hash the run publishes). The corpus is generated, not downloaded: sentences
from a small seeded grammar. The *source* domain is the grammar's text as written; the *target* domain (what the
zeroth-order loop fine-tunes on) is the same grammar lower-cased with a different word distribution, so a model
pretrained on the source has something to learn.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

NOUNS = ["king", "queen", "castle", "river", "storm", "sword", "crown", "night", "garden", "letter", "horse", "road",
         "tower", "friend", "enemy", "soldier", "winter", "summer", "forest", "ship"]
VERBS = ["sees", "loves", "fears", "finds", "keeps", "leaves", "calls", "holds", "breaks", "follows", "burns",
         "guards"]
ADJ = ["old", "young", "dark", "bright", "cold", "proud", "quiet", "wild", "gentle", "golden", "bitter", "true"]
ADV = ["slowly", "again", "tonight", "alone", "at last", "in silence", "with care", "by the sea"]
NAMES = ["Edmund", "Viola", "Horace", "Juliet", "Oswald", "Portia", "Duncan", "Imogen"]


def _sentence(r: random.Random, target: bool) -> str:
    det = r.choice(["the", "a", "my", "thy", "our"])
    subject = r.choice(NAMES) if r.random() < (0.2 if target else 0.5) else f"{det} {r.choice(ADJ)} {r.choice(NOUNS)}"
    obj = f"{r.choice(['the', 'a', 'his', 'her'])} {r.choice(NOUNS)}"
    s = f"{subject} {r.choice(VERBS)} {obj}"
    if r.random() < (0.7 if target else 0.3):
        s += f" {r.choice(ADV)}"
    s = s[0].upper() + s[1:] + r.choice([".", ".", "!", "?"] if not target else [".", ";", ","])
    return s.lower() if target else s


def corpus(seed: int, n_chars: int, *, target: bool) -> str:
    r = random.Random(seed * 2 + int(target))
    parts, size = [], 0
    while size < n_chars:
        s = _sentence(r, target)
        parts.append(s)
        size += len(s) + 1
    return " ".join(parts)[:n_chars]


VOCAB = sorted(set(corpus(0, 200_000, target=False) + corpus(0, 200_000, target=True) + "abcdefghijklmnopqrstuvwxyz"))
STOI = {c: i for i, c in enumerate(VOCAB)}


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor([STOI[c] for c in text], dtype=torch.long)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = len(VOCAB), d: int = 48, layers: int = 2, heads: int = 4, ctx: int = 64):
        super().__init__()
        self.ctx = ctx
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), diagonal=1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def batch_at(data: torch.Tensor, seed: int, size: int, ctx: int) -> torch.Tensor:
    """A deterministic batch of ``size`` windows of ``ctx + 1`` tokens, chosen by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - ctx - 1, (size,), generator=g)
    return torch.stack([data[s : s + ctx + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: TinyGPT, data: torch.Tensor, batches: int = 8, size: int = 32) -> float:
    model.eval()
    device = next(model.parameters()).device  # the batches are drawn on the CPU; the model may live on a GPU
    losses = [float(model.loss(batch_at(data, 10_000 + i, size, model.ctx).to(device))) for i in range(batches)]
    return sum(losses) / len(losses)


def pretrain(seed: int, steps: int = 300, lr: float = 3e-3, batch: int = 32) -> TinyGPT:
    """The base model every peer rebuilds: init from ``seed``, AdamW on the source domain. Deterministic on CPU."""
    torch.manual_seed(seed)
    model = TinyGPT()
    data = encode_text(corpus(seed, 200_000, target=False))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    for step in range(steps):
        loss = model.loss(batch_at(data, seed * 1_000_003 + step, batch, model.ctx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return model
