"""Two real nodes (each with its own p2p daemon, HTTP endpoint, op log and gossip) in one Python process: nothing of
a node is process-wide (no environment writes, no global seeds or registries), so they join, replicate and gossip
as two processes would."""

import asyncio
import os
from pathlib import Path

import pytest

from swarmd.node.config import load_config
from swarmd.node.core import Node
from swarmd.protocols.gossip import Gossip
from swarmproc import wait_until
from swarmd.transport.identity import Identity

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "configs" / "local.toml"

pytestmark = pytest.mark.swarm


@pytest.mark.timeout(90)
async def test_two_nodes_in_one_process_join_replicate_and_gossip(tmp_path):
    env_before = dict(os.environ)
    nodes, tasks, gossips = [], [], []
    ready = [asyncio.Event(), asyncio.Event()]
    try:
        for i in range(2):
            bootstrap = {"network": {"bootstrap": [nodes[0].addresses[0]]}} if i else {}
            config = load_config(LOCAL, bootstrap)
            gossip = Gossip()
            (tmp_path / f"n{i}").mkdir()
            node = Node(config, Identity.generate(), tmp_path / f"n{i}", services=[gossip])
            nodes.append(node)
            gossips.append(gossip)
            tasks.append(asyncio.create_task(node.run(lambda n, e=ready[i]: e.set())))
            await asyncio.wait_for(ready[i].wait(), 30)
        a, b = nodes
        await wait_until(lambda: b.identity.peer_id in a.connected and a.identity.peer_id in b.connected, 30,
                         "the two nodes to connect")
        both = {a.identity.peer_id, b.identity.peer_id}
        await wait_until(lambda: all(both <= set(n.replicator.store.value("members")) for n in nodes), 30,
                         "both member sets to list both nodes")
        await a.replicator.write("kv", {"k": f"{a.identity.peer_id}/note", "v": "hello"})
        await wait_until(lambda: b.replicator.store.digest() == a.replicator.store.digest(), 30,
                         "the write to replicate")
        sub = gossips[1].subscribe("two/nodes")
        gossips[0].subscribe("two/nodes")
        got = None
        deadline = asyncio.get_running_loop().time() + 30
        while got is None and asyncio.get_running_loop().time() < deadline:
            gossips[0].publish("two/nodes", b"ping")  # again until the links and subscriptions are up
            try:
                got = await asyncio.wait_for(sub.__anext__(), 0.5)
            except asyncio.TimeoutError:
                pass
        assert got is not None and got.data == b"ping" and got.author == a.identity.peer_id
        # two daemons, two endpoints, and the process environment untouched
        assert a.http.url != b.http.url and a.addresses[0] != b.addresses[0]
        assert dict(os.environ) == env_before
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.timeout(90)
async def test_two_nodes_with_different_admission_rules_say_so_and_never_ban_each_other(tmp_path):
    """Two honest nodes of one swarm configured with different `state.admission_bits` judge each other's authors
    differently: each would take the other's ops for forged (a 50-point penalty each) and they banned each other.
    Their member records now say their rule: each sees the other's is different (`/status` -> dht.other_rule, a
    warning in the log), does not replicate with it, refuses its replication streams without a penalty, and the
    two stay connected and usable for everything else."""
    nodes, tasks = [], []
    ready = [asyncio.Event(), asyncio.Event()]
    try:
        for i in range(2):
            overrides = {"state": {"admission_bits": 12 + i}}
            if i:
                overrides["network"] = {"bootstrap": [nodes[0].addresses[0]]}
            (tmp_path / f"n{i}").mkdir()
            node = Node(load_config(LOCAL, overrides), Identity.generate(), tmp_path / f"n{i}")
            nodes.append(node)
            tasks.append(asyncio.create_task(node.run(lambda n, e=ready[i]: e.set())))
            await asyncio.wait_for(ready[i].wait(), 30)
        a, b = nodes
        ida, idb = a.identity.peer_id, b.identity.peer_id
        await wait_until(lambda: a.discovery.policy_mismatch() == [idb] and b.discovery.policy_mismatch() == [ida],
                         30, "each node to see the other's rule in its record")
        assert a.discovery.policy != b.discovery.policy
        assert idb not in a._replication_peers() and ida not in b._replication_peers()
        # a replication stream opened anyway (as a node from before this check would) is refused, not penalised
        with pytest.raises(Exception):
            await b.replicator.sync_with(ida)
        await wait_until(lambda: a.replicator.counters["refused_other_rule"] >= 1, 10, "the refusal")
        await a.replicator.write("kv", {"k": f"{ida}/note", "v": "not for b"})
        await b.replicator.write("kv", {"k": f"{idb}/note", "v": "not for a"})
        assert not any(f"{idb}/" in k for k in a.replicator.store.value("kv"))
        assert a.transport.penalties.score(idb) == 0 and b.transport.penalties.score(ida) == 0
        assert a.status()["dht"]["other_rule"] == [idb] and a.status()["dht"]["policy_mismatch"] >= 1
        assert idb in a.connected and ida in b.connected  # connected, just not replicating
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
