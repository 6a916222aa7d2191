"""Our own checkpoint in the data dir: saving it, resuming from it (with the base we replay onto, where it is a
peer's)."""

from __future__ import annotations

import logging

import msgpack
import torch

from swarmd.protocols.gossip import decode_message
from swarmd.protocols.spsa.base import BASE_PREFIX
from swarmd.protocols.spsa.wire import KEEP_APPLIED

logger = logging.getLogger("swarmd.protocols.spsa")  # one logger for the package


class CheckpointsMixin:
    """SPSALoop's own checkpoint."""

    def _save_checkpoint(self, final: bool) -> None:
        """The canonical weights (every window before the last closed one applied, or all of them when
        ``final``), the log of signed batches (for late joiners, and the last window's bytes to apply next)."""
        tensors = self._model_tensors(self.weights.model)
        for name, c in zip(self.model.names, self.weights.canonical):
            tensors["model." + name] = c.to(tensors["model." + name].dtype).clone()
        log = msgpack.packb(self.book.log, use_bin_type=True)
        tensors["state.log"] = torch.frombuffer(bytearray(log), dtype=torch.uint8) if log else torch.zeros(0,
                                                                                                     dtype=torch.uint8)
        if self.base.taken is not None:  # the base we replay onto is a peer's, not the one we build: kept too
            for name, b in zip(self.model.names, self.base.tensors):
                tensors[BASE_PREFIX + name] = b.clone()
        h = self.weights.hash()
        self._save(tensors, round=self.window, step=self.window * self.cfg.window, hash=h, final=final,
                   **({"base_taken": self.base.taken} if self.base.taken is not None else {}))
        self.counters["checkpoints_saved"] += 1

    def _resume_own(self) -> None:
        found = self._own_checkpoint()
        if found is None:
            return
        tensors, meta = found
        try:
            canonical = [tensors["model." + n].to(torch.float32) for n in self.model.names]
            if [c.shape for c in canonical] != list(self.weights.shapes):
                raise ValueError("its weights have other shapes")
            log = msgpack.unpackb(tensors["state.log"].numpy().tobytes(), raw=False) if tensors["state.log"].numel() \
                else []
            if not isinstance(log, list) or len(log) != meta["round"]:
                raise ValueError("its log does not end at its window")
            saved_hash = meta["hash"]
        except (KeyError, ValueError, TypeError, msgpack.UnpackException) as e:
            logger.warning("spsa: ignoring our checkpoint %s: %s", self._checkpoint_path(), e)
            return
        for c, v in zip(self.weights.canonical, canonical):
            c.copy_(v)
        self.weights._load(None, 0.0)
        if self.weights.hash() != saved_hash:
            logger.warning("spsa: ignoring our checkpoint %s: its weights do not match their hash",
                           self._checkpoint_path())
            self._reset_to_base()
            return
        self.book.log = log
        self.base.resume(tensors, meta, self.model.names)
        for w, wires in log[-KEEP_APPLIED:]:
            self.book.applied[w] = {m.author: m for m in (decode_message(x) for x in wires)}
        self.window = meta["round"]
        self.final = bool(meta.get("final"))
        self.ckpt.resumed = {"source": "own checkpoint", "round": self.window, "step": meta["step"], "hash": saved_hash}
        self.ckpt.saved = {"path": str(self._checkpoint_path()), "round": self.window, "step": meta["step"],
                           "hash": saved_hash}
        logger.info("spsa: resuming run %s from our checkpoint at window %d (weights %s)", self.cfg.run,
                    self.window, saved_hash)
