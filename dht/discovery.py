"""Peer discovery: hivemind's DHTNode on our transport, signed member records, bootstrap with backoff, hello.

How a node finds the swarm
1. It dials each bootstrap address (retrying with exponential backoff and jitter while it has no peers at all), pings
   the bootstrap's DHT so each adds the other to its routing table, and walks the DHT towards its own id.
2. It stores its :class:`NodeRecord` under ``swarmd/<swarm>/members`` with its owner tag as the subkey, signed by its
   Ed25519 key, expiring after ``record_ttl``; it re-stores it every ``refresh_interval``.
3. It reads the members key every ``poll_interval`` (and right after joining; less often in a swarm of thousands,
   see :meth:`Discovery.poll_every`), dials members it is not connected to (up to ``max_peers``), and says hello
   to them.
4. Hello (``/swarmd/hello/1.0.0``) swaps signed records over a direct stream, so a newcomer is visible to every member
   it greets at once, not a poll later.

The members key is protected: its entries must be signed by the peer their subkey names, and admitted by the swarm's
rule (``admitted``: the record's work ticket, or the allowlist; the price of an identity), as must a record that
comes in a hello or an introduction (but for a few that say another rule: ``MAX_UNADMITTED``). Records from the network
are parsed strictly; a bad one is dropped and counted against the peer that sent it (hello) or ignored (DHT, where
the storing peer is not known).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from swarmd.dht.records import (
    Ed25519RecordValidator, NodeRecord, dht_key_id, member_check, member_value_ok, open_envelope, owner_tag, seal,
)
from swarmd.dht.room import BoundedKey
from swarmd.transport.framing import unpack_record
from swarmd.transport._compat import load_hivemind
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, PeerUnreachable, ProtocolViolation, TransportError
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import Identity
from swarmd.transport.multiaddrs import split_peer_addr
from swarmd.transport.p2pd import P2PDaemonTransport
from swarmd.transport.penalties import RateLimitedLog, TokenBuckets
from swarmd.transport.wire import WIRE, Bytes, Map, Nil, OneOf

logger = logging.getLogger(__name__)

HELLO, HELLO_ACK, INTRODUCE = 1, 2, 3
HELLO_SPEC = ProtocolSpec("hello", "1.0.0", max_frame=16 * 1024, kinds=frozenset({HELLO, HELLO_ACK, INTRODUCE}))
MAX_RECORD = 8 * 1024
_ENVELOPE = Map.of(p=Bytes(MAX_RECORD), s=Bytes(exact=64))  # a record sealed by its peer (dht.records.seal)
_EXAMPLE_ENVELOPE = {"p": b"\x81\xa4peer\xa4(id)", "s": bytes(64)}
WIRE.frame(HELLO_SPEC, HELLO, "hello.hello", _ENVELOPE, _EXAMPLE_ENVELOPE, signed="swarmd/envelope/v1",
           doc="the greeter's own sealed node record")
WIRE.frame(HELLO_SPEC, HELLO_ACK, "hello.ack", OneOf((_ENVELOPE, Nil())), _EXAMPLE_ENVELOPE,
           signed="swarmd/envelope/v1", doc="the greeted node's sealed record (nil after an INTRODUCE)")
WIRE.frame(HELLO_SPEC, INTRODUCE, "hello.introduce", _ENVELOPE, _EXAMPLE_ENVELOPE, signed="swarmd/envelope/v1",
           doc="a newcomer's own sealed record, passed on one hop by a member it greeted")
MAX_MEMBERS = 10_000
# members taken from a hello without our swarm's admission, because their record says another rule (an honest node
# configured otherwise is still seen and named, `dht.other_rule`); anyone can claim another rule, so few of them
MAX_UNADMITTED = 64
POLL_GROWTH_MEMBERS = 1_000  # the member poll slows by its base interval for each this many members (poll_every)


MAX_DETACHED = 16  # DHT calls past their timeout left running to end by themselves (see Discovery._dht_call)


@dataclass
class DiscoveryConfig:
    swarm: str
    bootstrap: list[str]
    record_ttl: float = 60.0
    refresh_interval: float = 20.0
    poll_interval: float = 5.0
    max_peers: int = 64
    dial_timeout: float = 10.0
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    dht_timeout: float = 15.0  # every DHT call (get, store, ping, walk) gives up after this long


@dataclass
class Member:
    record: NodeRecord
    expires: float  # wall clock
    last_seen: float  # wall clock of the last hello, ping or DHT refresh
    source: str  # "dht" | "hello"
    admitted: bool = True  # False: greeted us with another admission rule and no ticket for ours (MAX_UNADMITTED)


@dataclass
class BootstrapState:
    addr: str
    peer_id: str
    state: str = "pending"  # pending | dialing | connected | retrying
    attempts: int = 0
    last_error: str | None = None
    next_attempt: float | None = None  # wall clock
    connected_at: float | None = None

    def to_json(self) -> dict:
        return {
            "addr": self.addr,
            "peer_id": self.peer_id,
            "state": self.state,
            "attempts": self.attempts,
            "last_error": self.last_error,
            "next_attempt": self.next_attempt,
            "connected_at": self.connected_at,
        }


class Discovery:
    def __init__(
        self,
        transport: P2PDaemonTransport,
        identity: Identity,
        config: DiscoveryConfig,
        *,
        version: str,
        loops: Callable[[], list[str]] = lambda: [],
        clock: Callable[[], float] = time.time,
        on_greeted: Callable[[str], None] = lambda peer_id: None,
        policy: str = "",
        admitted: Callable[[NodeRecord], bool | str] | None = None,
        ticket: Callable[[], Awaitable[int | None]] | None = None,
        window: Callable[[], int] | None = None,
    ):
        """``admitted``: the swarm's admission rule for the records under the members key (its ticket or the
        allowlist, crdt.admission), checked by every node that stores or reads them (None: any record about its
        signer; a string: refused for that reason); ``ticket``: our own ticket, said in our record (the rule may
        bind it to a time window: ``window()`` is the current one, and a new window renews our record's ticket)."""
        self.transport = transport
        self.policy = policy  # the digest of our admission rule (crdt.admission), said in our record
        self._admitted = admitted
        self._ticket = ticket
        self._window = window
        self.identity = identity
        self.config = config
        self.version = version
        self._loops = loops
        self._clock = clock
        self._on_greeted = on_greeted
        self.members_key = f"swarmd/{config.swarm}/members"
        self.members: dict[str, Member] = {}
        self.bootstrap: list[BootstrapState] = [BootstrapState(a, split_peer_addr(a)[0]) for a in config.bootstrap]
        self.dht = None
        self.validator: Ed25519RecordValidator | None = None
        self.counters = {"hello_in": 0, "hello_out": 0, "introduced_in": 0, "introduced_out": 0, "records_rejected": 0,
                         "dht_polls": 0, "dht_stores": 0}
        self._joined = asyncio.Event()
        self._poll_now = asyncio.Event()
        self._hello_rate = TokenBuckets(1.0, 5.0, max_keys=2 * MAX_MEMBERS)  # per peer
        self._introduce_rate = TokenBuckets(20.0, 100.0, max_keys=2 * MAX_MEMBERS)
        self._dialing: set[str] = set()
        self._greeted: set[str] = set()  # peers that hold our record from a hello
        self._my_record: NodeRecord | None = None  # the last we made (my_record)
        self._parsed: dict[bytes, tuple[object, NodeRecord]] = {}  # the last poll's records: subkey -> (value, parsed)
        self._tasks: set[asyncio.Task] = set()
        self._detached: dict[asyncio.Future, None] = {}  # DHT calls past their timeout, ending by themselves
        self._log = RateLimitedLog(logger, interval=30.0)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        hm = load_hivemind()
        check = member_value_ok if self._admitted is None else member_check(self._admitted, self._window)
        self.validator = validator = Ed25519RecordValidator(
            self.identity, {self.members_key: check}, max_ttl=max(600.0, 4 * self.config.record_ttl))
        self.dht = await hm.DHTNode.create(
            p2p=self.transport.hivemind_p2p,
            record_validator=validator,
            wait_timeout=3,
            bootstrap_timeout=3,
            num_replicas=5,
            cache_locally=False,  # we always want fresh member lists, not a cached copy
            cache_nearest=0,
            reuse_get_requests=False,
        )
        # the members key's records that this node stores for the DHT: at most dht.room.MAX_STORED, making room
        from hivemind.dht.routing import DHTID

        BoundedKey(self.dht.protocol.storage, DHTID.from_bytes(dht_key_id(self.members_key)),
                   lambda peer: peer == self.identity.peer_id or peer in self._greeted, self.counters)
        await self.transport.serve(HELLO_SPEC, self._on_hello)

    async def run(self) -> None:
        """Runs until cancelled."""
        async with asyncio.TaskGroup() as tg:
            for state in self.bootstrap:
                tg.create_task(self._bootstrap_loop(state))
            tg.create_task(self._announce_loop())
            tg.create_task(self._poll_loop())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._detached:  # a moment to end by themselves, then cancelled
            await asyncio.wait(list(self._detached), timeout=0.5)
            left = list(self._detached)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
        if self.dht is not None:
            dht, self.dht = self.dht, None
            if not getattr(self.transport, "alive", True):
                dht.is_alive = False  # the daemon is gone: a graceful DHT shutdown would only time out
                return
            try:
                await asyncio.wait_for(dht.shutdown(), 3.0)
            except (asyncio.TimeoutError, Exception) as e:  # shutting down: log, never raise
                logger.debug("DHT shutdown: %r", e)

    async def _dht_call(self, what: str, call):
        """Await one DHT call under ``dht_timeout``: a peer that never answers (or an entry that makes hivemind's
        search fail) must not hang discovery. Raises TransportError on a timeout (counted, logged rate-limited).

        The call itself is not cancelled at the timeout but left to end by itself (each of hivemind's requests
        times out after 3 s, so a search ends): cancelling hivemind's search mid-way leaks its workers' pending
        tasks, which asyncio then reports at ERROR ("Task was destroyed but it is pending", 15 of them in a 16-node
        soak's start on 2 cores). At most MAX_DETACHED such calls run on; beyond, the oldest is cancelled."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.config.dht_timeout)
        except asyncio.CancelledError:
            self._detach(task)  # we are being cancelled (closing): close() ends what is left
            raise
        except asyncio.TimeoutError:
            self._detach(task)
            self.counters["dht_timeouts"] = self.counters.get("dht_timeouts", 0) + 1
            self._log.log(logging.WARNING, ("dht_timeout", what), "DHT %s gave no answer within %.0f s",
                          what, self.config.dht_timeout)
            raise TransportError(f"DHT {what} timed out after {self.config.dht_timeout:.0f} s") from None

    def _detach(self, task: asyncio.Future) -> None:
        if task.done():
            self._detached_done(task)
            return
        self._detached[task] = None
        task.add_done_callback(self._detached_done)
        while len(self._detached) > MAX_DETACHED:
            oldest = next(iter(self._detached))
            del self._detached[oldest]
            oldest.cancel()

    def _detached_done(self, task: asyncio.Future) -> None:
        self._detached.pop(task, None)
        if not task.cancelled() and task.exception() is not None:  # retrieved: never "never retrieved"
            logger.debug("a DHT call past its timeout ended with %r", task.exception())

    # ------------------------------------------------------------------ our record
    async def my_record(self) -> NodeRecord:
        """Our record. Its ``issued`` time changes only with what it says, so a refresh re-signs the same value with
        a later expiry: every member that reads it checks the signature again, but not the value (see
        ``Ed25519RecordValidator``), and its poll does not parse it again."""
        addrs = tuple(a.rsplit("/p2p/", 1)[0] for a in await self.transport.addresses())
        ticket = None if self._ticket is None else await self._ticket()
        record = NodeRecord(self.identity.peer_id, addrs[:16], self.version, tuple(self._loops())[:16],
                            self._clock(), self.policy, ticket)
        last = self._my_record
        if last is not None and dataclasses.replace(record, issued=last.issued) == last:
            return last
        self._my_record = record
        return record

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

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self.announce()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._log.log(logging.WARNING, "announce", "could not store our member record: %s", e)
            await asyncio.sleep(self.config.refresh_interval * random.uniform(0.9, 1.1))

    async def announce(self) -> bool:
        hm = load_hivemind()
        record = await self.my_record()
        ok = await self._dht_call("store", self.dht.store(
            self.members_key,
            record.to_wire(),
            expiration_time=hm.get_dht_time() + self.config.record_ttl,
            subkey=owner_tag(self.identity.peer_id),
        ))
        self.counters["dht_stores"] += 1
        return bool(ok)

    # ------------------------------------------------------------------ bootstrap
    async def _bootstrap_loop(self, state: BootstrapState) -> None:
        delay = self.config.backoff_initial
        while True:
            if state.state != "connected":
                state.state = "dialing"
                state.attempts += 1
                state.next_attempt = None
                try:
                    await self.join_via(state.addr)
                except asyncio.CancelledError:
                    raise
                except (TransportError, ProtocolViolation) as e:
                    state.state, state.last_error = "retrying", str(e)
                    wait = delay * random.uniform(0.8, 1.2)
                    state.next_attempt = self._clock() + wait
                    self._log.log(
                        logging.WARNING,
                        ("bootstrap", state.addr),
                        "bootstrap %s unreachable (attempt %d): %s; retrying in %.0f s",
                        state.addr,
                        state.attempts,
                        e,
                        wait,
                    )
                    await asyncio.sleep(wait)
                    delay = min(delay * 2, self.config.backoff_max)
                    continue
                state.state, state.last_error, state.connected_at = "connected", None, self._clock()
                delay = self.config.backoff_initial
                try:
                    await self._after_join()
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    logger.warning("joined through %s, but the first member sync failed: %s", state.addr, e)
            # connected: re-bootstrap only if we end up with no peers at all
            await asyncio.sleep(self.config.poll_interval)
            if not await self.transport.peers():
                state.state = "retrying"

    async def join_via(self, addr: str) -> None:
        """Dial a bootstrap peer, enter its DHT routing table and greet it. Raises TransportError/ProtocolViolation."""
        hm = load_hivemind()
        started = time.perf_counter()
        peer_id = await self.transport.connect(addr, timeout=self.config.dial_timeout)
        dialed = time.perf_counter()
        node_id = await self._dht_call(
            "ping", self.dht.protocol.call_ping(hm.PeerID.from_base58(peer_id), validate=False, strict=False))
        if node_id is None:
            raise PeerUnreachable(f"{addr} answered the dial but not the DHT ping")
        pinged = time.perf_counter()
        await self._hello(peer_id)
        self._joined.set()
        logger.info(
            "joined through %s: dial %.0f ms, DHT ping %.0f ms, hello %.0f ms",
            peer_id, (dialed - started) * 1e3, (pinged - dialed) * 1e3, (time.perf_counter() - pinged) * 1e3,
        )

    async def rejoin_through(self, peer_id: str) -> None:
        """Re-bootstrap through a member we just reached again (after a split, or from the address book): ping its
        DHT so each routing table holds the other, greet it (records swapped, CRDT sync started) and read the
        members key at once. Raises TransportError/ProtocolViolation."""
        hm = load_hivemind()
        node_id = await self._dht_call(
            "ping", self.dht.protocol.call_ping(hm.PeerID.from_base58(peer_id), validate=False, strict=False))
        if node_id is None:
            raise PeerUnreachable(f"{peer_id} answered the dial but not the DHT ping")
        await self._hello(peer_id)
        self._joined.set()
        self.counters["rejoins"] = self.counters.get("rejoins", 0) + 1
        self._poll_now.set()

    async def _after_join(self) -> None:
        # greet every member at once (that is what makes us visible within ~1 s), while we store our record and
        # fill our routing table
        started = time.perf_counter()
        await asyncio.gather(self.poll(), self.announce(),
                             self._dht_call("walk", self.dht.find_nearest_nodes([self.dht.node_id])))
        logger.info("first member sync: %d members in %.0f ms", len(self.members),
                    (time.perf_counter() - started) * 1e3)

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

    # ------------------------------------------------------------------ hello
    async def _hello(self, peer_id: str) -> None:
        envelope = seal(self.identity, (await self.my_record()).to_wire())
        async with await self.transport.open_stream(peer_id, HELLO_SPEC, timeout=self.config.dial_timeout) as stream:
            await stream.send(HELLO, envelope)
            try:
                reply = await asyncio.wait_for(stream.read_required(), self.config.dial_timeout)
            except asyncio.TimeoutError:  # a TransportError like any unreachable peer's (it escaped the callers)
                raise PeerUnreachable(f"{peer_id} did not answer our hello within "
                                      f"{self.config.dial_timeout:.0f} s") from None
            if reply.kind != HELLO_ACK:
                raise MalformedMessage("hello: expected HELLO_ACK")
            try:
                self._accept_envelope(peer_id, reply.body)
            except ProtocolViolation as e:
                self.transport.penalties.penalize(peer_id, e.kind, str(e))
                self.transport.stats.errors[e.kind] += 1
                raise
        self._greeted.add(peer_id)
        self.counters["hello_out"] += 1
        self._on_greeted(peer_id)

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

    async def _on_hello(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10.0)
        if message.kind == INTRODUCE:
            # honest members introduce every newcomer they meet: a generous allowance, and no penalty past it
            if self._introduce_rate.allow(stream.peer_id):
                await self._on_introduce(stream, message.body)
            else:
                self.counters["introduced_dropped"] = self.counters.get("introduced_dropped", 0) + 1
            return
        if not self._hello_rate.allow(stream.peer_id):
            raise ProtocolViolation("hello: too many hellos", kind="rate_limited")
        if message.kind != HELLO:
            raise MalformedMessage("hello: expected HELLO")
        is_new = self._accept_envelope(stream.peer_id, message.body)
        self._greeted.add(stream.peer_id)  # they know us: they just got our record in the reply
        self.counters["hello_in"] += 1
        self._on_greeted(stream.peer_id)
        await stream.send(HELLO_ACK, seal(self.identity, (await self.my_record()).to_wire()))
        if is_new:
            self._spawn(self._introduce(message.body, exclude=stream.peer_id))

    async def _on_introduce(self, stream: Stream, envelope) -> None:
        """A member tells us about a newcomer it has just met: the newcomer's own sealed record (one hop only)."""
        if not isinstance(envelope, dict) or not isinstance(envelope.get("p"), bytes):
            raise MalformedMessage("introduce: body must be a sealed record")
        claimed = unpack_record(envelope["p"], max_size=MAX_RECORD)
        peer_id = claimed.get("peer") if isinstance(claimed, dict) else None
        if not isinstance(peer_id, str):
            raise MalformedMessage("introduce: record without a peer id")
        self._accept_envelope(peer_id, envelope, source="introduced")  # verified against the newcomer's own key
        self.counters["introduced_in"] += 1
        await stream.send(HELLO_ACK, None)

    async def _introduce(self, envelope, exclude: str) -> None:
        """Pass a newcomer's record to the members we are connected to, so it is visible everywhere at once
        (over connections that already exist, instead of the newcomer dialing every member first)."""
        connected = {p.peer_id for p in await self.transport.peers()}
        targets = [p for p in self._greeted if p != exclude and p in connected]
        sem = asyncio.Semaphore(16)

        async def one(peer_id: str) -> None:
            async with sem:
                try:
                    async with await self.transport.open_stream(peer_id, HELLO_SPEC, timeout=5.0) as stream:
                        await stream.send(INTRODUCE, envelope)
                        await asyncio.wait_for(stream.read_required(), 5.0)
                    self.counters["introduced_out"] += 1
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    logger.debug("could not introduce a newcomer to %s: %s", peer_id, e)

        await asyncio.gather(*(one(p) for p in targets))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._spawned_done)

    def _spawned_done(self, task: asyncio.Task) -> None:
        """A background task's failure that its own code did not expect: one rate-limited line, never asyncio's
        "Task exception was never retrieved" with a traceback (seen: a hello's reply timing out)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.counters["tasks_failed"] = self.counters.get("tasks_failed", 0) + 1
            self._log.log(logging.WARNING, ("task_failed", type(e).__name__),
                          "discovery: a background task failed: %s: %s", type(e).__name__, e)

    # ------------------------------------------------------------------ introspection
    @property
    def joined(self) -> bool:
        return self._joined.is_set() or not self.bootstrap

    def routing_table_size(self) -> int:
        if self.dht is None:
            return 0
        return len(self.dht.protocol.routing_table.uid_to_peer_id)


__all__ = ["BootstrapState", "Discovery", "DiscoveryConfig", "HELLO_SPEC", "Member"]
