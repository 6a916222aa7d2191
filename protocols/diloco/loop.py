"""The DiLoCo loop: it builds the model, schedules the inner steps and each fragment's rounds, and composes
the round's parts (update, close, exchange, checkpoints, validation) from its sibling modules."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics

from swarmd.node.services import NodeContext
from swarmd.protocols import buffers, codecs, outer, rounds
from swarmd.protocols import task as tasks
from swarmd.protocols.bulk import BulkService
from swarmd.protocols.diloco.barrier import BarrierMixin
from swarmd.protocols.diloco.book import RoundBook
from swarmd.protocols.diloco.state import Links, Record, Resyncs, Start, Timings
from swarmd.protocols.diloco.checkpoints import CheckpointsMixin
from swarmd.protocols.diloco.config import DilocoConfig
from swarmd.protocols.diloco.conform import ConformMixin
from swarmd.protocols.diloco.fragment import Fragments
from swarmd.protocols.diloco.fragments import FragmentsMixin
from swarmd.protocols.diloco.links import LinksMixin
from swarmd.protocols.diloco.pulls import PullsMixin
from swarmd.protocols.diloco.redo import RedoMixin
from swarmd.protocols.diloco.replica import Replica
from swarmd.protocols.diloco.round import Round
from swarmd.protocols.diloco.update import UpdateMixin
from swarmd.protocols.diloco.validate import ValidateMixin
from swarmd.protocols.faults import FaultPlan
from swarmd.protocols.diloco.wire import (
    ANN_SPEC,
    CKPT_SPEC,
    FEEDBACK_CODECS,
    MAX_MESSAGE,
    REDUCING,
    ROUND_HASH,
)
from swarmd.protocols.gossip import Gossip
from swarmd.protocols.inner import lr_scale, scale_lr
from swarmd.protocols.sparse import bits_per_param_step
from swarmd.protocols.steps import StepsEnded, UserSteps
from swarmd.protocols.task import Task
from swarmd.protocols.taskloop import TaskLoop

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class DilocoLoop(FragmentsMixin, UpdateMixin, RedoMixin, LinksMixin, PullsMixin, ConformMixin,
                 BarrierMixin, CheckpointsMixin, ValidateMixin, TaskLoop):
    name = "diloco"

    def __init__(self, gossip: Gossip, bulk: BulkService, config: DilocoConfig, task: Task):
        self.gossip, self.bulk, self.cfg = gossip, bulk, config
        self._init_task(task)
        self.codec = codecs.configured(config.codec, config.codec_options)
        self.reduced_codec = codecs.get(config.reduced())
        self.replica = Replica()  # our model, its optimizers and data (built with the model)
        self.fragments = Fragments(config.fragments)  # each fragment's state from round to round (built with the model)
        self.book = RoundBook()  # what we keep of each (round, fragment), and for how long
        self.links, self.resyncs, self.start_state, self.timings = Links(), Resyncs(), Start(), Timings()
        self.record = Record()  # what the run reports
        self.counters: collections.Counter = collections.Counter()
        self.deadline = outer.AdaptiveDeadline(low=config.deadline_low, high=config.deadline_high,
                                               initial=max(config.deadline_low, 10.0))
        self.state = "starting"
        self.step = 0
        self.started = None
        self._ctx: NodeContext | None = None
        self._event = asyncio.Event()
        # scatter: parts whose chunks are decoded and reduced at once (each holds its members' chunks decoded)
        self._reducing = asyncio.Semaphore(REDUCING)
        self._buffers = buffers.Buffers(0)  # (its room set once the model is built)
        # the inner steps of a user's own training loop (swarmd.DiLoCo) in place of ours on the task's data
        self.user_steps: UserSteps | None = None
        self.faults = FaultPlan()  # a test's faults by peer, round and phase (none in production)

    @property
    def feedback(self) -> bool:
        """Whether what the codec drops of our update is carried into the next one (error feedback)."""
        cfg = self.cfg
        return cfg.error_feedback == "on" or (cfg.error_feedback == "auto" and cfg.codec in FEEDBACK_CODECS)

    # what the run reports, for the callers outside the package (the simulator, the training API, tests)
    @property
    def final_hash(self) -> str | None:
        """The global weights' hash the run ended on (None until it ends)."""
        return self.record.final_hash

    @property
    def history(self) -> collections.deque[dict]:
        """The last closed rounds: fragment, round, participants, global hash."""
        return self.record.history

    @property
    def losses(self) -> collections.deque[tuple[int, float]]:
        """The evaluations: (step, loss)."""
        return self.record.losses

    @property
    def exchange_view(self) -> dict:
        """The last round's exchange (``/status`` exchange)."""
        return self.record.exchange

    # ------------------------------------------------------------------ service
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self._init_standing(ctx)
        self.gossip.subscribe(self.topic, max_size=MAX_MESSAGE, validator=self._validate, queue_size=0)
        await ctx.transport.serve(CKPT_SPEC, self._serve_checkpoint)
        await ctx.transport.serve(ANN_SPEC, self._serve_announcements)

    async def close(self) -> None:
        self._stop_progress()
        running = [t for t in (self.links.probe, *self.resyncs.asks) if t is not None]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _rounds(self) -> float:
        return self.cfg.rounds or math.inf

    async def run(self) -> None:
        await self._guarded(self._run_until_left)

    async def _run_until_left(self) -> None:
        try:
            await self._run()
        except StepsEnded:  # the user's script left the run (swarmd.DiLoCo): keep where it got to
            await asyncio.to_thread(self._save_checkpoint)
            await self._last_progress()
            self.state = "left"
            logger.info("diloco run %s left by the training script at step %d (checkpoint saved)", self.cfg.run,
                        self.step)

    async def _run(self) -> None:
        await self._begin()
        await self._schedule()
        await self._end()

    async def _begin(self) -> None:
        """The model built, our own checkpoint resumed, the start barrier passed and the link probe begun."""
        self.runtime.threads = tasks.set_threads(self.cfg.threads)
        self.state = "building the model"
        with self.work.track("model build"):
            await asyncio.to_thread(self._build)
        self._resume_own()
        if self.faults:
            await self.faults.enter("built", self)
        if not (self.cfg.rounds and min(self.rounds_done) >= self.cfg.rounds):  # else: our saved run had ended
            if not self.rounds_done[0]:
                await self._serve_probe()
            await self._start_barrier()
            others = sorted(self.start_state.initial - {self._ctx.identity.peer_id})
            if others and not self.rounds_done[0]:
                self.links.probe = asyncio.get_running_loop().create_task(self._probe_links(others))
        self.started = self.clock.monotonic()

    async def _schedule(self) -> None:
        """The inner steps and each fragment's rounds: fragment p's round starts (our update announced) every
        inner_steps steps from its offset, p * inner_steps / fragments, and closes ``overlap`` steps later."""
        h = self.cfg.inner_steps
        rounds = self._rounds()
        offsets = [p * h // self.cfg.fragments for p in range(self.cfg.fragments)]
        total = rounds * h + max(offsets)
        waiting = self._under_way(offsets, rounds)  # fragment -> (its open round, step at which to close it)
        while self.step < total or waiting:
            if self._resync_due():
                await self._resync()
                waiting = self._under_way(offsets, rounds)
                continue
            if self.step < total:
                await self._inner(_next_event(self.step, total, h, offsets, self.rounds_done, rounds, waiting))
            for f in self.fragments:
                p = f.index
                if p not in waiting and f.rounds_done < rounds and self.step >= offsets[p] + h \
                        and (self.step - offsets[p]) % h == 0:
                    rnd = Round(self, p, f.rounds_done)
                    await rnd.announce()
                    waiting[p] = (rnd, self.step + self.cfg.overlap)
            for p, (rnd, close_at) in list(waiting.items()):
                if self.step >= close_at or self.step >= total:
                    await rnd.close()
                    del waiting[p]
                    f = self.fragments[p]
                    f.rounds_done += 1
                    if p == self.cfg.fragments - 1:
                        await self._after_round(f.rounds_done)
                        if self.faults:
                            await self.faults.enter("closed", self, r=f.rounds_done - 1)

    def _under_way(self, offsets: list[int], rounds: float) -> dict[int, tuple[Round, int]]:
        """The rounds whose inner steps are behind us (a late joiner, or a resync, may arrive mid-round): followed
        at once, closed at this step."""
        h = self.cfg.inner_steps
        return {f.index: (Round(self, f.index, f.rounds_done), self.step) for f in self.fragments
                if f.rounds_done < rounds and self.step >= offsets[f.index] + (f.rounds_done + 1) * h}

    def _resync_due(self) -> bool:
        """Whether we take a checkpoint now: our weights left the majority's (``resync_from`` set at a close), or
        the swarm is two rounds past ours."""
        if not self.resyncs.resync_from and (behind := self._fallen_behind()):
            self.counters["fell_behind"] += 1
            logger.warning("diloco: the swarm closed round %d, two past ours (%d); taking a checkpoint",
                           max(map(self._swarm_round, range(len(self.rounds_done)))), min(self.rounds_done))
            self.resyncs.counted_before_resync = self._still_counted()
            self.resyncs.resync_from = behind
        return bool(self.resyncs.resync_from)

    async def _resync(self) -> None:
        peers, self.resyncs.resync_from = self.resyncs.resync_from, []
        self.counters["resyncs"] += 1
        if self.user_steps is not None:
            await self.user_steps.hold()  # the script's step under way ends before the weights change
        if not await self._join_from_checkpoint(peers, rejoin=self.resyncs.counted_before_resync):
            self.state = "running"  # keep our weights; the next round's hashes tell again

    async def _inner(self, next_event: int) -> None:
        """One inner step (none where it would be thrown away: ``_behind_as_follower``); ``next_event``: the first
        step at whose end the schedule acts on the model, up to which a user's script may run on."""
        if self.user_steps is None and self._behind_as_follower():
            self.counters["steps_skipped"] += 1
            await asyncio.sleep(0)
        else:
            if self.user_steps is not None:  # the script may run on to the next step the loop acts at
                self.user_steps.grant(next_event - self.step)
            t0 = self.clock.monotonic()
            await self._train_step()
            if self.faults:
                await self.faults.enter("step", self, info={"step": self.step})
            self.timings.compute += self.clock.monotonic() - t0
        self.step += 1

    async def _end(self) -> None:
        """The last round settled with the others, our final checkpoint saved; then where the run ended is
        published every few seconds, for a node that arrives later."""
        await self._settle_final()
        for f in self.fragments:
            if f.redo is not None:
                self._drop_redo(f.index)
        self.record.final_hash = self.global_hash()
        if self.saved is None or self.saved.get("round") != self.rounds_done[-1]:
            await asyncio.to_thread(self._save_checkpoint)
        await self._last_progress()
        self.state = "done"
        logger.info("diloco run %s done: %d steps, global %s", self.cfg.run, self.step, self.final_hash)
        while True:  # keep saying where the run ended, so a node that arrives later can take the final weights
            self._publish(ROUND_HASH, {"r": self.cfg.rounds, "p": self.cfg.fragments - 1, "h": self.final_hash})
            await asyncio.sleep(5.0)

    def _behind_as_follower(self) -> bool:
        """Whether our next inner step would be thrown away: we follow every fragment's current round without
        contributing to it (a joiner before its join round), and the peers that count have closed it already (the
        median of the rounds they say they closed). Then we do not train: the round closes from the others'
        updates, which are here, as soon as our steps reach its end, so a joiner that starts rounds behind the
        swarm (a checkpoint that aged on its way, a slow start) is in step by the round it joins, instead of
        staying that far behind and sending late updates every round. Its local weights are the global ones after
        each round anyway."""
        if not self.fragments.built:
            return False
        for f in self.fragments:
            if f.rounds_done >= f.join_round or self._swarm_round(f.index) < f.rounds_done:
                return False
        return True

    def _swarm_round(self, p: int) -> int:
        """The last round of fragment p the run has closed, as far as we know: the median of the last rounds the
        peers whose word counts say they closed (so a few that lie about it move nothing); -1 if none said."""
        closed = [r for a, r in self.fragments[p].closed_by.items() if self.standing.counts(a)]
        return statistics.median_high(closed) if closed else -1

    def _fallen_behind(self) -> list[str]:
        """Peers to take a checkpoint from when the counted peers have closed two rounds past the one we are in:
        the updates of our round are gone from their stores by then (they keep a round's blobs one round), so we
        cannot close it with them; a checkpoint of theirs puts us in their round (a joiner whose checkpoint aged
        on its way, a peer that stalled). At most once per deadline."""
        if self.clock.monotonic() < self.resyncs.next_catch_up:
            return []
        for p, r in enumerate(self.rounds_done):
            latest = self._swarm_round(p)
            if latest >= r + 2:
                self.resyncs.next_catch_up = self.clock.monotonic() + self.deadline.value()
                return self._trusted_claimers(dict(self.book.hashes.get((latest, p), {})))
        return []

    async def _settle_final(self) -> None:
        """The last round has no next round whose close compares global hashes, so a peer that closed it with
        other updates than the rest (its deadline passed first) would end on its own weights. Wait, up to one
        round deadline, for the hashes of the last round from the peers that count and published one for the
        round before; in the minority, take the majority's final weights from one of them."""
        p = self.cfg.fragments - 1
        r = self.fragments[p].rounds_done - 1
        ours = self.book.published.get((r, p))
        if ours is None or r < 0:
            return  # the run ended before we closed a round (or we joined at its very end): nothing to compare
        self.state = "settling the last round"
        me = self._ctx.identity.peer_id

        def theirs(round_: int) -> dict[str, str]:
            return {a: h for a, h in self.book.hashes.get((round_, p), {}).items()
                    if a != me and self.standing.vouched(a)}

        expected = set(theirs(r - 1)) | set(self.fragments[p].last_members(set())) - {me}
        expected = {a for a in expected if self.standing.counts(a)}
        until = self.clock.monotonic() + self.deadline.value()
        while self.clock.monotonic() < until and not expected <= set(theirs(r)):
            await asyncio.sleep(0.2)
        await self._wait_if_ahead(p, r, theirs)
        verdict = rounds.hash_verdict(ours, theirs(r), me=me, salt=f"{self.cfg.run}/{r}/{p}")
        redo = self._drop_redo(p)
        if verdict is None or verdict.agrees:
            return
        if redo is not None and redo.round == r and await self._redo_with(p, redo, lambda fixed: outer.params_hash(
                [*(w := self.fragments.weights())[:p], fixed, *w[p + 1:]]) == verdict.majority):
            return
        self.counters["diverged"] += 1
        self.counters["resyncs"] += 1
        self._left_majority()
        logger.error("diloco: our weights after the last round (%d/%d) are not the majority's; taking theirs", r, p)
        if not await self._join_from_checkpoint(list(verdict.holders), rejoin=True):
            logger.error("diloco: no peer of the majority served its final weights; ending on ours")

    async def _wait_if_ahead(self, p: int, r: int, theirs) -> None:
        """We closed the run's last round while the peers that count are two or more rounds behind (we ran ahead
        of them, closing rounds without them): wait while they progress (up to ``deadline_high`` without any) for
        most of them to publish their hash of round r, so the last round is compared with theirs, not with none."""
        me = self._ctx.identity.peer_id
        peers = {a for a in self.fragments[p].closed_by if a != me and self.standing.counts(a)}
        seen = self._swarm_round(p)
        if not peers or seen >= r - 1:
            return
        self.counters["waited_for_the_swarm"] += 1
        logger.warning("diloco: we closed the last round (%d/%d) while the others are at round %d; waiting for "
                       "their hashes of it", r, p, seen)
        moved = self.clock.monotonic()
        while len(set(theirs(r)) & peers) * 2 <= len(peers):
            if (now_at := self._swarm_round(p)) > seen:
                seen, moved = now_at, self.clock.monotonic()
            elif self.clock.monotonic() - moved > self.cfg.deadline_high:
                return
            await asyncio.sleep(0.2)

    async def _after_round(self, done: int) -> None:
        """After the last fragment's round closed (every fragment has closed ``done`` rounds): evaluate, report,
        checkpoint."""
        if done % self.cfg.eval_every == 0:
            loss = await asyncio.to_thread(tasks.evaluate, self.task, self.replica.model)
            if loss is None:  # a task without evaluate(): the mean training loss of the round
                loss = self.record.round_loss()
            if loss is not None:
                self.record.losses.append((self.step, round(loss, 5)))
                await self._report(loss)
        if self.cfg.checkpoint_every and done % self.cfg.checkpoint_every == 0:
            await asyncio.to_thread(self._save_checkpoint)

    async def _train_step(self) -> None:
        """One inner step, off the event loop (the seam a simulation paces with simulated compute time): ours on the
        task's data, or the one the user's own loop takes (``user_steps``, swarmd.DiLoCo)."""
        if self.user_steps is None:
            await asyncio.to_thread(self._inner_step)
            return
        loss = await self.user_steps.next_step()
        if loss is not None:
            self._record_loss(loss)

    def _record_loss(self, value: float) -> bool:
        """Keep a step's training loss; a non-finite one withholds our updates until a round gives us the global
        weights back (False)."""
        if not math.isfinite(value):
            for f in self.fragments:
                if f.skipped is None:
                    f.skipped = f"the loss became {value} at step {self.step}"
            self._nonfinite(f"the loss ({value})", f"at step {self.step}; skipping the step and withholding our update")
            return False
        self.record.trained(value)
        return True

    def lr_factor(self) -> float:
        """The factor on the inner optimizer's base learning rate at our current inner step (``lr_schedule``)."""
        total = self.cfg.rounds * self.cfg.inner_steps if self.cfg.lr_schedule == "cosine" else 0
        return lr_scale(self.step, total, self.cfg.warmup_steps, self.cfg.lr_final)

    def _schedule_lr(self) -> None:
        if self.cfg.lr_schedule == "constant" and not self.cfg.warmup_steps:
            return  # the optimizer's own lr, untouched
        scale_lr(self.replica.inner_opt, self.lr_factor())

    def _inner_step(self) -> None:
        self.replica.model.train()
        batch = tasks.to_device(next(self.replica.data), self.device)
        loss = tasks.loss_value(self.task, self.replica.model, batch)
        self.replica.inner_opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if not math.isfinite(value):
            # this peer's training went wrong: no backward, no step, and our updates are withheld until a round
            # closes and gives us the global weights back
            self._record_loss(value)
            return
        loss.backward()
        self._schedule_lr()
        self.replica.inner_opt.step()
        # the gradients are not held between steps: a round's exchange, whose transients are the node's peak of
        # memory, runs between two steps (4 bytes a parameter: 0.44 GB for a 109M model)
        self.replica.inner_opt.zero_grad(set_to_none=True)
        self._record_loss(value)

    async def _report(self, loss: float) -> None:
        await self._write_progress(self.step, self._samples(self.step), loss, self.counters["bytes_sent"],
                                   self.counters["rounds"])

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        wall = (self.clock.monotonic() - self.started) if self.started else 0.0
        rounds_done = self.rounds_done
        built = self.fragments.built
        return {
            "run": self.cfg.run,
            "state": self.state,
            "round": rounds_done[-1] if rounds_done else 0,
            "total_rounds": self.cfg.rounds,
            "train_loss": None if self.record.train_loss is None else round(self.record.train_loss, 5),
            "inner_lr": ([round(g["lr"], 8) for g in self.replica.inner_opt.param_groups][:8]
                         if self.replica.inner_opt is not None else None),
            "inner_betas": ([list(g["betas"]) for g in self.replica.inner_opt.param_groups if "betas" in g][:8]
                            if self.replica.inner_opt is not None else None),
            "withheld": {str(f.index): f.skipped for f in self.fragments if f.skipped is not None},
            "codec": self.cfg.codec,
            "bits_per_param_step": (round(bits_per_param_step(self.counters["bytes_sent"], sum(
                f.numel() for f in self.fragments), self.step), 6) if built else None),
            # error feedback: the norm of what the codec dropped of our last update, per fragment (null: off)
            "residual_norm": ({str(f.index): f.residual_norm for f in self.fragments if f.residual_norm is not None}
                              if self.feedback else None),
            **self._task_status(),
            "step": self.step,
            "global_hash": self.final_hash or (self.global_hash() if built else None),
            "final_hash": self.final_hash,
            "parameters": sum(f.numel() for f in self.fragments) if built else None,
            "history": list(self.record.history)[-64:],
            "losses": list(self.record.losses)[-40:],
            "compute_fraction": round(1 - self.timings.blocked / wall, 4) if wall else None,
            "initial_weights": self.record.initial_weights,
            "deadline_s": round(self.deadline.value(), 2),
            "transfer_rate_bps": round(self._transfer_rate()) if self.links.rates else None,
            "exchange": {"setting": self.cfg.exchange, **self.record.exchange},
            # how the others' updates reach us and ours reaches the rounds: peers we have no direct path to, whose
            # updates came through members we reach (pulls asked of them), and the rounds our update was in
            # (scatter) members we lack a direct path to whose chunks members reaching both reduced, by rounds, and
            # the rounds we reduced no part for lack of a path
            "reach": {"via": "pulled", "through_members": dict(sorted(self.links.through_members.items())),
                      "reduced_by_members": dict(sorted(self.links.reduced_by_members.items())),
                      "rounds_not_reducing": self.counters["rounds_not_reducing"],
                      "rounds_with_our_update": self.counters["rounds_with_our_update"],
                      "rounds_closed": self.counters["rounds_with_our_update"]
                      + self.counters["rounds_without_our_update"]},
            # a round's large buffers kept for the next (protocols/buffers.py): bytes held, taken (reused: from
            # the pool), given back, refused (held elsewhere, or no room)
            "buffers": self._buffers.status(),
            **dict(sorted(self.counters.items())),
        }

    def routes(self) -> list:
        return []


def _next_event(step: int, total: int, h: int, offsets: list[int], rounds_done: list[int], rounds: float,
                waiting: dict[int, tuple[Round, int]]) -> int:
    """The first step after ``step`` at whose end the schedule acts on the model: a fragment's update announced
    (every h steps from its offset), a waiting round closed, or the run's last step."""
    event = total
    for p, offset in enumerate(offsets):
        if p not in waiting and rounds_done[p] < rounds:
            k = max(1, -(-(step + 1 - offset) // h))
            event = min(event, offset + k * h)
    for _, close_at in waiting.values():
        event = min(event, max(close_at, step + 1))
    return max(event, step + 1)
