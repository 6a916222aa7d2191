"""What every training loop does with its task: the device, the run's fingerprint on every message, refusing a run
whose peers train something else, turning a task's error into a failed loop (one log line, the reason in /status,
the node keeps running), the checkpoint file, and the summary ``swarmd status`` prints."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from swarmd.node.services import WorkBoard
from swarmd.protocols import checkpoint
from swarmd.protocols.gossip import Message, Verdict
from swarmd.protocols.loopstate import (
    CheckpointRecord, Fingerprints, Halt, ProgressWrites, RoundTimeline, Runtime,
)
from swarmd.protocols.outer import wait_event
from swarmd.protocols.rounds import RoundWait
from swarmd.protocols.standing import Standing
from swarmd.protocols.task import Task, TaskError, describe_mismatch, pick_device
from swarmd.transport import clock
from swarmd.transport.clock import Clock
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.wire import WIRE, Str, Tuple, UnknownKind

logger = logging.getLogger(__name__)


TAG = Tuple.of(Str(32), Str(32))  # every loop message's "t": the run's fingerprint (model layout, shared config)


class TaskLoop:
    """Mixed into DiLoCo, SPSA and SAPO. The subclass sets ``name``, ``cfg`` (with ``run``, ``device``) and calls
    :meth:`_init_task`; it tags outgoing bodies with :meth:`_tag` and checks incoming ones with :meth:`_foreign`.
    The state kept here lives in a few holders of one concern each (``protocols.loopstate``), so that the loops, which
    add their own, stay small classes."""

    name: str

    def _init_task(self, task: Task) -> None:
        self.task = task
        self.runtime = Runtime()
        self.fps = Fingerprints()
        self.halt = Halt()
        self.ckpt = CheckpointRecord()
        self.work = WorkBoard(logging.getLogger(f"protocols.{self.name}"))  # long work, in /status as it goes
        self.round_log = RoundTimeline()
        self.progress = ProgressWrites()

    # read-only views of the holders' state, for the loops' code and for readers outside (the API, the dashboard)
    @property
    def device(self) -> torch.device | None:
        return self.runtime.device

    @property
    def fp(self) -> dict | None:
        """The run's fingerprint, {"layout": ..., "config": ...}; None until the model is built."""
        return self.fps.own

    @property
    def error(self) -> str | None:
        """The task's error that failed the loop (None while it has not)."""
        return self.halt.error

    @property
    def refused(self) -> str | None:
        """Why the run is refused (None while it is not)."""
        return self.halt.refused

    @property
    def saved(self) -> dict | None:
        return self.ckpt.saved

    @property
    def resumed(self) -> dict | None:
        return self.ckpt.resumed

    @property
    def timeline(self) -> collections.deque[dict]:
        """The closed rounds, for the dashboard."""
        return self.round_log.rounds

    @property
    def offenders(self) -> collections.OrderedDict[str, dict]:
        return self.round_log.offenders

    @property
    def clock(self) -> Clock:
        """The node's clock (``NodeContext.clock``: virtual in a simulation); the running loop's before start."""
        ctx = getattr(self, "_ctx", None)
        return ctx.clock if ctx is not None else clock.current()

    def _init_standing(self, ctx) -> None:
        """Who counts in this run's decisions (``protocols.standing``): the config's ``peers`` (a closed run) or,
        in an open run, our bootstrap peers, the run's founders and peers that earned it."""
        self.standing = Standing(ctx.identity.peer_id, self.cfg.peers, ctx.anchors)

    def _setup_device(self) -> None:
        self.runtime.device = pick_device(self.cfg.device)

    # ------------------------------------------------------------------ failure
    async def _guarded(self, body) -> None:
        """Run the loop; a TaskError (the user's task is broken) fails the loop once, clearly, without a restart."""
        try:
            await body()
        except TaskError as e:
            self.halt.error = str(e)
            self.state = "failed"
            logger.error("%s loop failed: %s", self.name, e)
            await asyncio.Event().wait()

    # ------------------------------------------------------------------ fingerprint on the wire
    def _tag(self, body: dict) -> dict:
        body["t"] = self.fps.tag()
        return body

    def _unpack(self, carrier: str, message: Message) -> tuple[object, dict] | Verdict:
        """A pubsub message of the loop's carrier as (kind, body), the kind's schema checked (types and bounds); or
        the verdict where there is nothing to judge: REJECT for a malformed one, IGNORE for a kind a newer peer
        sends (counted: not ours to judge or forward)."""
        try:
            return WIRE.unpack(carrier, message.data)
        except MalformedMessage:
            return Verdict.REJECT
        except UnknownKind:
            self.counters["unknown_kind"] += 1
            return Verdict.IGNORE

    def _refusal(self, author: str, body: dict) -> Verdict | None:
        """The verdict on a well-formed message that is not this run's to judge (None: go on): another run's task
        (ignored, and remembered for a refusal) or a malformed tag (rejected), or an author a closed run does not
        admit (ignored, counted)."""
        foreign = self._foreign(author, body)
        if foreign is not None:
            return Verdict.IGNORE if foreign else Verdict.REJECT  # another run's task: not ours to judge or forward
        if not self.standing.admitted(author):
            self.counters["not_admitted"] += 1
            return Verdict.IGNORE  # a closed run: not one of its peers
        return None

    def _foreign(self, author: str, body: dict) -> bool | None:
        """None: the body's tag matches ours (go on); False: malformed (reject); True: another task (ignore, and,
        from a peer that vouches for itself, remembered: a run whose peers all train something else is refused)."""
        tag = body.pop("t", None)
        if not (isinstance(tag, list) and len(tag) == 2 and all(isinstance(x, str) and len(x) <= 32 for x in tag)):
            return False
        if self.fps.own is None or tag == self.fps.tag():
            self.halt.mismatched.pop(author, None)
            return None
        self.counters["rejected_task_mismatch"] += 1
        if not self._witness(author):
            # anyone can make keys that claim another task: only peers with standing in the run, or linked to us
            # directly (a connection each, not a signature each), may tell us that the run trains something else
            self.counters["task_mismatch_unvouched"] += 1
            return True
        self.halt.saw(author, tag)
        return True

    def _witness(self, peer: str) -> bool:
        """Is ``peer``'s word on which task the run trains worth a refusal? Its standing in the run (a listed peer,
        a bootstrap peer, a founder, or one that earned it) or a direct connection of ours to it."""
        standing, ctx = getattr(self, "standing", None), getattr(self, "_ctx", None)
        return bool((standing is not None and standing.vouched(peer)) or (ctx is not None and ctx.direct(peer)))

    def _check_refusal(self, matching_peers: int) -> None:
        """While waiting to start: peers are here but none trains what we train -> say why, in /status and once a
        minute in the log."""
        halt = self.halt
        if halt.mismatched and matching_peers == 0:
            tags = collections.Counter(tuple(t) for t in halt.mismatched.values())
            theirs, n = tags.most_common(1)[0]
            halt.refused = (f"peers with another task were seen in run {self.cfg.run!r} and none with ours: {n} "
                            f"peer(s) train with {describe_mismatch(self.fps.own, list(theirs))}; if they are this "
                            f"run's peers, the run's nodes must use the same task and task_options "
                            f"([loops.{self.name}])")
            self.state = "refused"
            if self.clock.monotonic() - halt.logged_at > 60:
                halt.logged_at = self.clock.monotonic()
                logger.warning("%s: %s", self.name, halt.refused)
        elif halt.refused:
            halt.refused = None
            self.state = "waiting for peers"

    def _nonfinite(self, what: str, where: str) -> None:
        """Count a non-finite loss (or weights) and say so: the first time, then every 100th."""
        self.counters["nonfinite_loss"] += 1
        n = self.counters["nonfinite_loss"]
        if n == 1 or n % 100 == 0:
            logger.warning("%s: %s of %s %s (%d so far)", self.name, what, self.task.spec, where, n)

    def _samples(self, steps: int) -> int:
        """Samples seen after ``steps`` steps, for the progress register (the task's ``batch`` if it has one)."""
        return steps * int(getattr(self.task.obj, "batch", 1) or 1)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_path(self) -> Path:
        return checkpoint.path_for(self._ctx.data_dir, self.name, self.cfg.run)

    def _meta(self, **extra) -> dict:
        return {"loop": self.name, "run": self.cfg.run, "fingerprint": self.fps.own, "task": self.task.spec,
                "task_options": self.task.options,
                **({"resumable": self.fps.resumable} if self.fps.resumable is not None else {}), **extra}

    def _save(self, tensors: dict[str, torch.Tensor], **meta) -> None:
        path = self._checkpoint_path()
        checkpoint.save(path, tensors, self._meta(**meta))
        self.ckpt.saved = {"path": str(path), **{k: meta[k] for k in ("round", "step", "hash") if k in meta}}

    def _own_checkpoint(self) -> tuple[dict, dict] | None:
        """Our checkpoint for this run, if there is one and it is of this task (else None, said why)."""
        path = self._checkpoint_path()
        if not path.exists():
            return None
        try:
            tensors, meta = checkpoint.load(path)
        except checkpoint.CheckpointError as e:
            logger.warning("%s: ignoring our checkpoint: %s", self.name, e)
            return None
        same_run = self.fps.resumable is not None and meta.get("resumable") == self.fps.resumable
        if not self._listed(meta) and not same_run:
            logger.warning("%s: ignoring our checkpoint %s: it is of another task or config (%s)", self.name, path,
                           describe_mismatch(self.fps.own, [meta.get("fingerprint", {}).get(k, "?")
                                                       for k in ("layout", "config")]))
            return None
        return tensors, meta

    def _listed(self, meta: dict) -> bool:
        """Whether a checkpoint's metadata carries our fingerprint or one of the earlier versions' we list (else it
        can only be the same run by its resumable fingerprint, saved under rules we do not list)."""
        return meta.get("fingerprint") == self.fps.own or meta.get("fingerprint") in self.fps.earlier

    def _with_optimizer(self, tensors: dict[str, torch.Tensor], opt) -> tuple[dict[str, torch.Tensor], dict]:
        """``tensors`` plus ``opt``'s state (if it is a torch optimizer), and the meta that goes with it."""
        if not isinstance(opt, torch.optim.Optimizer):
            return tensors, {}
        opt_tensors, opt_meta = checkpoint.optimizer_entries(opt)
        return {**tensors, **opt_tensors}, {"optimizer": opt_meta}

    def _restore_optimizer(self, opt, tensors: dict[str, torch.Tensor], meta: dict) -> bool | None:
        """Our checkpoint's optimizer state back into ``opt``: True if restored, False if it did not fit (the
        optimizer starts afresh, said once), None if the checkpoint has none (an older one)."""
        if not isinstance(opt, torch.optim.Optimizer) or "optimizer" not in meta:
            return None
        try:
            checkpoint.restore_optimizer(opt, tensors, meta["optimizer"])
        except ValueError as e:
            logger.warning("%s: our checkpoint's optimizer state does not fit (%s); the optimizer starts afresh",
                           self.name, e)
            return False
        return True

    def _model_tensors(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict (buffers too) as ``model.<name>``, cloned so tied weights are saved apart."""
        return {checkpoint.MODEL_PREFIX + k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}

    async def _wait_round(self, wait: RoundWait, arrived: asyncio.Event, have: Callable[[], set[str]],
                          coming: Callable[[], set[str]] = set, done: Callable[[], bool] = lambda: False) -> None:
        """Wait out a round as ``wait`` (protocols.rounds) says, looking again each time ``arrived`` is set; or until
        ``done()`` holds."""
        while not done() and (left := wait.remaining(self.clock.monotonic(), have(), coming())) is not None:
            await wait_event(arrived, left)

    async def _write_progress(self, step: int, samples: int, loss: float, sent: float, round_: int,
                              metrics: dict[str, float] | None = None) -> None:
        """Our progress into the replicated state (the CRDT's per-peer progress register), for every peer's view:
        at most one write every ``progress.every`` seconds. A value that comes sooner waits, and only the newest
        one waiting is written when the interval ends (or at once when the run ends). Each write is a signed op
        that every peer of the swarm verifies, logs and forwards: written every round, at N = 8 and 1-second
        rounds, that is a tenth of a node's event loop (the exchange bench)."""
        if self._ctx.replicator is None:
            return
        value = {"step": int(step), "samples": int(samples), "loss": float(loss), "bytes": int(sent),
                 "round": int(round_)}
        if metrics:
            value["metrics"] = metrics
        progress = self.progress
        progress.waiting = value
        wait = progress.at + progress.every - self.clock.monotonic()
        if wait <= 0:
            await self._flush_progress()
        elif progress.later is None or progress.later.done():
            progress.later = asyncio.get_running_loop().create_task(self._flush_progress(after=wait))

    async def _flush_progress(self, after: float = 0.0) -> None:
        """Write the progress waiting (if any) now, or after ``after`` seconds."""
        if after > 0:
            await asyncio.sleep(after)
        value, self.progress.waiting = self.progress.waiting, None
        if value is None:
            return
        self.progress.at = self.clock.monotonic()
        try:
            await self._ctx.replicator.write("progress", value)
        except ValueError as e:
            logger.warning("could not record %s progress: %s", self.name, e)

    async def _last_progress(self) -> None:
        """(As the run ends.) The progress waiting on the interval, written at once."""
        self._stop_progress()
        await self._flush_progress()

    def _stop_progress(self) -> None:
        """(At close.) No write waits on the interval any more."""
        if self.progress.later is not None:
            self.progress.later.cancel()

    # ------------------------------------------------------------------ the round timeline
    def _record_round(self, r: int, *, fragment: int | None = None, waited_s: float, deadline_s: float,
                      participants, missing, rejected: dict | None = None) -> None:
        """One closed round for the dashboard: who took part, who was waited for and missing, whose update was
        refused and why, and the bytes this loop sent since the previous record."""
        self.round_log.record(r, fragment, self.clock.time(), waited_s, deadline_s, participants, missing,
                              rejected or {}, self.bytes_sent())
        self.counters["peers_missed"] += len(missing)

    def _record_late(self, r: int, peer: str, fragment: int | None = None) -> None:
        """A peer's contribution to round r came after we had closed it."""
        self.round_log.late(r, peer, fragment)

    @property
    def topic(self) -> str:
        """The run's pubsub topic: ``<loop>/<run>``."""
        return f"{self.name}/{self.cfg.run}"

    @property
    def loop_key(self) -> str:
        """How this loop is named to others (the node's DHT record, ``/status`` -> ``loops``): its topic, at most 64
        characters."""
        return self.topic[:64]

    def bytes_sent(self) -> int:
        """Bytes this loop has put on the wire for its updates (each loop counts its own way)."""
        return int(self.counters.get("bytes_sent", 0))

    def loop_metrics(self) -> dict[str, float | None]:
        """The numbers ``/metrics`` exports per loop (``swarmd_loop_<name>{loop=..., run=...}``)."""
        st = self.status()
        losses = st.get("losses") or []
        loss = losses[-1][1] if losses else st.get("train_loss", st.get("last_loss"))
        return {
            "round": st.get("round"), "step": st.get("step", st.get("round")), "loss": loss,
            "reward": st.get("reward_last50"),
            "bytes_sent": self.bytes_sent(),
            "deadline_seconds": st.get("deadline_s", getattr(self.cfg, "deadline", None)),
            "deadlines_missed": self.counters.get("deadline_missed", 0),
            "peers_missed": self.counters.get("peers_missed", 0),
            "task_mismatch": self.counters.get("rejected_task_mismatch", 0),
            "peers_in_last_round": self.round_log.rounds[-1]["participants"] if self.round_log.rounds else None,
            "running": 1.0 if st.get("state") == "running" else 0.0,
        }

    # ------------------------------------------------------------------ views
    def _task_status(self) -> dict:
        return {
            "task": self.task.spec,
            "device": str(self.runtime.device) if self.runtime.device else self.cfg.device,
            "threads": self.runtime.threads,
            "fingerprint": self.fps.own,
            "error": self.halt.error,
            "refused": self.halt.refused,
            "mismatched_peers": len(self.halt.mismatched),
            "checkpoint": self.ckpt.saved,
            "resumed": self.ckpt.resumed,
            "work": self.work.view(),
            "offenders": self.round_log.offenders_view(),
        }
