"""A run's model and its fragments: the model built on our device, cut into fragments, each fragment's global
(CPU, fp32) weights and the outer optimizer over them, the inner optimizer and our data; and the global weights'
hashes, computed once per change of them."""

from __future__ import annotations

import torch
from swarmd.node import allocator
from swarmd.protocols import exchange, outer
from swarmd.protocols import task as tasks
from swarmd.protocols.diloco.wire import RULES
from swarmd.protocols.inner import SwarmAdamW, muon_for
from swarmd.protocols.task import TaskError


class FragmentsMixin:
    """DilocoLoop's model and fragments (the loop composes them; they share its state)."""

    def _build(self) -> None:
        """The task's model on our device, its fragments, the global (CPU, fp32) copy, the optimizers, our data."""
        self._setup_device()
        model = tasks.build_model(self.task, self.cfg.seed)
        named = tasks.trainable(model)
        shared = self.cfg.shared()
        self.fps.own = tasks.fingerprint(self.task, shared, named)
        # the same run under older versions of the rules: one that names no e3m0 encoder (the log2 encoder), and
        # one that names no weights hash either (BLAKE2b). We resume their checkpoints (the weights are the same
        # run's), never mix with their nodes in a round
        before_encoder = {k: v for k, v in shared.items() if k != "e3m0_encoder"}
        self.fps.earlier = [tasks.fingerprint(self.task, before_encoder, named), tasks.fingerprint(
            self.task, {k: v for k, v in before_encoder.items() if k != "weights_hash"}, named)]
        # and one without the screen's exact products and the outer step's unfused operations: its rule's text, no
        # outer step named. (Its weights step with fused multiply-adds on AVX2 CPUs: the same run's weights to
        # resume from, where the start barrier finds the swarm at the same round and hash)
        before_exact = {**{k: v for k, v in shared.items() if k != "outer_step"},
                        "reduce_rule": exchange.REDUCE_RULE_BEFORE_EXACT}
        self.fps.earlier.append(tasks.fingerprint(self.task, before_exact, named))
        self.fps.resumable = tasks.fingerprint(self.task, {k: v for k, v in shared.items() if k not in RULES}, named)
        replica = self.replica
        replica.model = model.to(self.device)
        named = tasks.trainable(replica.model)
        replica.names = [n for n, _ in named]
        replica.params = [p for _, p in named]
        frag_index = tasks.fragment_indices(self.task, replica.model, self.cfg.fragments)
        self.fragments.build(frag_index, [outer.flatten([replica.params[i] for i in f]) for f in frag_index])
        for p in range(self.cfg.fragments):
            for count in self._part_counts(p):  # here in the worker thread: the exchange mode depends on them
                self._part_bytes(p, False, count)
                self._part_bytes(p, True, count)
        # the blobs a round's exchange keeps in the bulk store: per fragment our update, the chunks and parts we
        # pull and reduce (about 3 x an update in scatter), for this round and the last, and our own of the one
        # before (``Round.finalize``); room for 8 x an update (x the combined parts' size where reduced_codec
        # makes them larger; their sizes computed here, in the worker thread, once), so a large model's are never
        # dropped early
        self.bulk.reserve(8 * sum(max(self._update_bytes(p), sum(self._part_bytes(p, reduced=True)))
                                  for p in range(self.cfg.fragments)))
        replica.outer_opt = outer.OuterNesterov([f.numel() for f in self.fragments], self.cfg.outer_lr,
                                                self.cfg.outer_momentum)
        # a round's large buffers kept for the next (protocols/buffers.py): our update's flat copy, the combined
        # update (which becomes the global weights, the old ones given back), the chunks we decode (about one
        # fragment's worth at once); room for 3 fragments, none where node.memory = "release"
        self._buffers.max_bytes = 0 if allocator.applied()["mode"] == "release" else \
            3 * 4 * max(f.numel() for f in self.fragments)
        if self.task.has("optimizer"):
            replica.inner_opt = self.task.call("optimizer", replica.model.parameters())
            if not isinstance(replica.inner_opt, torch.optim.Optimizer):
                raise TaskError(f"{self.task.where('optimizer')} returned {type(replica.inner_opt).__name__}, "
                                "expected a torch.optim.Optimizer")
        elif self.cfg.inner_optimizer == "muon":
            replica.inner_opt = muon_for(replica.model, lr=self.cfg.inner_lr, betas=self.cfg.inner_betas,
                                         weight_decay=self.cfg.weight_decay, peers=max(1, self.cfg.min_peers))
        elif self.cfg.inner_optimizer == "swarm-adamw":
            replica.inner_opt = SwarmAdamW(replica.model.parameters(), lr=self.cfg.inner_lr,
                                           betas=self.cfg.inner_betas, weight_decay=self.cfg.weight_decay,
                                           peers=max(1, self.cfg.min_peers))
        else:
            replica.inner_opt = torch.optim.AdamW(replica.model.parameters(), lr=self.cfg.inner_lr,
                                                  betas=self.cfg.inner_betas, weight_decay=self.cfg.weight_decay)
        replica.data = tasks.data_iter(self.task, tasks.shard_of(self._ctx.identity.peer_id), self.cfg.seed)

    @property
    def _fp_before_blake3(self) -> dict | None:
        """The fingerprint of this run under the version that hashed weights with BLAKE2b (``_build``)."""
        return self.fps.earlier[1] if len(self.fps.earlier) > 1 else None

    def global_hash(self) -> str:
        return self.fragments.global_hash()

    def _base_hash(self, p: int) -> str:
        return self.fragments.base_hash(p)

    # the global weights and round counters as lists, for the callers outside the package (the simulator, the
    # training API, tests); the package itself goes by ``self.fragments``
    @property
    def global_flat(self) -> list[torch.Tensor]:
        """Each fragment's global (CPU, flat fp32) weights."""
        return self.fragments.weights()

    @global_flat.setter
    def global_flat(self, weights: list[torch.Tensor]) -> None:
        self.fragments.replace_all(weights)

    @property
    def rounds_done(self) -> list[int]:
        """The rounds each fragment has closed ([] before the model is built)."""
        return self.fragments.rounds_done()

    @rounds_done.setter
    def rounds_done(self, done: list[int]) -> None:
        for f, r in zip(self.fragments, done):
            f.rounds_done = r

    @property
    def participants(self) -> dict[int, set[str]]:
        """Fragment -> the participants of its last closed round (fragments that closed none left out)."""
        return {f.index: f.participants for f in self.fragments if f.participants is not None}

    @property
    def frag_index(self) -> list[list[int]]:
        """Each fragment's parameters (indices into ``params``)."""
        return [f.params for f in self.fragments]
