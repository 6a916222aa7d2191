"""SAPO on reasoning-gym (the procedural reasoning tasks with verifiable answers that rl-swarm trains on).

A question is named by ``(dataset, seed, index)``: every receiver regenerates it with ``reasoning_gym.create_dataset``
(the dataset's config comes from the run's task options, so every peer of a run has the same) and scores a
completion with the dataset's own ``score_answer``. No answer travels on the wire.

The policy is a tiny character-level transformer trained from scratch (no weights can be downloaded here): it reads
the last ``prompt_len`` characters of the question and writes up to ``answer_len`` characters from ``answer_chars``
(digits and '-' by default: the answer format of the arithmetic datasets), ending with an end-of-text token.
"""

from __future__ import annotations

import functools
import json
import string
from dataclasses import dataclass

from swarmd.protocols import grpo

DEFAULT_DATASETS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
}
ALPHABET = "".join(c for c in string.printable if c.isprintable()) + "\u25a1"  # printable ASCII + 'unknown'
UNKNOWN = "\u25a1"


@dataclass
class Question:
    prompt: str
    entry: dict
    dataset: object


class RgymPolicy:
    def __init__(self, seed: int, opts: dict, device: str):
        self.policy = grpo.Policy(seed, d=opts["d"], layers=opts["layers"], heads=opts["heads"], lr=opts["lr"],
                                  epochs=opts["epochs"], alphabet=ALPHABET, prompt_len=opts["prompt_len"],
                                  answer_len=opts["answer_len"], answer_chars=opts["answer_chars"], eos=True,
                                  unknown=UNKNOWN, device=device)
        self.model = self.policy.model
        self.temperature = opts["temperature"]

    def generate(self, prompts: list[str], g: int) -> list[list[str]]:
        return self.policy.generate(prompts, g, temperature=self.temperature)

    def step(self, groups) -> dict:
        return self.policy.step(groups)


class Environment:
    """reasoning-gym datasets as a SAPO environment: questions regenerated from (dataset, seed, index), scored by the
    dataset's own ``score_answer`` (also the environment of ``protocols.tasks.hf_policy``'s transformers policy)."""

    def __init__(self, datasets: dict):
        import reasoning_gym

        self._rg = reasoning_gym
        unknown = sorted(set(datasets) - set(reasoning_gym.factory.DATASETS))
        if unknown:
            raise ValueError(f"unknown reasoning-gym datasets: {', '.join(unknown)}")
        for name, config in datasets.items():
            reasoning_gym.create_dataset(name, seed=0, size=1, **config)  # a bad config fails here, at start
        self.configs = datasets
        self.datasets = sorted(datasets)
        self.environment = f"reasoning-gym {reasoning_gym.__version__} " + json.dumps(datasets, sort_keys=True)

    @functools.lru_cache(maxsize=256)
    def _dataset(self, name: str, seed: int, size: int):
        return self._rg.create_dataset(name, seed=seed, size=size, **self.configs[name])

    def question(self, dataset: str, seed: int, index: int) -> Question:
        if dataset not in self.configs:
            raise ValueError(f"{dataset!r} is not one of this run's datasets")
        # one dataset object per (seed, block of 64 indices): reasoning-gym derives item i from (seed, i)
        ds = self._dataset(dataset, seed, (index // 64 + 1) * 64)
        entry = ds[index]
        return Question(entry["question"], entry, ds)

    def score(self, q: Question, completion: str) -> float:
        return float(q.dataset.score_answer(completion, q.entry))

    def reference(self, q: Question) -> str:
        """The dataset's own answer (for a policy's supervised warm-up on its own questions, never from the wire)."""
        return str(q.entry["answer"])


def datasets_table(datasets: dict | list | None) -> dict:
    """``datasets`` as {name: config}: a list of names gets reasoning-gym's default configs; None the default."""
    if datasets is None:
        datasets = DEFAULT_DATASETS
    if isinstance(datasets, list):
        datasets = {name: {} for name in datasets}
    if not isinstance(datasets, dict) or not datasets:
        raise ValueError("datasets must be a table {name = {config}} or a list of names")
    return {k: dict(v) for k, v in datasets.items()}


class ReasoningGymTask(Environment):
    def __init__(self, datasets: dict, opts: dict):
        super().__init__(datasets)
        if not set(opts["answer_chars"]) <= set(ALPHABET):
            raise ValueError("answer_chars must be printable ASCII")
        self.opts = opts
        self.max_completion = opts["answer_len"]

    def valid_completion(self, text: str) -> bool:
        return set(text) <= set(self.opts["answer_chars"])

    def policy(self, seed: int, device: str = "cpu") -> RgymPolicy:
        return RgymPolicy(seed, self.opts, device)


def make_task(datasets: dict | list | None = None, d: int = 64, layers: int = 2, heads: int = 4, lr: float = 1e-3,
              epochs: int = 1, temperature: float = 1.0, prompt_len: int = 64, answer_len: int = 3,
              answer_chars: str = "0123456789-") -> ReasoningGymTask:
    """``datasets``: {name: config} (or a list of names with reasoning-gym's default configs); by default two
    small arithmetic datasets, chain_sum and products over single digits."""
    datasets = datasets_table(datasets)
    if d % heads or not (8 <= d <= 1024 and 1 <= layers <= 12 and 1 <= prompt_len <= 512 and 1 <= answer_len <= 64):
        raise ValueError("need d a multiple of heads, 8 <= d <= 1024, 1 <= layers <= 12, 1 <= prompt_len <= 512, "
                         "1 <= answer_len <= 64")
    opts = dict(d=d, layers=layers, heads=heads, lr=lr, epochs=epochs, temperature=temperature,
                prompt_len=prompt_len, answer_len=answer_len, answer_chars=answer_chars)
    return ReasoningGymTask(datasets, opts)
