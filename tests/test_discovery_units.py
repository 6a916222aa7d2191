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
