"""A fragment of the model and what it keeps from round to round (torchft's ``_StreamingDiLoCoFragment``): its
global weights, its round counters, the members of its last round, its error-feedback residual, the inputs of its
last close (for a redo), and why our update for its current round is withheld. ``Fragments`` holds them all, and
the global weights' hashes, computed once per change of any fragment's weights."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from swarmd.protocols import outer
from swarmd.protocols.diloco.pending import Redo


class Fragment:
    """One fragment's long-lived state (a round's own data lives on its ``Round``)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.params: list[int] = []  # the indices of its parameters among the model's trainable ones
        # its global (CPU, flat fp32) weights, once the model is built: replaced, never changed in place
        # (``Fragments.replace``)
        self.weights: torch.Tensor | None = None
        self.rounds_done = 0
        self.join_round = 0  # the first round we contribute to (a late joiner follows the ones before)
        self.participants: set[str] | None = None  # the participants of its last closed round (None: none yet)
        # {peer whose word counts: the last round it says it closed}; the swarm's round is their median
        self.closed_by: dict[str, int] = {}
        self.residual: torch.Tensor | None = None  # what the codec dropped of our last update (error feedback)
        self.residual_norm: float | None = None
        self.redo: Redo | None = None  # the inputs of its last close (all-to-all, within redo_bytes)
        self.skipped: str | None = None  # why our update for its current round is withheld

    def numel(self) -> int:
        return self.weights.numel()

    def last_members(self, initial: set[str]) -> set[str]:
        """Who closed its last round with us (``initial``, whom we started with, before any)."""
        return initial if self.participants is None else self.participants

    def drop_residual(self) -> None:
        self.residual, self.residual_norm = None, None


class Fragments:
    """The model's fragments, in order, and the hashes of their global weights (each computed once per change).
    They exist from the loop's start (the others' messages about them come before our model is built); their
    weights come with the model (``build``)."""

    def __init__(self, count: int) -> None:
        self._all = [Fragment(p) for p in range(count)]
        self.built = False
        self._version = 0  # bumped wherever a fragment's weights are replaced
        # fragment (None: all of them) -> (_version, the hash of its global weights)
        self._hashes: dict[int | None, tuple[int, str]] = {}

    def build(self, params: list[list[int]], weights: list[torch.Tensor]) -> None:
        for f, idx, w in zip(self._all, params, weights, strict=True):
            f.params, f.weights = list(idx), w
        self.built = True
        self._version += 1

    def __getitem__(self, p: int) -> Fragment:
        return self._all[p]

    def __iter__(self) -> Iterator[Fragment]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def weights(self) -> list[torch.Tensor]:
        return [f.weights for f in self._all]

    def rounds_done(self) -> list[int]:
        """Each fragment's closed rounds ([] before the model is built)."""
        return [f.rounds_done for f in self._all] if self.built else []

    def replace(self, p: int, new: torch.Tensor, h: str = "", hp: str = "") -> torch.Tensor:
        """Fragment p's weights become ``new`` (the old ones returned); ``h`` and ``hp``, where given, are the new
        hashes of all the weights and of fragment p's, so they become visible together with the weights."""
        before, self._all[p].weights = self._all[p].weights, new
        self._version += 1
        if h:
            self._hashes[None] = (self._version, h)
        if hp:
            self._hashes[p] = (self._version, hp)
        return before

    def replace_all(self, weights: list[torch.Tensor]) -> None:
        for f, w in zip(self._all, weights):
            f.weights = w
        self._version += 1

    def global_hash(self) -> str:
        """The hash of all the global weights (a round's close, its checks, and the status views, which poll it
        every few seconds), computed once per change of them."""
        return self._cached_hash(None)

    def base_hash(self, p: int) -> str:
        """Fragment p's global weights' hash (what updates name as their base), computed once per change of the
        global weights: every incoming announcement is checked against it, and hashing a fragment on the event loop
        per message is a quarter of a node's time at N = 8 (25 MB updates; seconds per message for a 1B model)."""
        if len(self._all) == 1:
            return self.global_hash()  # the same bytes
        return self._cached_hash(p)

    def _cached_hash(self, p: int | None) -> str:
        """The hash of fragment p's global weights (None: of all of them), kept until the global weights change:
        the weights' tensors are replaced, never changed in place, and every replacement bumps ``_version``."""
        version = self._version  # read before the weights: a hash stored under a version is never older
        cached = self._hashes.get(p)
        if cached is None or cached[0] != version:
            tensors = self.weights() if p is None else [self._all[p].weights]
            cached = self._hashes[p] = (version, outer.params_hash(tensors))
        return cached[1]
