"""A small policy for the arithmetic task, sampling, and a GRPO step (no KL term, clipped ratio).

GRPO as the SAPO paper and genrl use it (``../shared/protocols.md`` 2.1): per question group, advantages
A_i = (r_i - mean) / (std + 1e-8); per completion token ratio rho = exp(logp - logp_old), loss
-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A), clamped to +-10 per token, masked mean over completion
tokens; Adam; no reference model. Groups whose rewards are all equal carry no signal and are dropped before the step.

The policy reads and writes text (``protocols.arith``'s alphabet) through its own tokenizer, so peers with other
model sizes (or other tokenizers) exchange nothing that depends on weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protocols import arith
from protocols.tinylm import TinyGPT

ALPHABET = arith.TASKS + arith.DIGITS + "="
STOI = {c: i for i, c in enumerate(ALPHABET)}
PROMPT_LEN = 5
MAX_COMPLETION = 16  # characters; longer completions are rejected on the wire


@dataclass
class Group:
    """One question with G completions and their rewards (scored by *our* verifier)."""

    prompt: str
    completions: list[str]
    rewards: list[float]

    @property
    def informative(self) -> bool:
        return len(set(self.rewards)) > 1


def tokenizable(text: str) -> bool:
    return all(c in STOI for c in text)


class Policy:
    def __init__(self, seed: int, d: int = 64, layers: int = 2, heads: int = 4, lr: float = 1e-3,
                 eps_low: float = 0.2, eps_high: float = 0.28, epochs: int = 1):
        torch.manual_seed(seed)
        self.model = TinyGPT(vocab=len(ALPHABET), d=d, layers=layers, heads=heads, ctx=PROMPT_LEN + MAX_COMPLETION)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.eps_low, self.eps_high, self.epochs = eps_low, eps_high, epochs

    @torch.no_grad()
    def generate(self, prompts: list[str], g: int, length: int = arith.ANSWER_LEN,
                 temperature: float = 1.0) -> list[list[str]]:
        """``g`` sampled completions of ``length`` characters for each prompt."""
        self.model.eval()
        idx = torch.tensor([[STOI[c] for c in p] for p in prompts], dtype=torch.long).repeat_interleave(g, 0)
        for _ in range(length):
            logits = self.model(idx)[:, -1, :] / temperature
            nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=self.generator)
            idx = torch.cat([idx, nxt], 1)
        texts = ["".join(ALPHABET[t] for t in row[PROMPT_LEN:].tolist()) for row in idx]
        return [texts[i * g:(i + 1) * g] for i in range(len(prompts))]

    def _logprobs(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx[:, :-1])
        return torch.gather(F.log_softmax(logits, -1), 2, idx[:, 1:, None])[..., 0]

    def step(self, groups: list[Group]) -> dict:
        """One GRPO update on the informative groups; returns what it did."""
        groups = [grp for grp in groups if grp.informative]
        if not groups:
            return {"groups": 0, "loss": 0.0}
        rows, advs, lens = [], [], []
        for grp in groups:
            r = torch.tensor(grp.rewards)
            a = (r - r.mean()) / (r.std(unbiased=False) + 1e-8)
            for text, adv in zip(grp.completions, a.tolist()):
                rows.append([STOI[c] for c in grp.prompt + text])
                advs.append(adv)
                lens.append(len(text))
        width = max(len(r) for r in rows)
        idx = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        # completion tokens are predicted at positions PROMPT_LEN-1 .. PROMPT_LEN+len-2 of the shifted sequence
        pos = torch.arange(width - 1)[None, :]
        mask = ((pos >= PROMPT_LEN - 1) & (pos < PROMPT_LEN - 1 + torch.tensor(lens)[:, None])).float()
        adv = torch.tensor(advs)[:, None]
        self.model.eval()  # no dropout in TinyGPT; eval keeps old and new log-probs comparable
        with torch.no_grad():
            old = self._logprobs(idx)
        for _ in range(self.epochs):
            ratio = torch.exp(self._logprobs(idx) - old)
            clipped = torch.clamp(ratio, 1 - self.eps_low, 1 + self.eps_high)
            per_token = torch.clamp(-torch.min(ratio * adv, clipped * adv), -10, 10)
            loss = (per_token * mask).sum() / mask.sum()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return {"groups": len(groups), "loss": loss.item()}
