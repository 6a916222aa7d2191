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

Where each part lives: this module is the service (lifecycle, DHT calls, our record, announcing it, bootstrap);
``dht/members.py`` the member table (polls, admission of records, expiry, greeting); ``dht/hello.py`` the hello
exchange and its wire messages; ``dht/records.py`` the records, their seals and the DHT's validator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from swarmd.dht.hello import HELLO_SPEC, HelloExchange
from swarmd.dht.members import MAX_MEMBERS, Member, MemberTable
from swarmd.dht.records import (
    Ed25519RecordValidator, NodeRecord, dht_key_id, member_check, member_value_ok, owner_tag,
)
from swarmd.dht.room import BoundedKey
from swarmd.transport._compat import load_hivemind
from swarmd.transport.errors import PeerUnreachable, ProtocolViolation, TransportError
from swarmd.transport.identity import Identity
from swarmd.transport.multiaddrs import split_peer_addr
from swarmd.transport.p2pd import P2PDaemonTransport
from swarmd.transport.penalties import RateLimitedLog, TokenBuckets

# importers find these here (tests, bench): each is owned by the module it comes from
from swarmd.dht.hello import HELLO, HELLO_ACK, INTRODUCE, MAX_RECORD  # noqa: F401
from swarmd.dht.members import MAX_UNADMITTED, POLL_GROWTH_MEMBERS  # noqa: F401

logger = logging.getLogger(__name__)

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


class Discovery(MemberTable, HelloExchange):
    """The discovery service: its lifecycle, every DHT call (each bounded), our record and its announcements, and
    bootstrap. Its member table (the poll, admission of records, greeting: ``dht/members.py``) and the hello exchange
    (``dht/hello.py``) are parts of it, written as classes of their own that run on its state."""

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
