"""SAPO (Swarm sAmpling Policy Optimization): RL post-training where peers share rollouts, not weights.

Each round r, every peer (``../shared/protocols.md`` 2.1, with the reference implementation's weaknesses fixed):

1. samples ``questions`` tasks from its generator, at a seed that is a function of (run, seed, its peer id, r), so
   anyone can tell whether a spec really is that peer's for that round;
2. samples ``completions`` (G) answers per question from its own policy and scores them with its own verifier;
3. publishes ``{"r": r, "items": [{"spec": [gen, ver, seed, idx], "comps": [str] * G}, ...]}``, a signed pubsub
   message: task specs instead of questions and answers, so no peer is trusted with ground truth;
4. waits (at most ``deadline`` seconds) for the items of the peers that took part in the last round;
5. builds its training set: ``local`` (I) of its own groups, and ``external`` (J) groups drawn uniformly from what
   others shared this round and late items of the round before, after regenerating each question from its spec and
   re-scoring every completion with its own verifier; groups whose completions all scored the same carry no
   advantage and are dropped, and at most ``max_per_source`` groups come from any one peer;
6. takes one GRPO step (``protocols.grpo``: clipped ratio, no KL).

Validation runs before anything is forwarded: malformed, oversized (message, item count, completion count and
length, alphabet), forged (a spec that is not the author's for that round), duplicate and far-future items are
rejected, which penalises the peer that sent them. Completions are text, re-tokenized by each receiver, so peers may
run policies of any size. Rewards (own and external), items shared and used, and bytes go to ``/status`` and, every
``report_every`` rounds, into the replicated progress register.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import random
import time

import msgpack
import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from node.services import NodeContext
from protocols import arith, outer
from protocols.gossip import Gossip, Message, Verdict
from protocols.grpo import MAX_COMPLETION, Group, Policy, tokenizable

logger = logging.getLogger(__name__)

MAX_ITEMS = 64  # questions per message
MAX_COMPLETIONS = 32  # completions per question
MAX_MESSAGE = 8 * 1024 + MAX_ITEMS * (48 + MAX_COMPLETIONS * (MAX_COMPLETION + 2))
HISTORY = 5000  # per-round records kept (for /sapo/history)


def question_seed(run: str, seed: int, peer_id: str, round_: int) -> int:
    """The generator seed of ``peer_id``'s questions in round ``round_`` (63 bits)."""
    h = hashlib.blake2b(f"{run}/{seed}/{peer_id}/{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


def policy_seed(seed: int, peer_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"policy/{seed}/{peer_id}".encode(), digest_size=4).digest(), "big")


class SapoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    run: str = Field("sapo-demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    seed: int = Field(1, ge=0)
    rounds: int = Field(300, ge=1, le=10_000_000)
    questions: int = Field(8, ge=1, le=MAX_ITEMS)  # sampled per round
    completions: int = Field(8, ge=2, le=MAX_COMPLETIONS)  # G, per question
    local: int = Field(4, ge=0)  # I: own groups per update
    external: int = Field(4, ge=0)  # J: groups from other peers per update (0: the no-sharing baseline)
    max_per_source: int = Field(2, ge=1)  # external groups from any one peer per update
    d: int = Field(64, ge=8, le=1024)
    layers: int = Field(2, ge=1, le=12)
    heads: int = Field(4, ge=1, le=16)
    lr: float = Field(1e-3, gt=0)
    epochs: int = Field(1, ge=1, le=8)  # GRPO epochs per update (the clipping matters from the second on)
    temperature: float = Field(1.0, gt=0)
    min_peers: int = Field(1, ge=1)  # wait for this many peers (us included) before round 0
    deadline: float = Field(5.0, gt=0)  # seconds to wait for a round's items from the last round's peers
    report_every: int = Field(5, ge=1)  # rounds between writes to the replicated progress register
    policy_seed: int | None = Field(None, ge=0)  # default: derived from seed and our peer id

    @model_validator(mode="after")
    def _consistent(self):
        if self.local > self.questions:
            raise ValueError(f"local ({self.local}) cannot exceed questions per round ({self.questions})")
        if self.local + self.external < 1:
            raise ValueError("local + external must be at least 1")
        if self.d % self.heads:
            raise ValueError(f"d ({self.d}) must be a multiple of heads ({self.heads})")
        return self


def parse_items(body: object, *, run: str, seed: int, author: str) -> tuple[int, list[tuple[int, list[str]]]]:
    """Check a rollout message from the wire; returns ``(round, [(index, completions), ...])``.

    Raises ValueError (with the reason) on anything malformed, oversized or forged."""
    if not isinstance(body, dict) or set(body) != {"r", "items"}:
        raise ValueError("not a rollout message")
    r, items = body["r"], body["items"]
    if type(r) is not int or r < 0:
        raise ValueError("bad round")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS:
        raise ValueError("items must be a list of 1..64")
    expected_seed = question_seed(run, seed, author, r)
    out, seen = [], set()
    for item in items:
        if not isinstance(item, dict) or set(item) != {"spec", "comps"}:
            raise ValueError("an item must have exactly spec and comps")
        q_seed, index = arith.check_spec(item["spec"])
        if q_seed != expected_seed:
            raise ValueError("a spec that is not the author's for this round")
        if index in seen:
            raise ValueError("duplicate item")
        seen.add(index)
        comps = item["comps"]
        if not isinstance(comps, list) or not 2 <= len(comps) <= MAX_COMPLETIONS:
            raise ValueError("comps must be a list of 2..32")
        for c in comps:
            if not isinstance(c, str) or not 0 < len(c) <= MAX_COMPLETION or not tokenizable(c):
                raise ValueError("a completion is too long or outside the task's alphabet")
        out.append((index, comps))
    return r, out


def score(q_seed: int, index: int, comps: list[str]) -> Group:
    """Regenerate the question from its spec and score the completions with our verifier."""
    q = arith.question(q_seed, index)
    return Group(q.prompt, comps, [arith.reward(q, c) for c in comps])


class SapoLoop:
    """The loop as a node service (see the module docstring)."""

    name = "sapo"

    def __init__(self, gossip: Gossip, config: SapoConfig):
        self.gossip = gossip
        self.cfg = config
        self.topic = f"sapo/{config.run}"
        self.inbox: dict[int, dict[str, list]] = collections.defaultdict(dict)  # round -> author -> items
        self.used: set[tuple[int, str]] = set()  # (round, author) whose items were drawn from already
        self.ready: set[str] = set()
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.counters: collections.Counter = collections.Counter()
        self.sources: dict[str, list] = {}  # peer -> [items scored, completions, reward sum, groups used]
        self.round = 0
        self.joined_at = 0  # the round we started at (> 0: we joined a run in progress)
        self.cumulative_reward = 0.0
        self.state = "starting"
        self._arrived = asyncio.Event()
        self._participants: set[str] = set()
        self._ctx: NodeContext | None = None
        self.policy: Policy | None = None

    # ------------------------------------------------------------------ service
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self.gossip.subscribe(self.topic, max_size=MAX_MESSAGE, validator=self._validate, queue_size=0)

    async def close(self) -> None:
        pass

    async def run(self) -> None:
        torch.set_num_threads(1)
        cfg, me = self.cfg, self._ctx.identity.peer_id
        seed = cfg.policy_seed if cfg.policy_seed is not None else policy_seed(cfg.seed, me)
        self.policy = Policy(seed, d=cfg.d, layers=cfg.layers, heads=cfg.heads, lr=cfg.lr, epochs=cfg.epochs)
        rng = random.Random(seed)
        await self._wait_for_peers()
        while self.round < cfg.rounds:
            r = self.round
            q_seed = question_seed(cfg.run, cfg.seed, me, r)
            questions = [arith.question(q_seed, k) for k in range(cfg.questions)]
            comps = await asyncio.to_thread(self.policy.generate, [q.prompt for q in questions], cfg.completions,
                                            temperature=cfg.temperature)
            own = [Group(q.prompt, c, [arith.reward(q, x) for x in c]) for q, c in zip(questions, comps)]
            own_reward = sum(sum(g.rewards) for g in own) / (len(own) * cfg.completions)
            self._publish(r, q_seed, comps)  # a silo (J = 0) shares too: others may learn from it
            await self._close_round(r)
            external, ext_reward = self._draw_external(r, rng)
            local = rng.sample(own, cfg.local)
            step = await asyncio.to_thread(self.policy.step, local + external)
            self.cumulative_reward += own_reward
            self.counters["items_used_local"] += sum(g.informative for g in local)
            self.counters["items_used_external"] += len(external)
            self.counters["rounds_trained"] += step["groups"] > 0
            self.history.append([r, round(own_reward, 4), None if ext_reward is None else round(ext_reward, 4),
                                 len(external), step["groups"]])
            self.round = r + 1
            if self.round % cfg.report_every == 0 or self.round == cfg.rounds:
                await self._report_progress(step["loss"], own_reward, ext_reward)
        self.state = "done"
        logger.info("sapo run %s done after %d rounds: cumulative reward %.3f", cfg.run, cfg.rounds,
                    self.cumulative_reward)
        await asyncio.Event().wait()

    # ------------------------------------------------------------------ rounds
    def _publish(self, r: int, q_seed: int, comps: list[list[str]]) -> None:
        spec = [arith.GENERATOR, arith.VERSION, q_seed]
        body = {"r": r, "items": [{"spec": spec + [k], "comps": c} for k, c in enumerate(comps)]}
        mid = self.gossip.publish(self.topic, msgpack.packb(body, use_bin_type=True))
        self.counters["items_shared"] += len(comps)
        self.counters["messages_published"] += 1
        self.counters["wire_bytes_published"] += len(msgpack.packb([3, self.gossip.cache[mid].wire()],
                                                                   use_bin_type=True)) + 4

    async def _wait_for_peers(self) -> None:
        """Round 0 starts once ``min_peers`` (us included) said they are ready; a peer that arrives after the run
        began joins at the round the others are in."""
        self.state = "waiting for peers"
        grace_until, announced = None, 0.0
        while True:
            if time.monotonic() - announced > 1.0:  # repeated: peers whose links form later must hear it too
                self.gossip.publish(self.topic, msgpack.packb({"r": 0, "ready": True}))
                announced = time.monotonic()
            live = [r for r, authors in self.inbox.items() if r > 0 and authors]
            if live:
                self.round = self.joined_at = min(max(live), self.cfg.rounds - 1)
                self._participants = set(self.inbox[self.round])
                logger.info("sapo: the run began without us; joining at round %d", self.round)
                break
            if len(self.ready) + 1 >= self.cfg.min_peers:
                grace_until = grace_until or time.monotonic() + 1.0
                if time.monotonic() >= grace_until:
                    self._participants = set(self.ready)
                    break
            await asyncio.sleep(0.1)
        self.state = "running"

    async def _close_round(self, r: int) -> None:
        """Wait until every peer of the last round has shared round ``r``'s items, at most ``deadline`` s."""
        expected = self._participants - {self._ctx.identity.peer_id}
        if not await outer.wait_until(lambda: expected <= set(self.inbox[r]), self._arrived, self.cfg.deadline):
            self.counters["deadline_missed"] += 1
            logger.info("sapo round %d closed without %d peer(s)", r, len(expected - set(self.inbox[r])))
        self._participants = set(self.inbox[r])
        for old in [x for x in self.inbox if x < r - 1]:
            del self.inbox[old]
        self.used = {(x, a) for x, a in self.used if x >= r - 1}

    def _draw_external(self, r: int, rng: random.Random) -> tuple[list[Group], float | None]:
        """Re-score the items of round r (and late ones of r - 1) with our verifier; draw J informative groups,
        at most ``max_per_source`` from any one peer. Returns them and the mean external reward of round r."""
        me = self._ctx.identity.peer_id
        candidates: dict[str, list[Group]] = collections.defaultdict(list)
        rewards, n = 0.0, 0
        for rr in (r - 1, r):
            for author, items in self.inbox.get(rr, {}).items():
                if author == me or (rr, author) in self.used:
                    continue
                self.used.add((rr, author))
                q_seed = question_seed(self.cfg.run, self.cfg.seed, author, rr)
                source = self._source(author)
                for index, comps in items:
                    group = score(q_seed, index, comps)
                    self.counters["external_items_scored"] += 1
                    source[0] += 1
                    source[1] += len(group.rewards)
                    source[2] += sum(group.rewards)
                    if rr == r:
                        rewards += sum(group.rewards)
                        n += len(group.rewards)
                    if group.informative:
                        candidates[author].append(group)
                    else:
                        self.counters["dropped_zero_advantage"] += 1
                if rr == r - 1:
                    self.counters["late_items_scored"] += len(items)
        pool = [(author, g) for author, groups in candidates.items() for g in groups]
        rng.shuffle(pool)
        chosen, per_source = [], collections.Counter()
        for author, group in pool:
            if len(chosen) == self.cfg.external:
                break
            if per_source[author] >= self.cfg.max_per_source:
                self.counters["capped_per_source"] += 1
                continue
            per_source[author] += 1
            chosen.append(group)
        for author, n in per_source.items():
            self._source(author)[3] += n
        return chosen, (rewards / n if n else None)

    def _source(self, author: str) -> list:
        if author not in self.sources and len(self.sources) >= 256:
            self.sources.pop(min(self.sources, key=lambda a: self.sources[a][0]))
        return self.sources.setdefault(author, [0, 0, 0.0, 0])

    async def _report_progress(self, loss: float, own: float, ext: float | None) -> None:
        if self._ctx.replicator is None:
            return
        metrics = {"reward": float(own), "cumulative_reward": float(self.cumulative_reward),
                   "items_shared": float(self.counters["items_shared"]),
                   "items_used_external": float(self.counters["items_used_external"])}
        if ext is not None:
            metrics["external_reward"] = float(ext)
        try:
            await self._ctx.replicator.write("progress", {
                "step": self.round, "samples": self.round * self.cfg.questions * self.cfg.completions,
                "loss": float(loss), "bytes": int(self.counters["wire_bytes_published"]), "round": self.round,
                "metrics": metrics})
        except ValueError as e:
            logger.warning("could not record sapo progress: %s", e)

    # ------------------------------------------------------------------ validation (runs before forwarding)
    def _validate(self, message: Message) -> Verdict:
        try:
            body = msgpack.unpackb(message.data, raw=False, strict_map_key=True, max_ext_len=0)
        except Exception:
            self.counters["rejected_malformed"] += 1
            return Verdict.REJECT
        if isinstance(body, dict) and set(body) == {"r", "ready"}:
            if body["ready"] is not True or body["r"] != 0:
                return Verdict.REJECT
            self.ready.add(message.author)
            return Verdict.ACCEPT
        try:
            r, items = parse_items(body, run=self.cfg.run, seed=self.cfg.seed, author=message.author)
        except ValueError as e:
            self.counters["rejected_malformed"] += 1
            logger.debug("sapo: rejected items from %s: %s", message.author, e)
            return Verdict.REJECT
        if r >= self.cfg.rounds or (self.state == "running" and r > self.round + 4):
            self.counters["rejected_future"] += 1
            return Verdict.REJECT  # far ahead of the swarm we run with: flooding rounds
        if r < self.round - 1:
            self.counters["stale"] += 1
            return Verdict.IGNORE  # too late to be used by anyone in step with us: not forwarded
        if message.author in self.inbox[r]:
            self.counters["equivocation"] += 1
            return Verdict.REJECT  # a second, different set of items for one round
        if len(self.inbox[r]) >= 1024:
            return Verdict.IGNORE
        self.inbox[r][message.author] = items
        self._arrived.set()
        return Verdict.ACCEPT

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
            "joined_at": self.joined_at,
            "local_external": [self.cfg.local, self.cfg.external],
            "policy": {"d": self.cfg.d, "layers": self.cfg.layers, "heads": self.cfg.heads},
            "cumulative_reward": round(self.cumulative_reward, 4),
            "reward_last50": round(sum(own) / len(own), 4) if own else None,
            "external_reward_last50": round(sum(ext) / len(ext), 4) if ext else None,
            "peers_in_round": len(self._participants),
            "history": recent[-40:],  # [round, own reward, external reward, ext used, groups]
            # per source peer, as scored by our verifier: items, mean reward of their completions, groups we used
            "sources": {a: {"items": s[0], "reward": round(s[2] / s[1], 4) if s[1] else None, "used": s[3]}
                        for a, s in sorted(self.sources.items(), key=lambda kv: -kv[1][0])[:32]},
            **dict(sorted(self.counters.items())),
        }

    def routes(self) -> list:
        return [web.get("/sapo/history", self._http_history)]

    async def _http_history(self, request: web.Request) -> web.Response:
        """Every round's record (the last 5000): [round, own reward, external reward, external used, groups]."""
        return web.json_response({"run": self.cfg.run, "rounds": list(self.history)})
