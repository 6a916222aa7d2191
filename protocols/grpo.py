"""A small policy for the arithmetic task, sampling, and a GRPO step (no KL term, clipped ratio).

GRPO as the SAPO paper and genrl use it (``docs/loops/sapo.md``): per question group, advantages
A_i = (r_i - mean) / (std + 1e-8); per completion token ratio rho = exp(logp - logp_old), loss
-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A), clamped to +-10 per token, masked mean over completion
tokens; Adam; no reference model. Groups whose rewards are all equal carry no signal and are dropped before the step.
:func:`advantages` and :func:`loss` are the same for every policy (``protocols.tasks.hf_policy``'s transformers one
too, which may add the KL term to a frozen reference: beta * (exp(ref - logp) - (ref - logp) - 1) per token, the k3
estimator of DeepSeekMath's GRPO and TRL's GRPOTrainer).

The policy reads and writes text (``protocols.arith``'s alphabet) through its own tokenizer, so peers with other
model sizes (or other tokenizers) exchange nothing that depends on weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmd.protocols import arith
from swarmd.protocols.tinylm import TinyGPT

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


def advantages(rewards: list[float]) -> list[float]:
    """A group's advantages: rewards standardised within the group (population std)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    return ((r - r.mean()) / (r.std(unbiased=False) + 1e-8)).tolist()


def loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_low: float = 0.2,
         eps_high: float = 0.28, ref: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
    """The clipped GRPO objective as a loss, a masked mean over completion tokens.

    ``logp``, ``old``, ``ref`` and ``mask`` are [rows, tokens] (the policy's, the sampling policy's and the frozen
    reference's log-probabilities of each completion token; 1 where a token is the completion's), ``adv`` is
    [rows, 1]. The policy term is clamped to +-10 per token; ``beta`` > 0 adds the KL penalty to ``ref``."""
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = torch.clamp(-torch.min(ratio * adv, clipped * adv), -10, 10)
    if beta and ref is not None:
        delta = ref - logp
        per_token = per_token + beta * (torch.exp(delta) - delta - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def tokenizable(text: str) -> bool:
    return all(c in STOI for c in text)


class Policy:
    """A tiny character-level transformer policy. By default it reads and writes the arithmetic task's alphabet
    (prompts of ``PROMPT_LEN`` characters, completions of ``answer_len``); for other tasks: ``alphabet`` (characters
    outside it read as ``unknown``), ``prompt_len`` (longer prompts keep their tail, shorter ones are left-padded),
    ``answer_chars`` (the characters a completion may use: the sampling distribution is restricted to them) and
    ``eos`` (a completion may end early: shorter completions end with an end-of-text token)."""

    def __init__(self, seed: int, d: int = 64, layers: int = 2, heads: int = 4, lr: float = 1e-3,
                 eps_low: float = 0.2, eps_high: float = 0.28, epochs: int = 1, *, alphabet: str = ALPHABET,
                 prompt_len: int = PROMPT_LEN, answer_len: int = arith.ANSWER_LEN, answer_chars: str | None = None,
                 eos: bool = False, unknown: str | None = None, device: str | torch.device = "cpu"):
        self.alphabet, self.prompt_len, self.answer_len, self.eos = alphabet, prompt_len, answer_len, eos
        self.stoi = {c: i for i, c in enumerate(alphabet)}
        self.eos_id = len(alphabet) if eos else None
        vocab = len(alphabet) + int(eos)
        self.unknown = self.stoi[unknown] if unknown is not None else None
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads,
                                 ctx=prompt_len + answer_len + int(eos)).to(self.device)
        self.allowed = None
        if answer_chars is not None:
            # a large finite offset, not -inf: prompt positions (never sampled) keep finite log-probs and gradients
            self.allowed = torch.full((vocab,), -1e4, device=self.device)
            self.allowed[[self.stoi[c] for c in answer_chars] + ([self.eos_id] if eos else [])] = 0.0
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.eps_low, self.eps_high, self.epochs = eps_low, eps_high, epochs

    def _prompt_ids(self, prompt: str) -> list[int]:
        ids = [self.stoi.get(c, self.unknown) for c in prompt[-self.prompt_len:]]
        if any(i is None for i in ids):
            raise ValueError(f"prompt {prompt!r} has characters outside the policy's alphabet")
        pad = self.stoi.get(" ", 0)
        return [pad] * (self.prompt_len - len(ids)) + ids

    def _completion_ids(self, text: str) -> list[int]:
        ids = [self.stoi[c] for c in text]
        return ids + [self.eos_id] if self.eos and len(text) < self.answer_len else ids

    def _logits(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        return logits + self.allowed if self.allowed is not None else logits

    @torch.no_grad()
    def generate(self, prompts: list[str], g: int, length: int | None = None,
                 temperature: float = 1.0) -> list[list[str]]:
        """``g`` sampled completions of up to ``length`` characters for each prompt."""
        self.model.eval()
        length = self.answer_len if length is None else length
        idx = torch.tensor([self._prompt_ids(p) for p in prompts], dtype=torch.long).repeat_interleave(g, 0)
        idx = idx.to(self.device)
        for _ in range(length):
            logits = self._logits(idx)[:, -1, :] / temperature
            probs = F.softmax(logits.float(), -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=self.generator).to(self.device)
            idx = torch.cat([idx, nxt], 1)
        texts = []
        for row in idx[:, self.prompt_len:].tolist():
            if self.eos_id is not None and self.eos_id in row:
                row = row[:row.index(self.eos_id)]
            texts.append("".join(self.alphabet[t] for t in row))
        return [texts[i * g:(i + 1) * g] for i in range(len(prompts))]

    def _logprobs(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self._logits(idx[:, :-1])
        return torch.gather(F.log_softmax(logits, -1), 2, idx[:, 1:, None])[..., 0]

    def step(self, groups: list[Group]) -> dict:
        """One GRPO update on the informative groups; returns what it did."""
        groups = [grp for grp in groups if grp.informative]
        if not groups:
            return {"groups": 0, "loss": 0.0}
        rows, advs, lens = [], [], []
        for grp in groups:
            for text, adv in zip(grp.completions, advantages(grp.rewards)):
                completion = self._completion_ids(text)
                rows.append(self._prompt_ids(grp.prompt) + completion)
                advs.append(adv)
                lens.append(len(completion))
        width = max(len(r) for r in rows)
        idx = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)
        # completion tokens are predicted at positions prompt_len-1 .. prompt_len+len-2 of the shifted sequence
        pos = torch.arange(width - 1, device=self.device)[None, :]
        start = self.prompt_len - 1
        mask = ((pos >= start) & (pos < start + torch.tensor(lens, device=self.device)[:, None])).float()
        adv = torch.tensor(advs, device=self.device)[:, None]
        self.model.eval()  # no dropout in TinyGPT; eval keeps old and new log-probs comparable
        with torch.no_grad():
            old = self._logprobs(idx)
        for _ in range(self.epochs):
            value = loss(self._logprobs(idx), old, adv, mask, self.eps_low, self.eps_high)
            self.opt.zero_grad(set_to_none=True)
            value.backward()
            self.opt.step()
        return {"groups": len(groups), "loss": value.item()}
