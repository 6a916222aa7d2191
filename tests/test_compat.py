"""Each workaround in transport/_compat.py: it must still work, and it must still be needed.

If a 'still needed' test fails after an upgrade, the workaround can be deleted (and this test with it)."""

import asyncio
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_protobuf_clash_still_exists_without_the_alias():
    r = _run(
        """
        import libp2p.crypto.pb.crypto_pb2
        import hivemind.proto.crypto_pb2
        """
    )
    assert r.returncode != 0 and "duplicate symbol" in r.stderr, "the crypto.pb clash is gone: drop the alias"


def test_protobuf_alias_lets_both_stacks_load():
    r = _run(
        """
        from transport._compat import load_hivemind
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


def test_stubs_keep_torch_out_of_the_node():
    r = _run(
        """
        import sys
        from transport._compat import load_hivemind
        hm = load_hivemind()
        import node.core, node.cli, dht.discovery
        print("torch" in sys.modules, hm.DHTNode.__name__, hm.P2P.__name__)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "DHTNode", "P2P"]


@pytest.mark.timeout(60)
async def test_p2pd_needs_the_64_byte_ed25519_key(tmp_path):
    from transport._compat import load_hivemind
    from transport.identity import Identity

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
        from transport.identity import Identity
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
