"""Discovery's failure paths, with a stand-in transport (no daemon): what a peer that never answers costs us."""

import asyncio

import pytest

from dht.discovery import Discovery, DiscoveryConfig, NodeRecord
from transport.errors import PeerUnreachable
from transport.identity import Identity


class SilentStream:
    """A stream to a peer that takes our hello and never replies."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def send(self, kind, body):
        pass

    async def read_required(self):
        await asyncio.Event().wait()


class SilentTransport:
    async def addresses(self):
        return ["/ip4/127.0.0.1/tcp/4001"]

    async def open_stream(self, peer_id, spec, *, timeout):
        return SilentStream()

    async def connect_peer(self, peer_id, addrs, *, timeout):
        pass


@pytest.mark.timeout(30)
async def test_a_member_that_never_answers_our_hello_is_unreachable_not_a_crash():
    """Seen in a 16-node soak on 2 cores: a hello's reply timing out escaped as asyncio's TimeoutError, so the
    greeting task died with "Task exception was never retrieved" and a traceback (and a bootstrap's hello would have
    ended its bootstrap loop). It is a PeerUnreachable now, like any peer we cannot reach."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        discovery = Discovery(SilentTransport(), Identity.generate(), DiscoveryConfig("s", [], dial_timeout=0.1),
                              version="test")
        with pytest.raises(PeerUnreachable, match="did not answer our hello within"):
            await discovery._hello("12D3KooWSilent")
        member = Identity.generate().peer_id
        discovery.members[member] = type("M", (), {"record": NodeRecord(member, ("/ip4/127.0.0.1/tcp/1",), "t", (),
                                                                        0.0, "")})()
        discovery._dialing.add(member)
        discovery._spawn(discovery._dial_and_greet(member, connected=True))
        await asyncio.wait(list(discovery._tasks), timeout=5)
        assert member not in discovery._dialing and discovery.counters.get("tasks_failed", 0) == 0
        assert reported == []
    finally:
        loop.set_exception_handler(old)


@pytest.mark.timeout(30)
async def test_a_background_task_that_fails_unexpectedly_is_counted_and_said_once():
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        discovery = Discovery(SilentTransport(), Identity.generate(), DiscoveryConfig("s", []), version="test")

        async def broken():
            raise KeyError("a bug")

        for _ in range(3):
            discovery._spawn(broken())
        await asyncio.wait(list(discovery._tasks), timeout=5)
        await asyncio.sleep(0)
        assert discovery.counters["tasks_failed"] == 3 and discovery._tasks == set()
        import gc

        gc.collect()
        await asyncio.sleep(0)
        assert reported == []  # retrieved: no "Task exception was never retrieved"
    finally:
        loop.set_exception_handler(old)


async def test_a_failed_peer_listing_keeps_the_last_one_for_a_while(tmp_path):
    """The daemon's peer listing can fail (its control socket busy or restarting). Read as "no one connected", one
    failed call made every peer look gone at once: DiLoCo stopped waiting for a round's coordinator that was still
    there, replication and pings stopped. The last listing stands for ``LIST_FAILURES_KEPT`` failures in a row."""
    from pathlib import Path

    from node.config import load_config
    from node.core import Node
    from transport.errors import TransportError
    from transport.base import ConnectedPeer, PathType

    node = Node(load_config(Path(__file__).resolve().parents[1] / "configs" / "local.toml"), Identity.generate(),
                tmp_path)
    listing = [ConnectedPeer("QmA", ("/ip4/127.0.0.1/tcp/1",), PathType.DIRECT)]
    failing = [False]

    async def peers():
        if failing[0]:
            raise TransportError("listing peers failed: control socket closed")
        return listing

    async def addresses(refresh=False):
        return []

    node.transport.peers, node.transport.addresses = peers, addresses
    await node._refresh_connections()
    assert set(node.connected) == {"QmA"}
    failing[0] = True
    for _ in range(Node.LIST_FAILURES_KEPT - 1):
        await node._refresh_connections()
        assert set(node.connected) == {"QmA"} and node.peer_state["QmA"].path == "direct"
    await node._refresh_connections()  # the daemon is really gone: so are our connections
    assert node.connected == {}
    failing[0] = False
    await node._refresh_connections()
    assert set(node.connected) == {"QmA"} and node._list_failures == 0
