"""One line for a Lightning ``Trainer``: ``callbacks=[swarmd.DiLoCoLightningCallback(node, run=..., sync_every=...)]``.

The callback enters a :class:`swarmd.DiLoCo` around the LightningModule and the optimizer Lightning configured for
it when ``fit`` starts, and leaves it when ``fit`` ends (or fails). The inner steps are the optimizer's own steps, as
for any :class:`swarmd.DiLoCo`: the run's hook sits on the optimizer, so a step is counted where Lightning really
steps it. Gradient accumulation (``accumulate_grad_batches``) needs nothing more: the batches of one window make
one step. A step that mixed precision skips (a gradient that overflowed) is not a step either. Training stops once
``rounds`` rounds have closed. Imported on first use of ``swarmd.DiLoCoLightningCallback`` (it needs ``lightning``:
``pip install swarmd[lightning]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from swarmd.embedded import Node
from swarmd.training import DiLoCo, check_arguments

NAME = "swarmd.DiLoCoLightningCallback"


class DiLoCoLightningCallback(Callback):
    """Turns an ordinary Lightning ``Trainer.fit`` into a DiLoCo peer of ``run`` on ``node``.

    Args are :class:`swarmd.DiLoCo`'s, less the model and the optimizer, which are the LightningModule and the one
    optimizer its ``configure_optimizers`` returns; they are checked here, as ``DiLoCo`` checks them. The run is
    the ``fit`` call: a peer that stops early (``max_steps``) leaves the run with a checkpoint, and resumes from it
    when ``fit`` runs again with the same data dir. One process per peer: a trainer that spreads one peer over
    several devices or nodes is refused.

    The run's training loss is the ``loss`` the training steps return, at the steps the trainer logs
    (``log_every_n_steps``), averaged over the batches of each accumulation window.
    """

    def __init__(self, node: Node, *, run: str, sync_every: int, fragments: int = 1, overlap: int = 0,
                 rounds: int = 0, evaluate: Callable[[torch.nn.Module], float] | None = None,
                 settings: Mapping[str, Any] | None = None, start_timeout: float | None = None):
        settings = check_arguments(NAME, node, run=run, sync_every=sync_every, fragments=fragments, overlap=overlap,
                                   rounds=rounds, evaluate=evaluate, settings=settings)
        self.node = node
        self.arguments = dict(run=run, sync_every=sync_every, fragments=fragments, overlap=overlap, rounds=rounds,
                              evaluate=evaluate, settings=settings, start_timeout=start_timeout)
        self.diloco: DiLoCo | None = None
        self._losses: list[torch.Tensor] = []  # the window's batch losses, detached (read once per logged step)
        self._steps_seen = 0  # the trainer's global_step at the last batch end
        self._inside = False  # entered the run, not left it yet

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.diloco = None
        if trainer.world_size > 1:
            raise ValueError(f"{NAME}: the trainer runs {trainer.world_size} processes; a peer is one process "
                             "(devices=1, num_nodes=1), and the swarm is the other peers")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"{NAME}: configure_optimizers gave {len(trainer.optimizers)} optimizers; a DiLoCo "
                             "peer steps one, over the module's parameters")
        try:
            self.diloco = DiLoCo(self.node, model=pl_module, inner_optimizer=trainer.optimizers[0],
                                 **self.arguments)
        except (TypeError, ValueError) as e:  # the module and its optimizer, as DiLoCo found them
            raise type(e)(f"{NAME}: {str(e).removeprefix('swarmd.DiLoCo: ')}") from None
        self._losses, self._steps_seen = [], trainer.global_step
        self.diloco.__enter__()  # where it fails, it has left the run already
        self._inside = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.diloco is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # automatic optimization divides each batch's loss by the window's length before it is returned
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self._losses.append(loss.detach() * scale)
        if trainer.global_step != self._steps_seen:  # the optimizer stepped at this batch
            self._steps_seen = trainer.global_step
            if self._losses and trainer.global_step % trainer.log_every_n_steps == 0:
                self.diloco.report_loss(torch.stack(self._losses).float().mean())
            self._losses = []
        if self.diloco.done:
            trainer.should_stop = True  # every round of the run closed

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._leave()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._leave()  # as a ``with DiLoCo(...)`` block left by an exception: the round under way ends, saved

    def _leave(self) -> None:
        if self._inside:
            self._inside = False
            self.diloco.__exit__(None, None, None)
