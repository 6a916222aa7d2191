"""The in-memory transport and the virtual-time loop (transport/memory.py, memory_streams.py, virtual_time.py): what
the simulator and the one-process tests rely on. Each test runs on virtual time, so its waits cost no wall time."""

import asyncio
import time

import pytest

from swarmd.transport.errors import PeerUnreachable
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import Identity
from swarmd.transport.memory import LinkSpec, MemoryNetwork, run_virtual
from swarmd.transport.ping import ping, serve_ping

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)

ECHO = ProtocolSpec("echo", "1.0.0", max_frame=8 << 20, kinds=frozenset({1}))


async def _echo(stream):
    while (m := await stream.read()) is not None:
        await stream.send(1, m.body)


def _hosts(net, n, link=None):
    return [net.add(Identity.generate(), link) for _ in range(n)]


def test_virtual_time_jumps_instead_of_sleeping():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        await asyncio.to_thread(time.sleep, 0.01)  # a worker thread's time is real, and virtual time waits for it
        return loop.time()

    started = time.monotonic()
    assert run_virtual(main()) == pytest.approx(3600)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(30)
def test_a_worker_threads_result_lands_at_the_same_point_however_fast_the_thread_is():
    """A thread's result is handed over at the loop's next wait, in the order the work was started: not wherever
    the thread happened to finish among the callbacks the loop was running (a fast thread would land before callbacks
    a slow one lands after, and a run under load would replay another schedule). The loop is kept busy (real time)
    while the threads run, so a fast thread finishes mid-step."""

    def run(delays: tuple[float, float]) -> list:
        async def main():
            loop = asyncio.get_running_loop()
            order = []

            async def work(name, delay):
                await loop.run_in_executor(None, time.sleep, delay)
                order.append((name, loop.time()))

            async def busy():
                for i in range(4):
                    time.sleep(0.02)  # the loop's own work: real time, no virtual time
                    order.append((f"step {i}", loop.time()))
                    await asyncio.sleep(0)
                await asyncio.sleep(1.0)
                order.append(("timer", loop.time()))

            await asyncio.gather(work("a", delays[0]), busy(), work("b", delays[1]))
            return order

        return run_virtual(main(), workers=2)

    fast, slow, mixed = run((0.0, 0.0)), run((0.06, 0.08)), run((0.08, 0.0))
    assert fast == slow == mixed, (fast, slow, mixed)
    assert [t for _, t in fast] == [0.0] * 6 + [1.0]  # the threads' time is free; the timer's second is not


@pytest.mark.timeout(30)
def test_ping_costs_the_links_round_trip():
    async def main():
        net = MemoryNetwork(link=LinkSpec(latency=0.040))
        a, b = _hosts(net, 2)
        for t in (a, b):
            await t.start()
        await serve_ping(b)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await a.connect(net.address_of(b.peer_id), timeout=5)
        dialled = loop.time() - t0
        rtt = await ping(a, b.peer_id)
        return dialled, rtt, [p.peer_id for p in await a.peers()], [p.peer_id for p in await b.peers()]

    dialled, rtt, a_peers, b_peers = run_virtual(main())
    assert dialled == pytest.approx(0.080)
    assert rtt == pytest.approx(0.080)
    assert len(a_peers) == 1 and len(b_peers) == 1


@pytest.mark.timeout(30)
def test_a_capped_uplink_sets_the_transfer_time():
    async def main():
        net = MemoryNetwork(link=LinkSpec(latency=0.010, up=1e6, down=1e6))
        a, b = _hosts(net, 2)
        await b.serve(ECHO, _echo)
        loop = asyncio.get_running_loop()
        stream = await a.open_stream(b.peer_id, ECHO)
        t0 = loop.time()
        await stream.send(1, b"x" * 1_000_000)
        reply = await stream.read_required()
        await stream.close()
        return loop.time() - t0, len(reply.body), net.stats.bytes_sent[a.peer_id]

    took, size, sent = run_virtual(main())
    assert size == 1_000_000 and sent > 1_000_000
    assert 2.0 <= took < 2.2  # 1 MB up at 1 MB/s, then back at 1 MB/s, plus the latencies


@pytest.mark.timeout(30)
def test_a_partition_holds_bytes_and_refuses_dials_until_it_heals():
    async def main():
        net = MemoryNetwork(link=LinkSpec(latency=0.005))
        a, b, c = _hosts(net, 3)
        for t in (b, c):
            await t.serve(ECHO, _echo)
        stream = await a.open_stream(b.peer_id, ECHO)
        net.partition({a.peer_id}, {b.peer_id, c.peer_id})
        for i in range(5):
            await stream.send(1, i)
        with pytest.raises(PeerUnreachable):
            await a.open_stream(c.peer_id, ECHO, timeout=2.0)
        early = []
        try:
            async with asyncio.timeout(3.0):
                early.append(await stream.read())
        except TimeoutError:
            pass
        net.heal()
        got = [(await stream.read_required()).body for _ in range(5)]
        await stream.close()
        after = await a.open_stream(c.peer_id, ECHO, timeout=2.0)
        await after.close()
        return early, got, net.stats.held_by_partition

    early, got, held = run_virtual(main())
    assert early == [] and got == [0, 1, 2, 3, 4] and held >= 5


@pytest.mark.timeout(30)
def test_a_relayed_connection_carries_streams_but_is_not_direct_as_its_end_lists_it():
    async def main():
        net = MemoryNetwork(link=LinkSpec(latency=0.005))
        a, b, c = _hosts(net, 3)
        for t in (a, b, c):
            await t.start()
            await t.serve(ECHO, _echo)
        net.relay(a.peer_id, b.peer_id)  # a's list shows its connection to b as relayed; b's own is b's
        stream = await a.open_stream(b.peer_id, ECHO)
        await stream.send(1, "through the relay")
        echoed = (await stream.read_required()).body
        await stream.close()
        return echoed, [net.direct(x.peer_id, y.peer_id) for x, y in ((a, b), (b, a), (a, c))]

    echoed, direct = run_virtual(main())
    assert echoed == "through the relay" and direct == [False, True, True]


@pytest.mark.timeout(30)
def test_a_stopped_host_ends_its_streams():
    async def main():
        net = MemoryNetwork()
        a, b = _hosts(net, 2)
        await b.serve(ECHO, _echo)
        stream = await a.open_stream(b.peer_id, ECHO)
        await stream.send(1, "hi")
        assert (await stream.read_required()).body == "hi"
        await b.close()
        end = await stream.read()
        with pytest.raises(PeerUnreachable):
            await a.open_stream(b.peer_id, ECHO, timeout=1.0)
        return end

    assert run_virtual(main()) is None


@pytest.mark.timeout(30)
def test_lossy_links_are_slower_never_wrong():
    async def main(loss):
        net = MemoryNetwork(link=LinkSpec(latency=0.010, loss=loss), seed=7)
        a, b = _hosts(net, 2)
        await b.serve(ECHO, _echo)
        stream = await a.open_stream(b.peer_id, ECHO)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = []
        for i in range(50):
            await stream.send(1, i)
            out.append((await stream.read_required()).body)
        return out, loop.time() - t0

    clean, t_clean = run_virtual(main(0.0))
    lossy, t_lossy = run_virtual(main(0.2))
    assert clean == lossy == list(range(50))
    assert t_lossy > t_clean * 2


def test_a_downlink_takes_bytes_in_arrival_order_not_in_the_order_they_were_sent():
    """A write from a far peer, sent first, must not hold a near peer's write that arrives long before it (a single
    'busy until' time did: one slow-linked peer delayed every other peer's bytes to a host by its own latency)."""
    from swarmd.transport.memory import Downlink

    down = Downlink()
    assert down.take(1.0, 0.1, now=0.0) == pytest.approx(1.1)  # the far peer's write, arriving at 1.0
    assert down.take(0.2, 0.1, now=0.0) == pytest.approx(0.3)  # a near one, sent after it, arrives first
    assert down.take(0.25, 0.1, now=0.0) == pytest.approx(0.4)  # queued behind the near one only
    assert down.take(0.95, 0.1, now=0.0) == pytest.approx(1.2)  # no room before the far one: after it
    assert down.take(0.1, 0.2, now=0.0) == pytest.approx(0.6)  # the first gap long enough (0.4 - 1.0)
    assert down.take(0.0, 0.1, now=0.0) == pytest.approx(0.1)  # a gap before every span
    assert [x for span in down.spans for x in span] == pytest.approx([0.0, 0.1, 0.2, 0.6, 1.0, 1.2])  # merged
    assert down.take(5.0, 0.0, now=2.0) == 5.0 and down.spans == []  # past spans dropped; an unlimited link


@pytest.mark.timeout(30)
def test_one_far_peer_does_not_slow_the_near_ones():
    async def main():
        net = MemoryNetwork(link=LinkSpec(latency=0.010, up=1e6, down=1e6))
        far, near, b = _hosts(net, 3)
        net.set_link(far.peer_id, LinkSpec(latency=1.0, up=1e6, down=1e6))
        await b.serve(ECHO, _echo)
        streams = [await t.open_stream(b.peer_id, ECHO) for t in (far, near)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for s in streams:  # the far one writes first
            await s.send(1, b"x" * 1000)
        took = []
        for s in reversed(streams):
            await s.read_required()
            took.append(loop.time() - t0)
        return took

    near, far = run_virtual(main())
    assert near < 0.05 and far > 1.0  # the near echo is back in about its own round trip


@pytest.mark.timeout(60)
def test_the_inbound_stream_budget_keeps_room_for_members_and_evicts_strangers_first():
    # issue 80 item 5: peers without standing share max_streams - reserved (256) at 16 each; members have the
    # rest, and once all 512 are taken a member's stream closes a stranger's (of the stranger holding the most)
    async def main():
        net = MemoryNetwork(link=LinkSpec(latency=0.001))
        victim, *others = _hosts(net, 26)
        strangers, members = others[:20], others[20:]
        ids = {m.peer_id for m in members}
        victim.set_standing(lambda peer: peer in ids)
        await victim.serve(ECHO, _echo)
        held = {}
        for t in others:
            await t.connect(net.address_of(victim.peer_id), timeout=5)
        for t in strangers:
            held[t.peer_id] = [await t.open_stream(victim.peer_id, ECHO) for _ in range(20)]
        await asyncio.sleep(1.0)
        runner, errors = victim._runner, victim.stats.errors
        before = (runner.strangers_open, runner.total_open, errors["stream_limit"], errors["stream_limit_strangers"],
                  dict(victim.penalties.totals))
        for t in members:
            held[t.peer_id] = [await t.open_stream(victim.peer_id, ECHO) for _ in range(60)]
        await asyncio.sleep(1.0)
        after = (runner.strangers_open, runner.total_open, errors["stream_evicted"])
        # the last member's last stream, opened with all 512 taken, is served
        probe = held[members[-1].peer_id][-1]
        await probe.send(1, b"hi")
        echoed = (await probe.read_required()).body
        return before, after, echoed

    before, after, echoed = run_virtual(main())
    strangers_open, total_open, over_own_cap, share_full, penalties = before
    assert strangers_open == total_open == 256  # 16 strangers x 16; the other 4 strangers found the share full
    assert over_own_cap == 16 * 4  # each of the 16 opened 4 past its own cap: its fault
    assert share_full == 4 * 20  # the last 4 found the strangers' share full: not their fault
    assert penalties == {"rate_limited": 16 * 4}
    strangers_left, total, evicted = after
    assert total == 512 and evicted == 5 * 60 - 256 and strangers_left == 256 - evicted
    assert echoed == b"hi"
