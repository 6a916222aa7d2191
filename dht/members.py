"""The member table of discovery: the records it holds (:class:`Member`), the poll of the members key that fills
it, what a record from a hello or an introduction must pass to join it (signed by its peer, about itself, admitted
by the swarm's rule, or one of a few under another rule: ``MAX_UNADMITTED``), expiry, the admission-rule check
between members, and the greeting of members not greeted yet.

:class:`MemberTable` is a part of :class:`~dht.discovery.Discovery` (its methods run on the Discovery, whose
transport, identity, config, counters, DHT and clock they use)."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from swarmd.dht.hello import MAX_RECORD
from swarmd.dht.records import NodeRecord, open_envelope, owner_tag
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError

logger = logging.getLogger("swarmd.dht.discovery")  # one log name for all of discovery, whichever part writes

MAX_MEMBERS = 10_000
# members taken from a hello without our swarm's admission, because their record says another rule (an honest node
# configured otherwise is still seen and named, `dht.other_rule`); anyone can claim another rule, so few of them
MAX_UNADMITTED = 64
POLL_GROWTH_MEMBERS = 1_000  # the member poll slows by its base interval for each this many members (poll_every)


@dataclass
class Member:
    record: NodeRecord
    expires: float  # wall clock
    last_seen: float  # wall clock of the last hello, ping or DHT refresh
    source: str  # "dht" | "hello"
    admitted: bool = True  # False: greeted us with another admission rule and no ticket for ours (MAX_UNADMITTED)


class MemberTable:
    """The member table's methods (a part of ``Discovery``, on its state: ``members``, ``counters``, ``config``)."""

    # ------------------------------------------------------------------ admission rule
    def policy_ok(self, peer_id: str) -> bool:
        """Whether ``peer_id`` judges authors as we do (its record says the same admission digest, or says none:
        an older node whose record does not carry it, or one we have no record of). A peer with another rule (other
        ``state.admission_bits`` or ``state.allow``, in the same swarm) would refuse our authors' ops as forged, and
        we theirs: replicating with it would only get honest nodes to penalise and ban each other."""
        member = self.members.get(peer_id)
        return member is None or not member.record.policy or not self.policy or member.record.policy == self.policy

    def policy_mismatch(self) -> list[str]:
        """The members whose record says another admission rule than ours."""
        return sorted(p for p in self.members if not self.policy_ok(p))

    # ------------------------------------------------------------------ members
    async def _poll_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poll_now.wait(), self.poll_every() * random.uniform(0.8, 1.2))
            except asyncio.TimeoutError:
                pass
            self._poll_now.clear()
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._log.log(logging.WARNING, "poll", "member poll failed: %s", e)

    def poll_every(self) -> float:
        """Seconds between member polls: ``poll_interval``, and once more of it for every ``POLL_GROWTH_MEMBERS``
        members we know (a poll returns every member's record, and every member polls), up to half of how long a
        record outlives its owner's last refresh (``record_ttl`` - 1.1 x ``refresh_interval``, the refresh's
        jitter included), so no member's record expires between two polls. Newcomers do not wait for a poll: a
        hello and its one-hop introductions show them at once."""
        base = self.config.poll_interval
        ceiling = (self.config.record_ttl - 1.1 * self.config.refresh_interval) / 2
        return max(base, min(base * (1 + len(self.members) / POLL_GROWTH_MEMBERS), ceiling))

    async def poll(self) -> None:
        result = await self._dht_call("get", self.dht.get(self.members_key, latest=True))
        self.counters["dht_polls"] += 1
        now = self._clock()
        entries = result.value if result is not None and isinstance(result.value, dict) else {}
        parsed: dict[bytes, tuple[object, NodeRecord]] = {}
        for subkey, item in list(entries.items())[:MAX_MEMBERS]:
            known = self._parsed.get(subkey) if isinstance(subkey, bytes) else None
            if known is not None and known[0] == item.value:
                record = known[1]  # the same record as the poll before: parsed and checked then
            else:
                try:
                    record = NodeRecord.from_wire(item.value)
                except MalformedMessage:
                    self.counters["records_rejected"] += 1
                    continue
                if not isinstance(subkey, bytes) or subkey != owner_tag(record.peer_id):
                    self.counters["records_rejected"] += 1  # signed by someone, but about someone else
                    continue
            parsed[subkey] = (item.value, record)
            self._upsert(record, expires=item.expiration_time, source="dht", now=now)
            member = self.members.get(record.peer_id)
            if member is not None:
                member.admitted = True  # the DHT's records passed the validator, which asks for admission
        self._parsed = parsed
        self._expire(now)
        await self._greet_new_members()

    def _upsert(self, record: NodeRecord, *, expires: float, source: str, now: float) -> bool:
        """Add or refresh a member; returns True if it is new."""
        if record.peer_id == self.identity.peer_id:
            return False
        member = self.members.get(record.peer_id)
        if record.policy and self.policy and record.policy != self.policy and (
                member is None or member.record.policy != record.policy):
            self.counters["policy_mismatch"] = self.counters.get("policy_mismatch", 0) + 1
            self._log.log(logging.WARNING, ("policy", record.peer_id),
                          "member %s runs another admission rule than ours (digest %s, ours %s: check "
                          "state.admission_bits and state.allow, the same on every node of a swarm, and that it "
                          "runs a swarmd as recent as ours): our "
                          "replicated states cannot merge, so we do not replicate with it", record.peer_id,
                          record.policy, self.policy)
        if member is None:
            if len(self.members) >= MAX_MEMBERS:
                return False
            self.members[record.peer_id] = Member(record, expires, now, source)
            logger.info("member %s joined (%s)", record.peer_id, source)
            return True
        if record.issued >= member.record.issued:
            member.record = record
        member.expires = max(member.expires, expires)
        member.last_seen = now
        return False

    def _expire(self, now: float) -> None:
        for peer_id in [p for p, m in self.members.items() if m.expires < now]:
            logger.info("member %s left (record expired)", peer_id)
            del self.members[peer_id]
            self._greeted.discard(peer_id)

    def touch(self, peer_id: str) -> None:
        member = self.members.get(peer_id)
        if member is not None:
            now = self._clock()
            member.last_seen = now
            member.expires = max(member.expires, now + self.config.record_ttl)

    async def _greet_new_members(self) -> None:
        """Say hello to members we have not greeted yet (dialing them first if needed), up to ``max_peers``."""
        connected = {p.peer_id for p in await self.transport.peers()}
        room = self.config.max_peers - len(connected & set(self._greeted))
        todo = [
            p
            for p in self.members
            if p not in self._greeted and p not in self._dialing and not self.transport.penalties.is_banned(p)
        ]
        random.shuffle(todo)
        for peer_id in todo[: max(0, room)]:
            self._dialing.add(peer_id)
            self._spawn(self._dial_and_greet(peer_id, connected=peer_id in connected))

    async def _dial_and_greet(self, peer_id: str, connected: bool) -> None:
        try:
            member = self.members.get(peer_id)
            if member is None:
                return
            if not connected:
                await self.transport.connect_peer(peer_id, list(member.record.addrs), timeout=self.config.dial_timeout)
            await self._hello(peer_id)
        except (TransportError, ProtocolViolation) as e:
            logger.debug("could not greet member %s: %s", peer_id, e)
        finally:
            self._dialing.discard(peer_id)

    def _accept_envelope(self, peer_id: str, body, source: str = "hello") -> bool:
        """Verify a sealed record signed by ``peer_id`` about itself; returns True if the member is new."""
        record = NodeRecord.from_wire(open_envelope(body, peer_id, max_size=MAX_RECORD))
        if record.peer_id != peer_id:
            raise ProtocolViolation(f"hello: record is about {record.peer_id}, sent by {peer_id}", kind="forged")
        verdict = True if self._admitted is None else self._admitted(record)
        admitted = verdict is True
        if not admitted and not self._take_unadmitted(record):
            self.counters["records_unadmitted"] = self.counters.get("records_unadmitted", 0) + 1
            if verdict == "old_ticket":
                self._log.log(logging.WARNING, ("old_ticket", peer_id), "a %s record of %s carries an admission "
                              "ticket of an older swarmd (not bound to a time window): not taken as a member; that "
                              "node must be upgraded", source, peer_id)
            else:
                self._log.log(logging.INFO, ("unadmitted", source), "a %s record of %s carries no admission to "
                              "this swarm (a work ticket for its peer id and the time, or a place in state.allow): "
                              "not taken as a member", source, peer_id)
            return False
        now = self._clock()
        is_new = self._upsert(record, expires=now + self.config.record_ttl, source=source, now=now)
        member = self.members.get(peer_id)
        if member is not None:
            member.admitted = admitted
        return is_new

    def _take_unadmitted(self, record: NodeRecord) -> bool:
        """Whether to take a record without our admission anyway: only one that says another rule than ours (an
        honest node configured otherwise: its ticket is for its rule, and we want to see and name it), and only
        up to MAX_UNADMITTED of them, so that fresh keys claiming some other rule cannot fill our member list."""
        if not record.policy or not self.policy or record.policy == self.policy:
            return False
        known = self.members.get(record.peer_id)
        if known is not None and not known.admitted:
            return True  # already holds one of the places
        return sum(not m.admitted for m in self.members.values()) < MAX_UNADMITTED
