"""Each workaround in transport/_compat.py: it must still work, and it must still be needed.

If a 'still needed' test fails after an upgrade, the workaround can be deleted (and this test with it)."""

import asyncio
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


@pytest.mark.beside  # imports in a subprocess: no deadline to meet
def test_protobuf_clash_still_exists_without_the_alias():
    r = _run(
        """
        import libp2p.crypto.pb.crypto_pb2
        import hivemind.proto.crypto_pb2
        """
    )
    assert r.returncode != 0 and "duplicate symbol" in r.stderr, "the crypto.pb clash is gone: drop the alias"


@pytest.mark.beside  # imports in a subprocess: no deadline to meet
def test_protobuf_alias_lets_both_stacks_load():
    r = _run(
        """
        from swarmd.transport._compat import load_hivemind
        hm = load_hivemind()
        import libp2p.crypto.pb.crypto_pb2 as lp
        import hivemind.proto.crypto_pb2 as hp
        from hivemind.proto import p2pd_pb2, dht_pb2
        from libp2p.peer.id import ID
        assert hp is lp
        print("ok")
        """
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.beside  # imports in a subprocess: no deadline to meet
def test_hivemind_still_imports_torch_without_the_stubs():
    r = _run(
        """
        import sys
        import libp2p.crypto.pb.crypto_pb2 as lp
        sys.modules["hivemind.proto.crypto_pb2"] = lp
        import hivemind.p2p
        print("torch" in sys.modules)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True", "hivemind.p2p no longer pulls in torch: the package stubs can go"


@pytest.mark.beside  # imports in a subprocess: no deadline to meet
def test_stubs_keep_torch_out_of_the_node():
    r = _run(
        """
        import sys
        from swarmd.transport._compat import load_hivemind
        hm = load_hivemind()
        import swarmd.node.core, swarmd.node.cli, swarmd.dht.discovery
        print("torch" in sys.modules, hm.DHTNode.__name__, hm.P2P.__name__)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "DHTNode", "P2P"]


@pytest.mark.timeout(60)
async def test_p2pd_needs_the_64_byte_ed25519_key(tmp_path):
    from swarmd.transport._compat import load_hivemind
    from swarmd.transport.identity import Identity

    hm = load_hivemind()
    from libp2p.crypto.pb import crypto_pb2

    identity = Identity.generate()
    seed_only = tmp_path / "seed.key"
    seed_only.write_bytes(
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                              data=identity.to_p2pd_bytes()[4:36]).SerializeToString()
    )
    common = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, use_ipfs=False,
                  check_if_identity_free=False)
    with pytest.raises(hm.P2PDaemonError, match="ed25519"):
        p2p = await hm.P2P.create(identity_path=str(seed_only), **common)
        await p2p.shutdown()

    full = tmp_path / "full.key"
    identity.save(full)
    p2p = await hm.P2P.create(identity_path=str(full), **common)
    try:
        assert p2p.peer_id.to_base58() == identity.peer_id
    finally:
        await p2p.shutdown()
    await asyncio.sleep(0)


@pytest.mark.beside  # imports in a subprocess: no deadline to meet
def test_libp2p_package_init_is_still_heavy():
    r = _run(
        """
        import sys
        import libp2p.crypto.pb.crypto_pb2
        print("trio" in sys.modules, "aioquic" in sys.modules)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() != ["False", "False"], "py-libp2p's __init__ is light now: drop the lazy package"


def test_lazy_libp2p_keeps_the_stack_out_until_asked_and_then_works():
    r = _run(
        """
        import sys
        from swarmd.transport.identity import Identity
        Identity.generate()
        light = "trio" not in sys.modules and "aioquic" not in sys.modules
        import libp2p
        new_host = libp2p.new_host            # first package attribute: runs the real __init__
        from libp2p import generate_new_rsa_identity
        print(light, callable(new_host), "trio" in sys.modules)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True"]


async def _search_cut_short(wrap) -> tuple[asyncio.Future, list[str]]:
    """One hivemind DHT search whose requests take 0.3 s, given 0.1 s by ``wrap``; what asyncio reported after."""
    import gc

    from swarmd.transport._compat import load_hivemind

    load_hivemind()
    from hivemind.dht.routing import DHTID
    from hivemind.dht.traverse import traverse_dht

    loop = asyncio.get_running_loop()
    reported: list[str] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        peers = [DHTID.generate() for _ in range(20)]

        async def get_neighbors(peer, queries):
            await asyncio.sleep(0.3)
            return {q: (peers[:5], False) for q in queries}

        search = asyncio.ensure_future(traverse_dht([DHTID.generate()], peers[:3], beam_size=4, num_workers=3,
                                                    queries_per_call=1, get_neighbors=get_neighbors, visited_nodes={}))
        await wrap(search)
        await asyncio.wait_for(asyncio.shield(asyncio.wait([search])), 5)  # it ends, one way or the other
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.05)
        return search, reported
    finally:
        loop.set_exception_handler(old)


@pytest.mark.timeout(30)
async def test_cancelling_a_hivemind_search_still_leaks_its_workers_tasks():
    async def cancel_at_timeout(search):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(search, 0.1)

    search, reported = await _search_cut_short(cancel_at_timeout)
    assert search.cancelled()
    assert "Task was destroyed but it is pending!" in reported, "hivemind's search no longer leaks: simplify _dht_call"


@pytest.mark.timeout(30)
async def test_a_dht_call_past_its_timeout_ends_by_itself_and_leaks_nothing():
    from swarmd.dht.discovery import Discovery, DiscoveryConfig
    from swarmd.transport.errors import TransportError
    from swarmd.transport.identity import Identity

    discovery = Discovery(None, Identity.generate(), DiscoveryConfig("s", [], dht_timeout=0.1), version="test")

    async def our_call(search):
        with pytest.raises(TransportError, match="DHT walk timed out"):
            await discovery._dht_call("walk", search)
        assert not search.done() and discovery.counters["dht_timeouts"] == 1

    search, reported = await _search_cut_short(our_call)
    assert not search.cancelled() and search.exception() is None and reported == []
    assert discovery._detached == {}  # ended and forgotten


@pytest.mark.timeout(30)
async def test_dht_calls_left_running_are_bounded_and_ended_at_close():
    from swarmd.dht.discovery import MAX_DETACHED, Discovery, DiscoveryConfig
    from swarmd.transport.errors import TransportError
    from swarmd.transport.identity import Identity

    discovery = Discovery(None, Identity.generate(), DiscoveryConfig("s", [], dht_timeout=0.05), version="test")
    calls = [asyncio.ensure_future(asyncio.Event().wait()) for _ in range(MAX_DETACHED + 4)]  # never end
    for call in calls:
        with pytest.raises(TransportError):
            await discovery._dht_call("get", call)
    await asyncio.sleep(0)
    assert [c.cancelled() for c in calls] == [True] * 4 + [False] * MAX_DETACHED  # the oldest went first
    assert len(discovery._detached) == MAX_DETACHED
    await discovery.close()
    await asyncio.sleep(0)
    assert all(c.cancelled() for c in calls) and discovery._detached == {}
