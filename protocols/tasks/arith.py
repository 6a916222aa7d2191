"""The arithmetic task (``protocols.arith``) and the tiny GRPO policy (``protocols.grpo``) as a SAPO task: the
fast one the tests use. Options are the policy's: its size, learning rate, GRPO epochs and sampling temperature."""

from __future__ import annotations

from swarmd.protocols import arith, grpo


class ArithPolicy:
    def __init__(self, seed: int, d: int, layers: int, heads: int, lr: float, epochs: int, temperature: float,
                 device: str):
        self.policy = grpo.Policy(seed, d=d, layers=layers, heads=heads, lr=lr, epochs=epochs, device=device)
        self.model = self.policy.model
        self.temperature = temperature

    def generate(self, prompts: list[str], g: int) -> list[list[str]]:
        return self.policy.generate(prompts, g, temperature=self.temperature)

    def step(self, groups) -> dict:
        return self.policy.step(groups)


class ArithTask:
    datasets = [arith.GENERATOR]
    environment = f"{arith.GENERATOR}/{arith.VERSION}"
    max_completion = grpo.MAX_COMPLETION

    def __init__(self, d: int, layers: int, heads: int, lr: float, epochs: int, temperature: float):
        if d % heads:
            raise ValueError(f"d ({d}) must be a multiple of heads ({heads})")
        if not (8 <= d <= 1024 and 1 <= layers <= 12 and 1 <= heads <= 16 and lr > 0 and 1 <= epochs <= 8
                and temperature > 0):
            raise ValueError("need 8 <= d <= 1024, 1 <= layers <= 12, 1 <= heads <= 16, lr > 0, 1 <= epochs <= 8, "
                             "temperature > 0")
        self.options = dict(d=d, layers=layers, heads=heads, lr=lr, epochs=epochs, temperature=temperature)

    def question(self, dataset: str, seed: int, index: int) -> arith.Question:
        return arith.question(seed, index)

    def score(self, q: arith.Question, completion: str) -> float:
        return arith.reward(q, completion)

    def valid_completion(self, text: str) -> bool:
        return grpo.tokenizable(text)

    def policy(self, seed: int, device: str = "cpu") -> ArithPolicy:
        return ArithPolicy(seed, device=device, **self.options)


def make_task(d: int = 64, layers: int = 2, heads: int = 4, lr: float = 1e-3, epochs: int = 1,
              temperature: float = 1.0) -> ArithTask:
    return ArithTask(d, layers, heads, lr, epochs, temperature)
