"""One line for a Hugging Face ``Trainer``: ``callbacks=[swarmd.DiLoCoCallback(node, run=..., sync_every=...)]``.

The callback enters a :class:`swarmd.DiLoCo` around the trainer's own model and optimizer when training begins and
leaves it when training ends; every optimizer step the trainer takes is an inner step of the run, and the losses
the trainer logs are the run's training loss. Imported on first use of ``swarmd.DiLoCoCallback`` (it needs
``transformers``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from swarmd.embedded import Node
from swarmd.training import DiLoCo, check_arguments


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that steps the parameters (accelerate wraps the trainer's in an AcceleratedOptimizer)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class DiLoCoCallback(TrainerCallback):
    """Turns an ordinary ``transformers.Trainer`` run into a DiLoCo peer of ``run`` on ``node``.

    Args are :class:`swarmd.DiLoCo`'s, less the model and the optimizer, which are the trainer's. The run is the
    trainer's ``train()`` call: a peer that stops early (``max_steps``) leaves the run with a checkpoint, and
    resumes from it when training starts again with the same data dir.
    """

    def __init__(self, node: Node, *, run: str, sync_every: int, fragments: int = 1, overlap: int = 0,
                 rounds: int = 0, evaluate: Callable[[torch.nn.Module], float] | None = None,
                 settings: Mapping[str, Any] | None = None, start_timeout: float | None = None):
        settings = check_arguments("swarmd.DiLoCoCallback", node, run=run, sync_every=sync_every,
                                   fragments=fragments, overlap=overlap, rounds=rounds, evaluate=evaluate,
                                   settings=settings)
        self.node = node
        self.arguments = dict(run=run, sync_every=sync_every, fragments=fragments, overlap=overlap, rounds=rounds,
                              evaluate=evaluate, settings=settings, start_timeout=start_timeout)
        self.diloco: DiLoCo | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise ValueError("swarmd.DiLoCoCallback: the trainer gave no model or optimizer at train begin")
        self.diloco = DiLoCo(self.node, model=model, inner_optimizer=_unwrapped(optimizer), **self.arguments)
        self.diloco.__enter__()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.diloco is not None and logs and isinstance(logs.get("loss"), (int, float)):
            self.diloco.report_loss(logs["loss"])

    def on_step_end(self, args, state, control, **kwargs):
        if self.diloco is not None and self.diloco.done:
            control.should_training_stop = True  # every round of the run closed
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
