"""``Model``: the model a peer probes, as the task builds it on our device: its canonical weights (the perturbed
parameters), their names, and where its batches come from."""

from __future__ import annotations

import torch

from swarmd.protocols import task as tasks
from swarmd.protocols.spsa.weights import Weights
from swarmd.protocols.task import Task, TaskError


class Model:
    def __init__(self, task: Task, base_seed: int, weights: Weights, names: list[str], per_step: bool, data=None):
        self.task = task
        self.base_seed = base_seed  # (a batch by step is drawn from it, as the model was)
        self.weights = weights
        self.names = names  # the perturbed parameters' names, in the model's order (a checkpoint's keys)
        # the task draws batches by step (batch_at): any peer can draw another's batch for a step, so audits are
        # possible; otherwise our own stream (``data``)
        self.per_step = per_step
        self._data = data

    @classmethod
    def build(cls, task: Task, base_seed: int, device: torch.device, peer_id: str
              ) -> tuple[Model, list[tuple[str, torch.nn.Parameter]]]:
        """The task's model from ``base_seed`` on ``device``, and its perturbed parameters by name (every trainable
        one, or the ones the task's ``perturbed()`` names, in the model's order)."""
        model = tasks.build_model(task, base_seed)
        named = tasks.trainable(model)
        names = [n for n, _ in named]
        if task.has("perturbed"):
            chosen = task.call("perturbed", model)
            if not isinstance(chosen, (list, tuple)) or not chosen or any(n not in names for n in chosen):
                raise TaskError(f"{task.where('perturbed')} must return a non-empty list of trainable "
                                "parameter names")
            names = [n for n in names if n in set(chosen)]  # the model's order, whatever order it gave
        model = model.to(device).eval()
        by_name = dict(model.named_parameters())
        perturbed = [(n, by_name[n]) for n in names]
        weights = Weights(model, [p for _, p in perturbed],
                          loss=lambda batch: tasks.loss_value(task, model, tasks.to_device(batch, device)))
        per_step = task.has("batch_at")
        data = None if per_step else tasks.data_iter(task, tasks.shard_of(peer_id), base_seed)
        return cls(task, base_seed, weights, names, per_step, data), perturbed

    def batch(self, peer: str, step: int):
        """``peer``'s batch for ``step`` (by step), or the next of our stream."""
        if not self.per_step:
            return next(self._data)
        return self.task.call("batch_at", tasks.shard_of(peer), self.base_seed, step)

    def evaluate(self) -> float | None:
        return tasks.evaluate(self.task, self.weights.model)
