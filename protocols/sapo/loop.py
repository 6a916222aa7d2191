"""The SAPO loop as a node service (the algorithm: the package's docstring)."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import random

import msgpack
import torch
from aiohttp import web

from swarmd.node.services import NodeContext
from swarmd.protocols import checkpoint, codecs, rounds
from swarmd.protocols import task as tasks
from swarmd.protocols.checkpoint import model_state
from swarmd.protocols.faults import FaultPlan
from swarmd.protocols.gossip import Gossip
from swarmd.protocols.grpo import Group
from swarmd.protocols.reach import Reach
from swarmd.protocols.sapo.config import SapoConfig
from swarmd.protocols.sapo.items import (
    ITEM_BURST, ITEM_RATE, MAX_AUTHORS, READY, ROLLOUTS, Rules, question, question_seed, reward, score,
)
from swarmd.protocols.sapo.validate import ValidateMixin
from swarmd.protocols.task import Task, TaskError
from swarmd.protocols.taskloop import TaskLoop
from swarmd.transport.penalties import TokenBuckets
from swarmd.transport.wire import WIRE

logger = logging.getLogger("swarmd.protocols.sapo")  # one logger for the whole package

HISTORY = 5000  # per-round records kept (for /sapo/history)


def policy_seed(seed: int, peer_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"policy/{seed}/{peer_id}".encode(), digest_size=4).digest(), "big")


class SapoLoop(ValidateMixin, TaskLoop):
    """The loop as a node service (see the package's docstring)."""

    name = "sapo"

    def __init__(self, gossip: Gossip, config: SapoConfig, task: Task):
        self.gossip = gossip
        self.cfg = config
        self._init_task(task)
        self.rules = Rules(task, config)
        self.fps.own = tasks.fingerprint(task, config.shared(), None)
        # rounds are each peer's own: per author, the items of its newest round (its round number, its seeds)
        self.inbox: collections.OrderedDict[str, tuple[int, list]] = collections.OrderedDict()
        self.used: dict[str, int] = {}  # author -> the newest of its rounds we drew from
        self._rate = TokenBuckets(ITEM_RATE, ITEM_BURST, max_keys=4 * MAX_AUTHORS,  # per author
                                  clock=lambda: self.clock.monotonic())
        self.ready: set[str] = set()
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.counters: collections.Counter = collections.Counter()
        # per peer, what our verifier made of its completions (ours included), and which peers are useless
        self.sources = rounds.Sources("")
        self.reach = Reach("gossiped")  # our rounds, and the items of peers without a direct path they took
        self.round = 0
        self.joined_at = 0  # the round we started at (> 0: resumed from our checkpoint); nobody moves our round
        self.cumulative_reward = 0.0
        self.state = "starting"
        self._arrived = asyncio.Event()
        self._participants: set[str] = set()
        self._ctx: NodeContext | None = None
        self.policy = None
        self.model: torch.nn.Module | None = None
        self.last_loss: float | None = None
        self.faults = FaultPlan()  # a test's faults by peer, round and phase (none in production)

    # ------------------------------------------------------------------ service
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self._init_standing(ctx)
        self.sources.me = ctx.identity.peer_id
        self.gossip.subscribe(self.topic, max_size=self.rules.max_message, validator=self._validate,
                              queue_size=0)

    async def close(self) -> None:
        self._stop_progress()

    async def run(self) -> None:
        await self._guarded(self._run)

    def _build(self, seed: int) -> None:
        self._setup_device()
        make = self.task.obj.policy
        kwargs = {"device": str(self.device)} if tasks.accepts(make, "device") else {}
        with tasks.seeded(seed):
            self.policy = self.task.call("policy", seed, **kwargs)
        for method in ("generate", "step"):
            if not callable(getattr(self.policy, method, None)):
                raise TaskError(f"{self.task.where('policy')} returned an object without {method}()")
        model = getattr(self.policy, "model", None)
        self.model = model if isinstance(model, torch.nn.Module) else None

    async def _run(self) -> None:
        self.runtime.threads = tasks.set_threads(self.cfg.threads)
        cfg, me = self.cfg, self._ctx.identity.peer_id
        seed = cfg.policy_seed if cfg.policy_seed is not None else policy_seed(cfg.seed, me)
        self.state = "building the policy"
        with self.work.track("policy build"):
            await asyncio.to_thread(self._build, seed)
        self._resume_own()
        rng = random.Random(seed)
        last = cfg.rounds or float("inf")
        if self.round < last:
            await self._wait_for_peers()
        datasets = list(self.task.obj.datasets)
        while self.round < last:
            r = self.round
            q_seed = question_seed(cfg.run, cfg.seed, me, r)
            specs = [(datasets[k % len(datasets)], k) for k in range(cfg.questions)]
            own, comps = await asyncio.to_thread(self._rollouts, q_seed, specs)  # never on the event loop
            if self.faults:
                own, comps = self.faults.altered("rollouts", self, (own, comps), r=r,
                                                 info={"q_seed": q_seed, "specs": specs})
            own_reward = sum(sum(g.rewards) for g in own) / (len(own) * cfg.completions)
            await asyncio.to_thread(self._mark_published, r)  # on disk before anyone can hold it
            for g in own:  # our own policy is one of the sources a peer's completions are judged against
                self.sources.scored(me, g.rewards)
            self._publish(r, q_seed, specs, comps)  # a silo (J = 0) shares too: others may learn from it
            if self.faults:
                await self.faults.enter("close", self, r=r)
            await self._close_round(r)
            if self.faults:
                await self.faults.enter("closed", self, r=r)
            external, ext_reward, scored = await asyncio.to_thread(self._draw_external, rng)
            self._judge_sources(r, scored)
            local = rounds.pick_local(own, cfg.local, rng)
            step = await asyncio.to_thread(self._step, local + external)
            self.cumulative_reward += own_reward
            self.counters["items_used_local"] += sum(g.informative for g in local)
            self.counters["items_used_external"] += len(external)
            self.counters["rounds_trained"] += step["groups"] > 0
            self.last_loss = step["loss"]
            self.history.append([r, round(own_reward, 4), None if ext_reward is None else round(ext_reward, 4),
                                 len(external), step["groups"]])
            self.round = r + 1
            if self.round % cfg.report_every == 0 or self.round == cfg.rounds:
                await self._report_progress(step["loss"], own_reward, ext_reward)
            if cfg.checkpoint_every and self.round % cfg.checkpoint_every == 0:
                await asyncio.to_thread(self._save_checkpoint)
        if self.saved is None or self.saved.get("round") != self.round:
            await asyncio.to_thread(self._save_checkpoint)
        await self._last_progress()
        self.state = "done"
        logger.info("sapo run %s done after %d rounds: cumulative reward %.3f", cfg.run, cfg.rounds,
                    self.cumulative_reward)
        await asyncio.Event().wait()

    def _rollouts(self, q_seed: int, specs: list[tuple[str, int]]) -> tuple[list[Group], list[list[str]]]:
        """Our questions of the round, G completions each from our policy, scored by our verifier."""
        questions = [question(self.task, d, q_seed, k) for d, k in specs]
        comps = self._generate([q.prompt for q in questions])
        return [Group(q.prompt, c, [reward(self.task, q, x) for x in c]) for q, c in zip(questions, comps)], comps

    def _generate(self, prompts: list[str]) -> list[list[str]]:
        try:
            out = self.policy.generate(prompts, self.cfg.completions)
        except Exception as e:
            raise TaskError(f"task {self.task.spec}: policy.generate() raised {type(e).__name__}: {e}") from e
        if not (isinstance(out, list) and len(out) == len(prompts) and all(
                isinstance(c, list) and len(c) == self.cfg.completions and all(isinstance(x, str) for x in c)
                for c in out)):
            raise TaskError(f"task {self.task.spec}: policy.generate() must return {len(prompts)} lists of "
                            f"{self.cfg.completions} strings")
        # what we share must pass our own wire rules (and everyone else's): clip and filter like a receiver would
        return [[x[:self.rules.max_completion] if self.rules.valid(x[:self.rules.max_completion]) else ""
                 for x in c] for c in out]

    def _step(self, groups: list[Group]) -> dict:
        """One policy update; a non-finite loss or weights afterwards undo it (and say so)."""
        backup = {k: v.detach().clone() for k, v in self.model.state_dict().items()} if self.model is not None \
            else None
        try:
            result = self.policy.step(groups)
        except Exception as e:
            raise TaskError(f"task {self.task.spec}: policy.step() raised {type(e).__name__}: {e}") from e
        loss = float(result.get("loss", 0.0)) if isinstance(result, dict) else float("nan")
        if isinstance(result, dict) and type(result.get("truncated")) is int:  # cut to the policy's token budget
            self.counters["completions_truncated"] += result["truncated"]
        groups_used = int(result.get("groups", len(groups))) if isinstance(result, dict) else 0
        broken = not math.isfinite(loss) or (self.model is not None and not all(
            codecs.all_finite(p) for p in self.model.parameters()))
        if broken:
            if backup is not None:
                self.model.load_state_dict(backup)
            self._nonfinite("the policy update", f"gave a non-finite loss or weights at round {self.round}; undone")
            return {"groups": 0, "loss": 0.0}
        return {"groups": groups_used, "loss": loss}

    # ------------------------------------------------------------------ our own checkpoint (the data dir)
    def _save_checkpoint(self) -> None:
        if self.model is None:
            return
        tensors, opt_meta = self._with_optimizer(self._model_tensors(self.model), getattr(self.policy, "opt", None))
        self._save(tensors, round=self.round, step=self.round, cumulative_reward=self.cumulative_reward, **opt_meta)
        self.counters["checkpoints_saved"] += 1

    def _marker_path(self):
        return self._checkpoint_path().with_suffix(".published")

    def _mark_published(self, r: int) -> None:
        """The round we are about to share items of: a restart goes on after it, never shares that round again."""
        checkpoint.save_marker(self._marker_path(), {"round": r, "fingerprint": self.fp})

    def _resume_own(self) -> None:
        self._resume_checkpoint()
        # rounds we shared items of after that checkpoint (or without one): the others hold them, and a second,
        # different set of items for one of them is equivocation (refused, penalised: 30 times in 40 restarts of
        # the kill bench without this marker); we go on after the last one, its training lost with the process
        marker = checkpoint.load_marker(self._marker_path())
        if marker is not None and marker.get("fingerprint") == self.fp and type(marker.get("round")) is int \
                and marker["round"] >= self.round:
            logger.info("sapo: round %d shared before a restart: going on from round %d", marker["round"],
                        marker["round"] + 1)
            self.round = self.joined_at = marker["round"] + 1
            self.counters["rounds_skipped_after_restart"] += 1

    def _resume_checkpoint(self) -> None:
        if self.model is None:
            return
        found = self._own_checkpoint()
        if found is None:
            return
        tensors, meta = found
        try:
            self.model.load_state_dict(model_state(tensors))
        except (RuntimeError, KeyError) as e:
            logger.warning("sapo: ignoring our checkpoint %s: another policy (%s)", self._checkpoint_path(),
                           str(e).splitlines()[0])
            return
        self.round = self.joined_at = int(meta["round"])
        self.cumulative_reward = float(meta.get("cumulative_reward", 0.0))
        inner = self._restore_optimizer(getattr(self.policy, "opt", None), tensors, meta)
        self.ckpt.resumed = {"source": "own checkpoint", "round": self.round, "step": self.round,
                             "optimizer_state": inner}
        self.ckpt.saved = {"path": str(self._checkpoint_path()), "round": self.round, "step": self.round}
        logger.info("sapo: resuming run %s from our checkpoint at round %d", self.cfg.run, self.round)

    # ------------------------------------------------------------------ rounds
    def _publish(self, r: int, q_seed: int, specs: list[tuple[str, int]], comps: list[list[str]]) -> None:
        if self.faults:
            comps = self.faults.altered("share", self, comps, r=r, info={"q_seed": q_seed, "specs": specs})
        body = {"r": r, "items": [{"spec": [d, q_seed, k], "comps": c} for (d, k), c in zip(specs, comps)]}
        mid = self.gossip.publish(self.topic, WIRE.pack(ROLLOUTS, self._tag(body)))
        self.counters["items_shared"] += len(comps)
        self.counters["messages_published"] += 1
        self.counters["wire_bytes_published"] += len(msgpack.packb([3, self.gossip.cache[mid].wire()],
                                                                   use_bin_type=True)) + 4

    async def _wait_for_peers(self) -> None:
        """Our first round starts once ``min_peers`` (us included) are here: connected peers (directly or through a
        relay: ``rounds.linked``) that said they are ready or already share items (a run in progress). Rounds are
        each peer's own: a peer that arrives late starts at its own round 0 (or its checkpoint's), and no message
        moves our round."""
        self.state = "waiting for peers"
        barrier = rounds.StartBarrier(self.cfg.min_peers)
        while True:
            if barrier.announce(self.clock.monotonic()):
                self.gossip.publish(self.topic, WIRE.pack(READY, self._tag({"r": 0, "ready": True})))
            linked = rounds.linked(self._ctx)  # a peer reached through a relay only counts: its items are
            here = {p for p in self.ready | set(self.inbox) if linked(p)}  # gossiped through the members
            self._check_refusal(len(here))
            if barrier.start(self.clock.monotonic(), len(here) + 1):
                self._participants = here
                self.standing.found(here)
                break
            await asyncio.sleep(0.1)
        self.ready.clear()
        self.state = "running"

    def _fresh(self) -> set[str]:
        """Authors with items we have not drawn from yet."""
        return {a for a, (rr, _) in self.inbox.items() if rr > self.used.get(a, -1)}

    async def _close_round(self, r: int) -> None:
        """Wait, at most ``deadline`` s, until every peer of our last round whose word counts has shared new items
        (of its own next round: rounds are each peer's own). A fresh key is never waited for."""
        expected = self.standing.counting(self._participants) - {self._ctx.identity.peer_id}
        opened = self.clock.monotonic()
        wait = rounds.RoundWait(frozenset(expected), frozenset(), opened + self.cfg.deadline, 0.0)
        await self._wait_round(wait, self._arrived, self._fresh)
        if not expected <= self._fresh():
            self.counters["deadline_missed"] += 1
            logger.info("sapo round %d closed without %d peer(s)", r, len(expected - self._fresh()))
        self._participants = self._fresh()
        self._record_round(r, waited_s=self.clock.monotonic() - opened, deadline_s=self.cfg.deadline,
                           participants=self._participants, missing=expected - self._participants)
        self.standing.record(self._participants)
        me = self._ctx.identity.peer_id
        self.reach.took(self._participants | {me}, me, self._ctx.direct)  # ours: shared before the close
        self._rate.prune()

    def _draw_external(self, rng: random.Random) -> tuple[list[Group], float | None, list[str]]:
        """Re-score the peers' new items with our verifier (the I/O-free rules: ``rounds.new_items``,
        ``rounds.draw``); draw J informative groups, at most ``max_per_source`` from any one peer. Returns them,
        the mean external reward of what we scored, and the peers whose items we scored."""
        candidates: dict[str, list[Group]] = collections.defaultdict(list)
        rewards, n = 0.0, 0
        authors = []
        for author, rr, items in rounds.new_items(self.inbox, self.used, self._ctx.identity.peer_id):
            q_seed = question_seed(self.cfg.run, self.cfg.seed, author, rr)
            authors.append(author)
            for dataset, index, comps in items:
                group = score(self.task, dataset, q_seed, index, comps)
                self.counters["external_items_scored"] += 1
                self.sources.scored(author, group.rewards)
                rewards += sum(group.rewards)
                n += len(group.rewards)
                if group.informative:
                    candidates[author].append(group)
                else:
                    self.counters["dropped_zero_advantage"] += 1
        chosen, capped = rounds.draw(candidates, self.cfg.external, self.cfg.max_per_source, rng)
        self.counters["capped_per_source"] += capped
        for author, _ in chosen:
            self.sources.get(author).used += 1
        return [g for _, g in chosen], (rewards / n if n else None), authors

    def _judge_sources(self, r: int, authors: list[str]) -> None:
        """A peer whose completions we scored this round and that is useless (``rounds.Sources``: nothing right for
        so long that even a policy 4x weaker than the typical peer's would have been) is shown in ``offenders``
        and ``sources``, and penalised as a suspect when first judged so and each time its zero streak doubles."""
        for author in authors:
            if not self.sources.to_penalise(author):
                continue
            s = self.sources.get(author)
            self.counters["judged_useless"] += 1
            self.round_log.offended(author, "useless", r)
            self._ctx.transport.penalties.penalize(
                author, "suspect", f"sapo: no completion of its last {s.streak} items scored above 0 by our "
                f"verifier, while the other sources' recent items had one that did at a median rate of "
                f"{self.sources.bar(author):.3f}")

    async def _report_progress(self, loss: float, own: float, ext: float | None) -> None:
        metrics = {"reward": float(own), "cumulative_reward": float(self.cumulative_reward),
                   "items_shared": float(self.counters["items_shared"]),
                   "items_used_external": float(self.counters["items_used_external"])}
        if ext is not None:
            metrics["external_reward"] = float(ext)
        await self._write_progress(self.round, self.round * self.cfg.questions * self.cfg.completions, loss,
                                   self.counters["wire_bytes_published"], self.round, metrics)

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        recent = list(self.history)[-50:]
        own = [h[1] for h in recent]
        ext = [h[2] for h in recent if h[2] is not None]
        return {
            "run": self.cfg.run,
            "state": self.state,
            "round": self.round,
            "rounds": self.cfg.rounds,
            "total_rounds": self.cfg.rounds,
            "joined_at": self.joined_at,
            "local_external": [self.cfg.local, self.cfg.external],
            "last_loss": self.last_loss,
            "policy_parameters": sum(p.numel() for p in self.model.parameters()) if self.model is not None else None,
            **self._task_status(),
            "cumulative_reward": round(self.cumulative_reward, 4),
            "reward_last50": round(sum(own) / len(own), 4) if own else None,
            "external_reward_last50": round(sum(ext) / len(ext), 4) if ext else None,
            "peers_in_round": len(self._participants),
            "peers_with_items": len(self.inbox),
            "reach": self.reach.status(),
            "standing": self.standing.status() if hasattr(self, "standing") else None,
            "history": recent[-40:],  # [round, own reward, external reward, ext used, groups]
            # per source peer, as scored by our verifier: items, mean reward of their completions, the recent
            # fraction of its items with a completion scored above 0, groups we used, items in a row with none (the
            # latest), and whether that makes it useless (rounds.Sources)
            "sources": {a: {"items": s.items, "reward": round(s.reward / s.completions, 4) if s.completions else None,
                            "hit_rate": round(s.hits, 4), "used": s.used, "zero_streak": s.streak,
                            "useless": self.sources.useless(a)}
                        for a, s in sorted(self.sources.by_peer.items(), key=lambda kv: -kv[1].items)[:32]
                        if a != self.sources.me},
            **dict(sorted(self.counters.items())),
        }

    def bytes_sent(self) -> int:
        return int(self.counters["wire_bytes_published"])

    def routes(self) -> list:
        return [web.get("/sapo/history", self._http_history)]

    async def _http_history(self, request: web.Request) -> web.Response:
        """Every round's record (the last 5000): [round, own reward, external reward, external used, groups]."""
        return web.json_response({"run": self.cfg.run, "rounds": list(self.history)})
