"""A ``verifiers`` environment (Prime Intellect's: what prime-rl and the Environments Hub use) as a SAPO environment.

The environment is named by its module (``env = "verifiers:my_env"``, with ``env_args`` as the keyword arguments of
its ``load_environment()``), the interface of a single-turn ``verifiers`` environment: ``load_environment(**args)``
returns an object with

- ``dataset`` (or ``get_dataset()``): rows (a ``datasets.Dataset`` or a list of dicts) with ``question`` (text) or
  ``prompt`` (chat messages), and ``answer`` / ``info`` / ``task`` passed on to the reward functions;
- ``rubric``: reward functions (``rubric.funcs`` or ``rubric.get_reward_funcs()``) and their weights
  (``rubric.weights`` or ``get_reward_weights()``, default 1 each), each called with the keyword arguments it names
  among ``prompt, completion, answer, state, task, info, parser`` (plain functions or coroutines);
- ``system_prompt``, ``parser`` and ``message_type`` (``"chat"``: completions passed as assistant messages) where
  the environment has them.

Nothing of ``verifiers`` is imported here: an environment module written for it works (``vf.SingleTurnEnv`` with a
``vf.Rubric``: tested with verifiers 0.3.1, the ``verifiers`` extra; 0.4 moved environments to its v1 taskset,
harness and trace stack, which this does not load), and so does one that only follows the interface. Reward functions
of weight 0 are the environment's metrics and are not called.
The module is named in the run's config by its operator, like a task module; nothing from the wire chooses code.

A question of a round is ``(name, seed, index)``: the row ``blake2b(seed, index) mod len(dataset)``, looked up by
every receiver in its own copy of the dataset (the dataset's hash is part of the run's fingerprint, so peers whose
copies differ are told at the start). A completion's reward is the rubric's weighted sum divided by the sum of the
weights, clamped to [0, 1] (SAPO's rewards are in [0, 1]).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import inspect
import json
from dataclasses import dataclass, field

MAX_ROWS = 1_000_000
REWARD_ARGS = ("prompt", "completion", "answer", "state", "task", "info", "parser")


@dataclass
class Question:
    prompt: str  # the user's message (the policy applies its own chat template)
    row: dict
    system: str | None = None
    messages: list = field(default_factory=list)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else '(no message)'}"


def _members(obj, names: tuple[str, ...]):
    """The first of ``names`` that is a non-empty attribute or a method returning one (a verifiers RubricGroup has
    empty ``funcs`` and its rubrics' functions behind ``_get_reward_funcs()``)."""
    for name in names:
        value = getattr(obj, name, None)
        if callable(value) and not isinstance(value, (list, tuple)):
            value = value()
        if value is not None and (not isinstance(value, (list, tuple)) or len(value)):
            return value
    return None


class Environment:
    def __init__(self, module: str, args: dict):
        if not module or not all(part.isidentifier() for part in module.split(".")):
            raise ValueError(f"verifiers environment {module!r}: expected a module name (my_env or package.my_env)")
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            raise ValueError(f"verifiers environment {module!r} cannot be imported: {_one_line(e)}") from None
        load = getattr(mod, "load_environment", None)
        if not callable(load):
            raise ValueError(f"verifiers environment {module!r} has no load_environment()")
        try:
            env = load(**args)
        except Exception as e:
            raise ValueError(f"verifiers environment {module!r}: load_environment() raised {_one_line(e)}") from None
        self.name = module.rsplit(".", 1)[-1][:64]
        self.datasets = [self.name]
        self.rows = self._rows(module, env)
        self.system_prompt = getattr(env, "system_prompt", None)
        self.parser = getattr(env, "parser", None)
        self.chat = getattr(env, "message_type", "chat") == "chat"
        rubric = getattr(env, "rubric", None)
        funcs = _members(rubric, ("funcs", "get_reward_funcs", "_get_reward_funcs")) if rubric is not None else None
        if not funcs or not all(callable(f) for f in funcs):
            raise ValueError(f"verifiers environment {module!r}: its rubric has no reward functions")
        weights = _members(rubric, ("weights", "get_reward_weights", "_get_reward_weights")) or [1.0] * len(funcs)
        if len(weights) != len(funcs) or not sum(float(w) for w in weights) > 0:
            raise ValueError(f"verifiers environment {module!r}: {len(weights)} weights for {len(funcs)} reward "
                             "functions, or weights that do not sum above 0")
        # weight 0: a metric the environment logs (turns, say), not part of the reward
        kept = [(f, float(w)) for f, w in zip(funcs, weights) if float(w) != 0]
        self.funcs, self.weights = [f for f, _ in kept], [w for _, w in kept]
        self.parser = getattr(rubric, "parser", None) or self.parser
        digest = hashlib.blake2b(json.dumps(self.rows, sort_keys=True, default=str).encode(), digest_size=8)
        self.environment = f"verifiers {module} {json.dumps(args, sort_keys=True)} rows {len(self.rows)} " \
                           f"{digest.hexdigest()}"
        q = self.question(self.name, 0, 0)  # a rubric that raises or returns junk fails here, at start
        self.score(q, self.reference(q))

    def _rows(self, module: str, env) -> list[dict]:
        data = _members(env, ("dataset", "get_dataset"))
        if data is None:
            raise ValueError(f"verifiers environment {module!r} has no dataset")
        try:
            n = len(data)
        except TypeError:
            raise ValueError(f"verifiers environment {module!r}: its dataset has no length") from None
        if not 0 < n <= MAX_ROWS:
            raise ValueError(f"verifiers environment {module!r}: {n} rows (1..{MAX_ROWS})")
        rows = [dict(data[i]) for i in range(n)]
        for i, row in enumerate(rows):
            if not isinstance(row.get("question"), str) and not isinstance(row.get("prompt"), list):
                raise ValueError(f"verifiers environment {module!r}: row {i} has neither a question nor a prompt")
        return rows

    def question(self, dataset: str, seed: int, index: int) -> Question:
        if dataset != self.name:
            raise ValueError(f"{dataset!r} is not this run's environment")
        h = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
        row = self.rows[int.from_bytes(h, "big") % len(self.rows)]
        system, messages = self.system_prompt, []
        if isinstance(row.get("question"), str):
            text = row["question"]
        else:
            messages = [m for m in row["prompt"] if isinstance(m, dict)]
            users = [m for m in messages if m.get("role") == "user"]
            text = str(users[-1].get("content", "")) if users else ""
            system = next((str(m.get("content")) for m in messages if m.get("role") == "system"), system)
        return Question(text, row, system, messages)

    def reference(self, q: Question) -> str:
        return str(q.row.get("answer", ""))

    def score(self, q: Question, completion: str) -> float:
        prompt = q.messages or ([{"role": "system", "content": q.system}] if q.system else []) + [
            {"role": "user", "content": q.prompt}]
        args = {"prompt": prompt if self.chat else q.prompt,
                "completion": [{"role": "assistant", "content": completion}] if self.chat else completion,
                "answer": q.row.get("answer", ""), "state": {}, "task": q.row.get("task", "default"),
                "info": q.row.get("info", {}), "parser": self.parser}
        total = 0.0
        for func, weight in zip(self.funcs, self.weights):
            value = _call(func, args)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"reward function {getattr(func, '__name__', func)!r} returned {value!r}, "
                                 "expected a number")
            total += weight * float(value)
        return min(1.0, max(0.0, total / sum(self.weights)))


def _call(func, args: dict):
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        params = {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = args
    else:
        kwargs = {k: v for k, v in args.items() if k in params}
    value = func(**kwargs)
    if inspect.isawaitable(value):  # verifiers' reward functions may be coroutines
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a worker thread (the loop scores there): no loop of ours to block
            return asyncio.run(_await(value))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called on an event loop: not on that one
            return pool.submit(asyncio.run, _await(value)).result()
    return value


async def _await(value):
    return await value
