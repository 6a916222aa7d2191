"""A procedurally generated, verifiable task family for RL post-training (the SAPO loop's default task).

A question is fully determined by a *task spec* ``(generator id, version, seed, index)``: anyone can regenerate the
question and its exact answer from the spec, so a peer never has to be trusted with ground truth. The family has
four specialties over single digits a, b, c, with a two-digit answer (``docs/loops/sapo.md``), so a random
policy is right about 1% of the time (a sparse reward, the regime where sharing rollouts helps):

    A: a + b          B: a * b mod 100          C: |a - b| + c          D: a + b + c

Text form (what travels between peers): the prompt is ``"<task><a><b><c>="`` (e.g. ``"B794="``) and a completion is
the answer's characters (e.g. ``"63"``). Each peer tokenizes text with its own tokenizer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

GENERATOR = "arith"
VERSION = 1
TASKS = "ABCD"
DIGITS = "0123456789"
ANSWER_LEN = 2


@dataclass(frozen=True)
class Question:
    prompt: str
    answer: str


def _digits(seed: int, index: int) -> tuple[int, int, int, int]:
    h = hashlib.blake2b(f"{GENERATOR}/{VERSION}/{seed}/{index}".encode(), digest_size=8).digest()
    return h[0] % len(TASKS), h[1] % 10, h[2] % 10, h[3] % 10


def solve(task: int, a: int, b: int, c: int) -> int:
    if task == 0:
        return a + b
    if task == 1:
        return (a * b) % 100
    if task == 2:
        return abs(a - b) + c
    return a + b + c


def question(seed: int, index: int) -> Question:
    """The question of a spec, regenerated exactly (a pure function of ``seed`` and ``index``)."""
    task, a, b, c = _digits(seed, index)
    return Question(f"{TASKS[task]}{a}{b}{c}=", f"{solve(task, a, b, c):0{ANSWER_LEN}d}")


def reward(q: Question, completion: str) -> float:
    """Binary exact match of the completion against the regenerated answer."""
    return 1.0 if completion == q.answer else 0.0
