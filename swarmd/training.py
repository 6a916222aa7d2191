"""Training runs a script attaches to a node: DiLoCo around the script's own loop, and the task-driven loops.

``DiLoCo`` is the loop ``swarmd start`` runs for ``[loops.diloco]`` (protocols/diloco.py), with one difference: the
inner steps are the script's. A hook on the script's optimizer hands each step to the loop, which announces
updates, closes rounds and writes the combined weights into the model between two steps, as it does between two of
its own (protocols/steps.py). Everything else (Streaming fragments and overlap, codecs, the exchange's choice,
robust combination and audits, deadlines, late join from a peer's checkpoint, resync, fingerprints, checkpoints and
resume) is the loop's own, set through ``settings`` with the names and checks of ``[loops.diloco]``.

``TaskRun`` (``SPSA``, ``SAPO``) runs a task-driven loop, as ``[loops.spsa]`` or ``[loops.sapo]`` would, with the
task given as an object (the contract of protocols/task.py) or a spec string.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from swarmd.protocols import task as tasks
from swarmd.protocols.diloco import DilocoConfig, DilocoLoop
from swarmd.protocols.steps import UserSteps
from swarmd.embedded import Node, NodeError

logger = logging.getLogger(__name__)

# what the script gives by argument, never through ``settings``
OWN_ARGUMENTS = {"run": "run", "inner_steps": "sync_every", "fragments": "fragments", "overlap": "overlap",
                 "rounds": "rounds", "task": "model", "task_options": "model", "device": "model",
                 "threads": "the script's torch.set_num_threads"}
# the loop's own inner optimizer and data: the script's optimizer, schedule and batches stand in their place
SCRIPT_OWNS = ("inner_optimizer", "inner_lr", "inner_betas", "weight_decay", "lr_schedule", "warmup_steps",
               "lr_final")
LEAVE_TIMEOUT = 120.0  # seconds for the loop to finish its round and save a checkpoint when the script leaves
# seconds a refusal (peers seen, none training what we train) must last before the script is told: the run's own
# peers may still be on their way while a peer of another run is already here
REFUSAL_GRACE = 10.0


class SwarmError(RuntimeError):
    """The run cannot go on: the loop failed, or the swarm refused this peer (another model, say). One line."""


class _ScriptTask:
    """The task seam (protocols/task.py) for a script's own model and optimizer: the loop takes them as they are;
    batches and the loss stay in the script."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 evaluate: Callable[[torch.nn.Module], float] | None):
        self._model, self._optimizer = model, optimizer
        self.evaluate = evaluate  # None: the run reports the mean training loss the script reports instead

    def model(self) -> torch.nn.Module:
        return self._model

    def optimizer(self, params) -> torch.optim.Optimizer:
        return self._optimizer


def _check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    foreign = len(stepped - trainable)
    if foreign:
        raise ValueError(f"swarmd.DiLoCo: inner_optimizer steps {foreign} tensor(s) that are not the model's "
                         "trainable parameters (build it from model.parameters())")
    missing = len(trainable - stepped)
    if missing:
        raise ValueError(f"swarmd.DiLoCo: {missing} trainable parameter(s) of the model are not in inner_optimizer "
                         "(build it from model.parameters(), or set requires_grad=False on what stays fixed)")


def _validated(cls: type[BaseModel], fields: dict, what: str) -> BaseModel:
    try:
        return cls(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting (check the spelling)"
        raise ValueError(f"{what}: {field}: {msg}" if field else f"{what}: {msg}") from None  # a check of several


def check_arguments(what: str, node: Node, *, run: str, sync_every: int, fragments: int, overlap: int, rounds: int,
                    evaluate: Callable[[torch.nn.Module], float] | None, settings: Mapping[str, Any] | None) -> dict:
    """The checks of a DiLoCo run's arguments that need no model (a trainer callback makes them when it is built,
    long before the trainer hands it the model); returns ``settings`` as a dict. ``what`` names the caller in the
    one-line errors."""
    if not isinstance(node, Node):
        raise TypeError(f"{what}: node must be a swarmd.Node, not {type(node).__name__}")
    for name, value, low in (("sync_every", sync_every, 1), ("fragments", fragments, 1), ("overlap", overlap, 0),
                             ("rounds", rounds, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{what}: {name} must be an integer >= {low}, not {value!r}")
    if overlap >= sync_every:
        raise ValueError(f"{what}: overlap ({overlap}) must be below sync_every ({sync_every})")
    if evaluate is not None and not callable(evaluate):
        raise TypeError(f"{what}: evaluate must be a function evaluate(model) -> float")
    settings = dict(settings or {})
    for key in settings:
        if key in SCRIPT_OWNS:
            raise ValueError(f"{what}: settings[{key!r}] is the script's own: set it on the inner optimizer "
                             "(or a scheduler of yours)")
        if key in OWN_ARGUMENTS:
            raise ValueError(f"{what}: settings[{key!r}] is given by the argument {OWN_ARGUMENTS[key]!r}, not "
                             "through settings")
    # the settings' names and values, checked now (the model's own fields are checked once there is a model)
    _validated(DilocoConfig, {"run": run, "inner_steps": sync_every, "fragments": fragments, "overlap": overlap,
                              "rounds": rounds, **settings}, what)
    return settings


def _model_device(model: torch.nn.Module) -> str:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(f"swarmd.DiLoCo: the model's parameters are on {len(devices)} devices; one is supported")
    device = devices.pop()
    return device.type if device.index is None or device.type != "cuda" else f"cuda:{device.index}"


class DiLoCo:
    """A DiLoCo (or Streaming DiLoCo) peer around the script's own training loop.

    Args:
        node: the :class:`swarmd.Node` to run on (started on entering, if it was not).
        run: the run's name; peers of one run train one model together.
        model: the model the script trains (its weights become the swarm's at each sync).
        inner_optimizer: the script's optimizer over ``model.parameters()``; its ``step()`` is the inner step.
        sync_every: inner steps between two syncs of each fragment (H).
        fragments: Streaming DiLoCo's fragments (1: plain DiLoCo).
        overlap: inner steps a fragment's update travels while training goes on (Streaming DiLoCo's tau).
        rounds: outer rounds, after which the run is done (0: until the script leaves).
        evaluate: ``evaluate(model) -> float``, the validation loss reported each round (optional).
        settings: any other ``[loops.diloco]`` setting by name (``codec``, ``exchange``, ``outer_lr``,
            ``min_peers``, ``checkpoint_every``...); unknown names and bad values raise ``ValueError``.
        start_timeout: seconds entering may wait for the run to start (the start barrier waits for
            ``min_peers``); None waits as long as it takes.

    Use it as a context manager around the loop; inside, :attr:`done` turns True once ``rounds`` rounds closed.
    Leaving the block ends this peer's part in the run: the loop finishes the round under way, saves a
    checkpoint, and a later run of the same script resumes from it.
    """

    def __init__(self, node: Node, *, run: str, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, fragments: int = 1, overlap: int = 0, rounds: int = 0,
                 evaluate: Callable[[torch.nn.Module], float] | None = None,
                 settings: Mapping[str, Any] | None = None, start_timeout: float | None = None):
        settings = check_arguments("swarmd.DiLoCo", node, run=run, sync_every=sync_every, fragments=fragments,
                                   overlap=overlap, rounds=rounds, evaluate=evaluate, settings=settings)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"swarmd.DiLoCo: model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError("swarmd.DiLoCo: inner_optimizer must be a torch.optim.Optimizer, not "
                            f"{type(inner_optimizer).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("swarmd.DiLoCo: the model has no trainable parameters")
        _check_optimizer(model, inner_optimizer)
        self.config: DilocoConfig = _validated(DilocoConfig, {
            "run": run, "inner_steps": sync_every, "fragments": fragments, "overlap": overlap, "rounds": rounds,
            # the layout and these settings make the run's fingerprint: peers with another model are refused
            "task": f"script:{type(model).__qualname__}", "device": _model_device(model),
            "threads": torch.get_num_threads(), **settings}, "swarmd.DiLoCo")
        self.node = node
        self.model, self.optimizer = model, inner_optimizer
        self.start_timeout = start_timeout
        self._steps = UserSteps()
        task = tasks.Task(_ScriptTask(model, inner_optimizer, evaluate), self.config.task, {}, tasks.DILOCO)
        self.loop = DilocoLoop(node.gossip, node.bulk, self.config, task)
        self.loop.user_steps = self._steps
        self._hook = None
        self._entered = False
        self._refused_since: float | None = None
        self._started = False  # the loop let the script take its first step

    # ------------------------------------------------------------------ the run's life
    def __enter__(self) -> DiLoCo:
        if self._entered:
            raise RuntimeError("swarmd.DiLoCo: a run is entered once; make a new DiLoCo to run again")
        self._entered = True
        self.node.attach(self.loop)
        self.node.start()
        self._hook = self.optimizer.register_step_post_hook(lambda *_: self._after_step())
        try:
            started = self._steps.wait_released(self._ended, timeout=self.start_timeout)
            self._started = started or self.loop.state in ("done", "left")
            if not started:
                self._raise_ended()
        except TimeoutError:
            self._leave()
            raise SwarmError(f"swarmd.DiLoCo: run {self.config.run!r} did not start within {self.start_timeout} s "
                             f"(the loop is {self.loop.state!r})") from None
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._steps.stop()
        if not self._started:
            return  # it never took a step: nothing to finish or save (the loop stays in its start barrier)
        until = time.monotonic() + LEAVE_TIMEOUT
        while self.loop.state not in ("left", "done", "failed") and self.node.running and time.monotonic() < until:
            time.sleep(0.05)

    def _after_step(self) -> None:
        if not self._steps.step_taken():
            return  # the run is over (done, left) or not started: the step stays the script's own
        if not self._steps.wait_released(self._ended):
            self._raise_ended()

    def _ended(self) -> str | None:
        """Why the run takes no more steps (None while it does)."""
        if not self.node.running:
            return "the node stopped"
        if self.loop.error:
            return self.loop.error
        if not self.loop.refused:
            self._refused_since = None
        elif self._refused_since is None:
            self._refused_since = time.monotonic()
        elif time.monotonic() - self._refused_since >= REFUSAL_GRACE:
            return self.loop.refused
        if self.loop.state in ("done", "left", "failed"):
            return self.loop.state
        return None

    def _raise_ended(self) -> None:
        reason = self._ended()
        if reason in ("done", "left"):
            return
        raise SwarmError(f"swarmd.DiLoCo: run {self.config.run!r} stopped: {reason}")

    # ------------------------------------------------------------------ what the script reads
    def report_loss(self, loss: float | torch.Tensor) -> None:
        """The training loss of the step under way (shown in /status; the round's mean is its loss where the run
        has no ``evaluate``)."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._steps.report_loss(value)

    @property
    def done(self) -> bool:
        """Every fragment closed ``rounds`` rounds (never, where ``rounds`` is 0)."""
        return self.loop.state == "done"

    @property
    def step(self) -> int:
        """The run's inner step count for this peer (resumed from its checkpoint after a restart)."""
        return self.loop.step

    @property
    def rounds_done(self) -> int:
        """Rounds every fragment has closed."""
        return min(self.loop.rounds_done) if self.loop.rounds_done else 0

    @property
    def final_hash(self) -> str | None:
        """The hash of the run's final global weights, once done (every peer that ends in the majority has it)."""
        return self.loop.final_hash

    def global_hash(self) -> str:
        """The hash of the current global weights (equal on every peer between two rounds)."""
        return self.loop.global_hash()

    def status(self) -> dict:
        """The loop's part of /status (state, round, step, exchange, losses, peers that count...)."""

        async def read() -> dict:
            return self.loop.status()

        return self.node.call(read())


class TaskRun:
    """A task-driven training loop on the node: ``loop`` is "diloco", "spsa" or "sapo", ``task`` an object that
    keeps the loop's task contract (protocols/task.py) or a spec string ("path/file.py:factory", a built-in name),
    ``settings`` the loop's ``[loops.<loop>]`` settings. Starts on entering (or :meth:`start`); :meth:`wait` blocks
    until the run is done."""

    def __init__(self, node: Node, loop: str, task: Any, *, run: str,
                 task_options: Mapping[str, Any] | None = None, settings: Mapping[str, Any] | None = None):
        from swarmd.node.cli import LOOPS

        if not isinstance(node, Node):
            raise TypeError(f"swarmd.{loop.upper()}: node must be a swarmd.Node, not {type(node).__name__}")
        if loop not in LOOPS:
            raise ValueError(f"unknown loop {loop!r} (known: {', '.join(sorted(LOOPS))})")
        import importlib

        module_name, config_cls, loop_cls = LOOPS[loop]
        module = importlib.import_module(module_name)
        spec = task if isinstance(task, str) else f"script:{type(task).__qualname__}"
        what = f"swarmd.{loop.upper() if loop != 'diloco' else 'TaskRun'}"
        self.config = _validated(getattr(module, config_cls),
                                 {"run": run, "task": spec, "task_options": dict(task_options or {}),
                                  **dict(settings or {})}, what)
        try:
            if isinstance(task, str):
                loaded = tasks.load(task, self.config.options(), loop)
            else:
                loaded = tasks.Task(task, spec, dict(task_options or {}), loop)
                tasks.check(loaded)
        except tasks.TaskError as e:
            raise ValueError(f"{what}: {e}") from None
        cls = getattr(module, loop_cls)
        self.node = node
        self.loop = cls(node.gossip, node.bulk, self.config, loaded) if loop == "diloco" \
            else cls(node.gossip, self.config, loaded)
        self._started = False

    def start(self) -> TaskRun:
        if not self._started:
            self._started = True
            self.node.attach(self.loop)
            self.node.start()
        return self

    def __enter__(self) -> TaskRun:
        return self.start()

    def __exit__(self, *exc) -> None:
        pass  # the loop runs as long as its node; the node's close ends it

    def wait(self, timeout: float | None = None) -> None:
        """Block until the run is done; raises SwarmError where it failed or was refused, TimeoutError after
        ``timeout`` seconds."""
        self.start()
        until = math.inf if timeout is None else time.monotonic() + timeout
        while self.loop.state != "done":
            if self.loop.error or self.loop.refused:
                raise SwarmError(f"run {self.config.run!r} stopped: {self.loop.error or self.loop.refused}")
            if not self.node.running:
                raise NodeError("the node stopped before the run was done")
            if time.monotonic() > until:
                raise TimeoutError(f"run {self.config.run!r} not done within {timeout} s (it is {self.loop.state!r})")
            time.sleep(0.1)

    @property
    def done(self) -> bool:
        return self.loop.state == "done"

    def status(self) -> dict:
        async def read() -> dict:
            return self.loop.status()

        return self.node.call(read())


def SPSA(node: Node, task: Any, *, run: str, task_options: Mapping[str, Any] | None = None,  # noqa: N802
         settings: Mapping[str, Any] | None = None) -> TaskRun:
    """Seed-based SPSA (``[loops.spsa]``) on ``node`` with ``task`` (an object or a spec string)."""
    return TaskRun(node, "spsa", task, run=run, task_options=task_options, settings=settings)


def SAPO(node: Node, task: Any, *, run: str, task_options: Mapping[str, Any] | None = None,  # noqa: N802
         settings: Mapping[str, Any] | None = None) -> TaskRun:
    """SAPO rollout sharing (``[loops.sapo]``) on ``node`` with ``task`` (an object or a spec string)."""
    return TaskRun(node, "sapo", task, run=run, task_options=task_options, settings=settings)
