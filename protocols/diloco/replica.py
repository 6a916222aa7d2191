"""Our replica of the model: the task's model on our device, its trainable parameters, the inner optimizer over
them, our data, and the outer optimizer over the fragments' global weights (built with the model: ``_build``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from swarmd.protocols import outer
from swarmd.protocols.diloco.fragment import Fragment


class Replica:
    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.names: list[str] = []  # the trainable parameters' names
        self.params: list[torch.Tensor] = []  # and the tensors
        self.inner_opt: torch.optim.Optimizer | None = None
        self.outer_opt: outer.OuterNesterov | None = None  # one momentum buffer a fragment
        self.data: Iterator | None = None  # our shard's batches

    def of(self, frag: Fragment) -> list[torch.Tensor]:
        """Our parameters of fragment ``frag``, in its order."""
        return [self.params[i] for i in frag.params]
