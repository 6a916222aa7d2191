"""The SPSA loop: it builds the model, schedules the windows (steps, batch, evaluation, close, hash check,
checkpoint, resync) and composes the parts from its sibling modules."""

from __future__ import annotations

import asyncio
import collections
import logging
import math

from swarmd.node.services import NodeContext
from swarmd.protocols import task as tasks
from swarmd.protocols.faults import FaultPlan
from swarmd.protocols.reach import Reach
from swarmd.protocols.gossip import Gossip
from swarmd.protocols.spsa.audits import Auditor
from swarmd.protocols.spsa.base import Base, base_layout, base_size
from swarmd.protocols.spsa.book import Window, WindowBook
from swarmd.protocols.spsa.checkpoints import CheckpointsMixin
from swarmd.protocols.spsa.codes import encode_grad, step_seed
from swarmd.protocols.spsa.config import SpsaConfig
from swarmd.protocols.spsa.log import LogMixin
from swarmd.protocols.spsa.model import Model
from swarmd.protocols.spsa.start import StartMixin
from swarmd.protocols.spsa.state import Resyncs, Start
from swarmd.protocols.spsa.validate import ValidateMixin
from swarmd.protocols.spsa.weights import Weights
from swarmd.protocols.spsa.windows import WindowsMixin
from swarmd.protocols.spsa.wire import BASE_SPEC, BATCH, HASH, HISTORY, LOG_SPEC
from swarmd.protocols.task import Task
from swarmd.protocols.taskloop import TaskLoop

logger = logging.getLogger("swarmd.protocols.spsa")  # one logger for the package


class SPSALoop(WindowsMixin, LogMixin, StartMixin, CheckpointsMixin, ValidateMixin, TaskLoop):
    """The loop as a node service. Timeline of window w (``window`` steps):

    1. for each step t of w: apply window w-1's byte for step t - window (every participant's, canonical order),
       then probe at the new weights and encode our byte;
    2. publish our batch for w (if we participate in w);
    3. close w: wait for the batches of w's expected participants (those of w-1, plus peers that announced they
       join at w), at most ``deadline`` seconds; the batches that arrived are w's participants, everywhere.

    A late joiner fetches the log (the signed batches of every closed window) from a peer, verifies each batch's
    signature, replays it onto the base model, follows the live windows without contributing, announces that it
    joins two windows ahead, and contributes from there.

    Its collaborators: the model it probes (``Model``), the base model it replays onto and serves (``Base``), the
    audits (``Auditor``) and what it keeps across windows (``WindowBook``); each window it computes is a ``Window``,
    passed through its phases (open, compute, send, evaluate, close, after the close)."""

    name = "spsa"

    def __init__(self, gossip: Gossip, config: SpsaConfig, task: Task):
        self.gossip = gossip
        self.cfg = config
        self._init_task(task)
        self.book = WindowBook()  # what we keep of each window, and for how long
        self.counters: collections.Counter = collections.Counter()
        self.base = Base(self, self.counters, self.work)  # the base model we replay onto, and serve
        self.start_state = Start()
        self.resyncs = Resyncs()
        self.audits = Auditor(config, self.counters)  # whose steps we re-probe, and whom that convicted
        self.reach = Reach("gossiped")  # the windows that took our batch, and those of peers without a direct path
        self.window = 0  # the window being computed
        self.join_at = 0  # the first window we contribute to
        self.losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=HISTORY)  # the last evaluations
        self.model: Model | None = None  # built when the loop starts
        self.final = False  # every window applied (the run ended)
        self.final_hash: str | None = None
        self.replay_seconds: float | None = None
        self._sent_up_to = -1  # the last window we published a batch for
        self.state = "starting"
        self._ctx: NodeContext | None = None
        self.faults = FaultPlan()  # a test's faults by peer, window and phase (none in production)

    @property
    def weights(self) -> Weights | None:
        """The model's canonical weights (None until it is built)."""
        return self.model.weights if self.model is not None else None

    @property
    def per_step(self) -> bool:
        """The task draws batches by step (batch_at): audits possible."""
        return self.model is not None and self.model.per_step

    @property
    def _max_code(self) -> int:
        """The largest magnitude code a byte may carry: the run's clip."""
        return encode_grad(self.cfg.clip, self.cfg.clip) & 0x7F

    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self.audits.start(ctx)
        self._init_standing(ctx)
        self.standing.judge_self = True  # our own batch is taken only where the others take it (see _close_window)
        self.gossip.subscribe(self.topic, max_size=128 + self.cfg.window, validator=self._validate, queue_size=0)
        await ctx.transport.serve(LOG_SPEC, self._serve_log)
        self.base.start(ctx)
        await ctx.transport.serve(BASE_SPEC, self.base.serve)

    async def close(self) -> None:
        self._stop_progress()

    def _total(self) -> float:
        return -(-self.cfg.steps // self.cfg.window) if self.cfg.steps else math.inf

    def _build(self) -> None:
        self._setup_device()
        self.model, perturbed = Model.build(self.task, self.cfg.base_seed, self.device, self._ctx.identity.peer_id)
        # peers that draw their batches by step (batch_at) and peers that read a stream cannot audit each other:
        # they are not one run
        self.fps.own = tasks.fingerprint(self.task, {**self.cfg.shared(), "batches": "batch_at" if self.model.per_step
                                                     else "data"}, perturbed)
        self.base.layout = base_layout(self.model.weights.model, [p for _, p in perturbed])

    async def run(self) -> None:
        await self._guarded(self._run)

    async def _run(self) -> None:
        await self._build_base()
        self._resume_own()
        total = self._total()
        if self.window < total:
            if self.faults:
                await self.faults.enter("start", self)
            await self._start_or_catch_up()
        while self.window < total:
            window = self._open_window(self.window)
            await self._compute(window)
            self._send(window)
            await self._evaluate(window.w)
            if self.faults:
                await self.faults.enter("close", self, r=window.w)
            await self._close_window(window)
            if self.faults:
                await self.faults.enter("closed", self, r=window.w)
            await self._after_close(window.w, total)
        if not self.final:
            await self._finish()
        self.final_hash = self.weights.hash()
        await self._last_progress()
        self.state = "done"
        logger.info("spsa run %s done after %d steps: weights %s", self.cfg.run, self.window * self.cfg.window,
                    self.final_hash)
        await asyncio.Event().wait()

    async def _build_base(self) -> None:
        """The model, and the base we replay onto: the weights as built."""
        self.runtime.threads = tasks.set_threads(self.cfg.threads)
        self.state = "building base model"
        with self.work.track("base model build"):
            await asyncio.to_thread(self._build)
        if self.faults:  # a test's model built with other bits (as another CPU's kernels build it)
            built = self.faults.altered("built", self, [c.clone() for c in self.weights.canonical])
            for c, value in zip(self.weights.canonical, built):
                c.copy_(value)
            self.weights._load(None, 0.0)
        await self.base.built(self.weights.canonical)

    def _open_window(self, w: int) -> Window:
        """Window w as we start it: whether we contribute, and which of its steps we re-probe."""
        return Window(w, self.cfg.window, contribute=w >= self.join_at, audits=self._audit_plan(w))

    async def _compute(self, window: Window) -> None:
        """The window's steps (never on the event loop), and our byte for each if we contribute."""
        for i in range(self.cfg.window):
            g = await asyncio.to_thread(self._step, window, i)
            if window.contribute:
                window.codes.append(self._code(g, window.step(i)))
        self.book.my_hashes[window.w] = self.weights.hash()  # windows < w applied

    def _send(self, window: Window) -> None:
        """Our batch for the window (with our weights' hash), or our hash alone where a hash check is due."""
        w = window.w
        if window.contribute:
            self._publish(BATCH, {"w": w, "b": bytes(window.codes), "h": bytes.fromhex(self.book.my_hashes[w][:16])})
        elif w % self.cfg.hash_every == 0:
            self._publish(HASH, {"w": w, "h": self.book.my_hashes[w]})

    async def _evaluate(self, w: int) -> None:
        if w % self.cfg.eval_every == 0:
            loss = await asyncio.to_thread(self.model.evaluate)
            if loss is not None:
                self.losses.append((w * self.cfg.window, round(loss, 5)))
                await self._report_progress(loss)

    async def _after_close(self, w: int, total: float) -> None:
        """Once window w is closed: the hash check, the next window, a checkpoint, a resync where one is due."""
        # (the hash check once the window's batches, which carry their authors' hashes, are in)
        resync_from = self._check_hashes(w) if w % self.cfg.hash_every == 0 else []
        self.window = w + 1
        if self.cfg.checkpoint_every and self.window % self.cfg.checkpoint_every == 0 and self.window < total:
            await asyncio.to_thread(self._save_checkpoint, False)
        if resync_from:
            await self._resync(resync_from)

    async def _finish(self) -> None:
        """The run's end: the last window's bytes applied (the one-window lag), a last evaluation and checkpoint."""
        last = self.window - 1
        for i in range(self.cfg.window):
            await asyncio.to_thread(self.weights.apply, self.cfg.run, last * self.cfg.window + i,
                                    self._bytes_for(last, i), self.cfg.lr)
        self.final = True
        loss = await asyncio.to_thread(self.model.evaluate)
        if loss is not None:
            self.losses.append((self.window * self.cfg.window, round(loss, 5)))
        await asyncio.to_thread(self._save_checkpoint, True)

    def _step(self, window: Window, i: int) -> float | None:
        """Step i of ``window``: apply the window before's bytes for the step one window back, re-probe the steps
        we audit at the same weights, then probe (if we contribute)."""
        w, step = window.w, window.step(i)
        if w > 0:
            self.weights.apply(self.cfg.run, step - self.cfg.window, self._bytes_for(w - 1, i), self.cfg.lr)
        for peer in window.audits.get(i, ()):  # the same weights its probe of this step had
            losses = self.weights.losses(self.model.batch(peer, step), step_seed(self.cfg.run, step, peer),
                                         self.cfg.eps)
            window.probes.setdefault(peer, []).append((i, *losses))
        if not window.contribute:
            return None
        me = self._ctx.identity.peer_id
        return self.weights.probe(self.model.batch(me, step), step_seed(self.cfg.run, step, me), self.cfg.eps)

    def _code(self, g: float, step: int) -> int:
        if math.isfinite(g):
            code = encode_grad(g, self.cfg.clip)
        else:
            self._nonfinite("the loss", f"is not finite at step {step}; sending the smallest step instead of a "
                            "gradient")
            code = 0
        if self.faults:  # a test's Byzantine byte
            code = self.faults.altered("code", self, code, r=step // self.cfg.window, info={"step": step})
        return code

    async def _report_progress(self, loss: float) -> None:
        """Our progress into the replicated state (the CRDT's per-peer progress register)."""
        steps = self.window * self.cfg.window
        await self._write_progress(steps, self._samples(steps), loss, self.counters["step_wire_bytes"], self.window)

    def status(self) -> dict:
        steps = max(1, self.window * self.cfg.window)
        return {
            "run": self.cfg.run,
            "state": self.state,
            "round": self.window,
            "total_rounds": self._total() if self.cfg.steps else 0,
            **self._task_status(),
            "window": self.window,
            "step": self.window * self.cfg.window,
            "participants": len(self.book.applied.get(self.window - 1, {})),
            "weights_hash": self.final_hash or (self.weights.hash() if self.weights is not None else None),
            "final_hash": self.final_hash,
            "base_hash": self.base.hash,
            "base_taken": self.base.taken,
            "base_bytes": base_size(self.base.layout),  # what a peer that takes our base pulls
            "losses": list(self.losses)[-40:],
            "log_windows": len(self.book.log),
            "replay_seconds": self.replay_seconds,
            "wire_bytes_per_step": round(self.counters["step_wire_bytes"] / steps, 3),
            "audits": self.audits.state(self.model is not None, self.per_step),
            # peer -> the window its bytes failed an audit
            "convicted": dict(list(self.audits.convicted.items())[-64:]),
            "reach": self.reach.status(),
            **dict(sorted(self.counters.items())),
        }

    def bytes_sent(self) -> int:
        return int(self.counters["step_wire_bytes"])

    def routes(self) -> list:
        return []
