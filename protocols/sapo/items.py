"""What a SAPO peer shares in a round, and how a receiver checks it: the messages and their limits, the question
seed of a peer's round (anyone can tell whether a spec is that peer's), and the re-scoring of completions with the
receiver's own verifier (no claimed answer or reward is ever on the wire)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from swarmd.protocols.grpo import Group
from swarmd.protocols.task import Task, TaskError
from swarmd.protocols.taskloop import TAG
from swarmd.transport.wire import WIRE, Bool, Int, List, Map, Str, Tuple

if TYPE_CHECKING:
    from swarmd.protocols.sapo.config import SapoConfig

MAX_ITEMS = 64  # questions per message
MAX_COMPLETIONS = 32  # completions per question
MAX_COMPLETION_CHARS = 1024  # the most a task may allow (its max_completion)

CARRIER = "sapo/<run>"  # the run's pubsub topic
_TAG = {"t": ["layout-hash", "config-hash"]}
_ITEM = Map.of(spec=Tuple.of(Str(64, min=1), Int(0), Int(0, MAX_ITEMS - 1)),
               comps=List(Str(MAX_COMPLETION_CHARS), MAX_COMPLETIONS, min=2))
ROLLOUTS = WIRE.message(CARRIER, 1, "sapo.rollouts", Map.of(r=Int(0), items=List(_ITEM, MAX_ITEMS, min=1), t=TAG),
                        {"r": 2, "items": [{"spec": ["chain_sum", 1234, 0], "comps": ["12", "13"]}], **_TAG},
                        max_size=8 * 1024 + MAX_ITEMS * (96 + MAX_COMPLETIONS * (4 * MAX_COMPLETION_CHARS + 5)),
                        doc="round r's questions (as specs any peer regenerates: dataset, the author's seed for r, "
                            "index) and my completions of each; never an answer or a reward")
READY = WIRE.message(CARRIER, 2, "sapo.ready", Map.of(r=Int(0, 0), ready=Bool(only=True), t=TAG),
                     {"r": 0, "ready": True, **_TAG}, max_size=256, doc="I am here and can start")

MAX_AUTHORS = 1024  # peers whose newest items we hold
ITEM_RATE, ITEM_BURST = 2.0, 8.0  # messages with new items per second one peer may send (a round takes seconds)


def question_seed(run: str, seed: int, peer_id: str, round_: int) -> int:
    """The generator seed of ``peer_id``'s questions in round ``round_`` (63 bits)."""
    h = hashlib.blake2b(f"{run}/{seed}/{peer_id}/{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


def _printable(text: str) -> bool:
    return text.isascii() and text.isprintable()


class Rules:
    """What a rollout message of this run may hold: the task's datasets, completion length and alphabet."""

    def __init__(self, task: Task, cfg: SapoConfig):
        self.datasets = frozenset(task.obj.datasets)
        self.max_completion = int(getattr(task.obj, "max_completion", None) or 64)
        if not 1 <= self.max_completion <= MAX_COMPLETION_CHARS:
            raise TaskError(f"task {task.spec}: max_completion must be 1..{MAX_COMPLETION_CHARS}")
        valid = getattr(task.obj, "valid_completion", None)
        self.valid = valid if valid is not None else _printable
        self.questions, self.completions = cfg.questions, cfg.completions
        self.max_message = 8 * 1024 + cfg.questions * (96 + cfg.completions * (4 * self.max_completion + 5))


def parse_items(body: object, *, run: str, seed: int, author: str, rules: Rules
                ) -> tuple[int, list[tuple[str, int, list[str]]]]:
    """Check a rollout message from the wire; returns ``(round, [(dataset, index, completions), ...])``.

    Raises ValueError (with the reason) on anything malformed, oversized or forged."""
    if not isinstance(body, dict) or set(body) != {"r", "items"}:
        raise ValueError("not a rollout message")
    r, items = body["r"], body["items"]
    if type(r) is not int or r < 0:
        raise ValueError("bad round")
    if not isinstance(items, list) or not 0 < len(items) <= rules.questions:
        raise ValueError(f"items must be a list of 1..{rules.questions}")
    expected_seed = question_seed(run, seed, author, r)
    out, seen = [], set()
    for item in items:
        if not isinstance(item, dict) or set(item) != {"spec", "comps"}:
            raise ValueError("an item must have exactly spec and comps")
        spec = item["spec"]
        if not (isinstance(spec, list) and len(spec) == 3 and spec[0] in rules.datasets and type(spec[1]) is int
                and type(spec[2]) is int and 0 <= spec[2] < MAX_ITEMS):
            raise ValueError("a spec must be [one of the run's datasets, seed, index < 64]")
        dataset, q_seed, index = spec
        if q_seed != expected_seed:
            raise ValueError("a spec that is not the author's for this round")
        if index in seen:
            raise ValueError("duplicate item")
        seen.add(index)
        comps = item["comps"]
        if not isinstance(comps, list) or not 2 <= len(comps) <= rules.completions:
            raise ValueError(f"comps must be a list of 2..{rules.completions}")
        for c in comps:
            if not isinstance(c, str) or len(c) > rules.max_completion or not rules.valid(c):
                raise ValueError("a completion is too long or outside the task's alphabet")
        out.append((dataset, index, comps))
    return r, out


def question(task: Task, dataset: str, q_seed: int, index: int):
    q = task.call("question", dataset, q_seed, index)
    if not isinstance(getattr(q, "prompt", None), str):
        raise TaskError(f"{task.where('question')} returned {type(q).__name__} without a text .prompt")
    return q


def score(task: Task, dataset: str, q_seed: int, index: int, comps: list[str]) -> Group:
    """Regenerate the question from its spec and score the completions with our verifier."""
    q = question(task, dataset, q_seed, index)
    return Group(q.prompt, comps, [reward(task, q, c) for c in comps])


def reward(task: Task, q, completion: str) -> float:
    value = task.call("score", q, completion)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise TaskError(f"{task.where('score')} returned {value!r}, expected a float in [0, 1]")
    return float(value)
