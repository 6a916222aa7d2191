"""Pubsub: 8 real node processes, exactly-once delivery; validation before forwarding; scoring of bad publishers;
visible backpressure."""

import asyncio
import base64
import time
from pathlib import Path

import msgpack
import pytest

from swarmd.node.services import NodeContext
from swarmd.protocols.gossip import MSG, PUBSUB_SPEC, SIGN_DOMAIN, SUB, Gossip, Verdict
from swarmproc import http_get, http_post, wait_for
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_eight_nodes_receive_every_message_exactly_once_in_order(swarm):
    # correctness only: how fast delivery is (publish -> delivery p50 / p99 at 8 nodes) is bench_gossip.py's table,
    # not a timed assertion here (one that read < 2 s failed at 2.33 s on a loaded 2-core CI run)
    nodes = swarm.start_chain(8)
    for n in nodes:
        http_post(n.url + "/topics/chat/subscribe")

    def meshed():
        return all(n.status()["services"]["gossip"]["topics"]["chat"]["mesh"] >= 4 for n in nodes)

    wait_for(meshed, 20, "topic meshes to form")
    publisher, receivers = nodes[3], [n for n in nodes if n is not nodes[3]]
    sent = []
    for i in range(50):
        sent.append(http_post(publisher.url + "/topics/chat", f"message {i}".encode())["id"])

    def all_received():
        for n in receivers:
            got = http_get(n.url + "/topics/chat")["messages"]
            if len(got) < len(sent):
                return False
        return True

    wait_for(all_received, 30, "every receiver to get all 50 messages", interval=0.05)
    for n in receivers:
        got = http_get(n.url + "/topics/chat")["messages"]
        assert [m["id"] for m in got] == sent  # each exactly once, in order
        assert [base64.b64decode(m["data"]).decode() for m in got] == [f"message {i}" for i in range(50)]
        assert all(m["author"] == publisher.peer_id for m in got)
    # the duplicates the mesh produced were suppressed, and nothing was dropped
    stats = [n.status()["services"]["gossip"] for n in receivers]
    assert sum(s.get("duplicates", 0) for s in stats) > 0
    assert all(s.get("send_queue_dropped", 0) == 0 and s.get("subscriber_dropped", 0) == 0 for s in stats)


# ------------------------------------------------------------------ in-process: three real transports


class Peer:
    def __init__(self, tmp: Path, name: str):
        self.identity = Identity.generate()
        self.transport = P2PDaemonTransport(self.identity, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
        self.gossip = Gossip(heartbeat=0.1)
        self.members: list[str] = []
        self.tmp = tmp / name

    async def start(self):
        await self.transport.start()
        ctx = NodeContext(self.identity, self.transport, self.tmp, lambda: list(self.members), None, lambda p: True)
        await self.gossip.start(ctx)
        self.task = asyncio.create_task(self.gossip.run())

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.gossip.close()
        await self.transport.close()


async def line(tmp_path, n=3, **topic):
    """a - b - c: a and c only reach each other through b."""
    peers = [Peer(tmp_path, f"p{i}") for i in range(n)]
    for p in peers:
        await p.start()
    for left, right in zip(peers, peers[1:]):
        await right.transport.connect((await left.transport.addresses())[0])
        left.members.append(right.identity.peer_id)
        right.members.append(left.identity.peer_id)
    subs = [p.gossip.subscribe("t", **topic) for p in peers]

    def ready():
        return all(len(p.gossip.peer_topics) == len(p.members) and all("t" in s for s in p.gossip.peer_topics.values())
                   for p in peers)

    deadline = time.monotonic() + 10
    while not ready():
        assert time.monotonic() < deadline, "links did not form"
        await asyncio.sleep(0.02)
    return peers, subs


async def next_message(sub, timeout=3.0):
    return await asyncio.wait_for(sub.__anext__(), timeout)


@pytest.mark.timeout(60)
async def test_rejected_messages_are_not_forwarded_and_count_against_the_sender(tmp_path):
    verdicts = {"ok": Verdict.ACCEPT, "bad": Verdict.REJECT, "late": Verdict.IGNORE}
    peers, subs = await line(tmp_path, validator=lambda m: verdicts[m.data.split(b":")[0].decode()])
    a, b, c = peers
    try:
        a.gossip.publish("t", b"ok:1")
        assert (await next_message(subs[2])).data == b"ok:1"
        a.gossip.publish("t", b"bad:2")
        a.gossip.publish("t", b"late:3")
        a.gossip.publish("t", b"ok:4")
        assert (await next_message(subs[2])).data == b"ok:4"  # bad and late never reached c
        assert b.gossip.topics["t"].rejected == 1 and b.gossip.topics["t"].ignored == 1
        assert c.gossip.topics["t"].rejected == 0
        assert b.transport.penalties.offences(a.identity.peer_id) == {"invalid_message": 1}
        assert (await next_message(subs[1])).data == b"ok:1"
    finally:
        for p in peers:
            await p.close()


@pytest.mark.timeout(60)
async def test_size_limits_and_subscriber_backpressure(tmp_path):
    peers, subs = await line(tmp_path, n=2, max_size=100, queue_size=3)
    a, b = peers
    try:
        with pytest.raises(ValueError, match="exceeds"):
            a.gossip.publish("t", b"x" * 101)
        for i in range(10):
            a.gossip.publish("t", b"m%d" % i)
        deadline = time.monotonic() + 5
        while b.gossip.topics["t"].delivered < 10:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert b.gossip.topics["t"].dropped_full == 7  # the slow subscriber lost 7, visibly
        assert b.gossip.status()["subscriber_dropped"] == 7
        assert [subs[1].get_nowait().data for _ in range(3)] == [b"m0", b"m1", b"m2"]
    finally:
        for p in peers:
            await p.close()


@pytest.mark.timeout(60)
async def test_forged_and_garbage_publishers_are_scored_down_and_stop_propagating(tmp_path):
    peers, subs = await line(tmp_path, n=2)
    a, b = peers
    mallory = Identity.generate()
    attacker = P2PDaemonTransport(mallory, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await attacker.start()
    try:
        await attacker.connect((await a.transport.addresses())[0])
        now = int(time.time() * 1000)
        body = msgpack.packb([1, "t", a.identity.peer_id, 1, now, b"forged in a's name"], use_bin_type=True)
        forged = {"b": body, "s": mallory.sign(SIGN_DOMAIN + body)}
        own = msgpack.packb([1, "t", mallory.peer_id, 1, now, b"valid but too late"], use_bin_type=True)
        async with await attacker.open_stream(a.identity.peer_id, PUBSUB_SPEC) as stream:
            await stream.send(SUB, ["t"])
            await stream.send(MSG, forged)
        deadline = time.monotonic() + 5
        while a.transport.penalties.offences(mallory.peer_id).get("bad_signature") != 1:
            assert time.monotonic() < deadline, a.transport.penalties.offences(mallory.peer_id)
            await asyncio.sleep(0.02)
        async with await attacker.open_stream(a.identity.peer_id, PUBSUB_SPEC) as stream:
            await stream.send(MSG, {"b": b"\xc1garbage", "s": b""})
        async with await attacker.open_stream(a.identity.peer_id, PUBSUB_SPEC) as stream:
            await stream.send(MSG, forged)
        while not a.transport.penalties.is_banned(mallory.peer_id):
            assert time.monotonic() < deadline, a.transport.penalties.offences(mallory.peer_id)
            await asyncio.sleep(0.02)
        # banned: even a validly signed message of its own is dropped
        try:
            async with await attacker.open_stream(a.identity.peer_id, PUBSUB_SPEC) as stream:
                await stream.send(MSG, {"b": own, "s": mallory.sign(SIGN_DOMAIN + own)})
        except Exception:
            pass
        a.gossip.publish("t", b"honest")
        assert (await next_message(subs[1])).data == b"honest"  # b got the honest one, and nothing else
        assert subs[1]._topic.queue.empty() and subs[0]._topic.queue.empty()
        assert a.gossip.topics["t"].delivered == 0
    finally:
        await attacker.close()
        for p in peers:
            await p.close()


class Listener:
    """A bare transport that speaks pubsub by hand and records every MSG a node's link sends it."""

    def __init__(self):
        self.identity = Identity.generate()
        self.transport = P2PDaemonTransport(self.identity, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
        self.got: list[bytes] = []

    async def start(self, node: Peer):
        await self.transport.start()

        async def on_stream(stream):
            while (message := await stream.read()) is not None:
                if message.kind == MSG:
                    self.got.append(message.body["b"])

        await self.transport.serve(PUBSUB_SPEC, on_stream)
        await self.transport.connect((await node.transport.addresses())[0])
        node.members.append(self.identity.peer_id)
        deadline = time.monotonic() + 10
        while self.identity.peer_id not in node.gossip.links:
            assert time.monotonic() < deadline, "the node opened no link to the listener"
            await asyncio.sleep(0.02)


async def _settle(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
async def test_a_relay_serves_only_what_its_validator_accepted_and_each_id_once(tmp_path):
    # issue 14 item 8: gossip cached and advertised (IHAVE) messages its validator rejected and served them on IWANT,
    # so the asking peer penalised and banned the honest relay; item 12: one IWANT frame of 512 copies of an id
    # queued 512 copies of the message
    verdicts = {"ok": Verdict.ACCEPT, "bad": Verdict.REJECT, "late": Verdict.IGNORE}
    peers, subs = await line(tmp_path, n=2, validator=lambda m: verdicts[m.data.split(b":")[0].decode()])
    a, b = peers
    listener = Listener()
    try:
        await listener.start(b)
        ids = [a.gossip.publish("t", data) for data in (b"bad:1", b"late:2", b"ok:3")]
        assert (await next_message(subs[1])).data == b"ok:3"
        assert ids[0] in b.gossip.seen and ids[0] not in b.gossip.cache and ids[1] not in b.gossip.cache
        advertised = [i for batch in b.gossip.history for i in batch]
        assert ids[0] not in advertised and ids[1] not in advertised and ids[2] in advertised
        before = len(listener.got)
        async with await listener.transport.open_stream(b.identity.peer_id, PUBSUB_SPEC) as stream:
            await stream.send(SUB, ["t"])
            await stream.send(5, [ids[0], ids[1]] + [ids[2]] * 510)  # IWANT
            await _settle(lambda: b.gossip.counters["iwant_duplicates"] >= 509)
        await _settle(lambda: len(listener.got) > before)
        await asyncio.sleep(0.3)  # let any wrongly queued copies arrive before counting
        served = listener.got[before:]
        assert len(served) == 1 and b"ok:3" in served[0]
        assert b.gossip.counters["iwant_served"] == 1
    finally:
        await listener.transport.close()
        for p in peers:
            await p.close()


@pytest.mark.timeout(60)
async def test_a_replay_of_a_message_stamped_ahead_is_never_delivered_twice(tmp_path):
    # issue 14 item 12: the seen cache lived 120 s but messages may be stamped 30 s ahead: a verbatim replay 125 s
    # later was delivered again. Here the window is 2 s (+1 s skew) and the seen cache outlives it.
    peers = [Peer(tmp_path, "p0")]
    peers[0].gossip = Gossip(heartbeat=0.1, max_age=2.0, max_skew=1.0)
    await peers[0].start()
    node = peers[0]
    sub = node.gossip.subscribe("t")
    mallory = Identity.generate()
    sender = P2PDaemonTransport(mallory, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await sender.start()
    try:
        await sender.connect((await node.transport.addresses())[0])
        body = msgpack.packb([1, "t", mallory.peer_id, 1, int(time.time() * 1000) + 900, b"once"], use_bin_type=True)
        wire = {"b": body, "s": mallory.sign(SIGN_DOMAIN + body)}
        async with await sender.open_stream(node.identity.peer_id, PUBSUB_SPEC) as stream:
            await stream.send(MSG, wire)
        assert (await next_message(sub)).data == b"once"
        for _ in range(2):  # within the window: a duplicate; after it: stale
            await asyncio.sleep(1.6)
            async with await sender.open_stream(node.identity.peer_id, PUBSUB_SPEC) as stream:
                await stream.send(MSG, wire)
        await _settle(lambda: node.gossip.counters["duplicates"] + node.gossip.counters["stale"] >= 2)
        assert sub._topic.queue.empty() and node.gossip.topics["t"].delivered == 1
    finally:
        await sender.close()
        await node.close()
