"""Nobody locked out (issue 80): admitted identities by the thousand, writers whose ops peers refuse, and closed
swarms that keep their state to their members, against real node processes."""

import asyncio
import time

import pytest

from swarmd.crdt.admission import Admission
from swarmd.crdt.ops import make_op
from swarmd.node.replication import CRDT_SPEC, PUSH, SYNC
from swarmproc import LOCAL_CONFIG, Swarm, http_get, http_post, wait_for
from swarmd.transport.errors import TransportError
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport

pytestmark = pytest.mark.swarm

BITS = 6  # tickets cheap enough for a test's thousands of identities: what is tested is the count, not the price


def cheap_config(tmp_path, extra_state: str = "") -> object:
    config = tmp_path / "cheap.toml"
    text = LOCAL_CONFIG.read_text().replace("admission_bits = 12", f"admission_bits = {BITS}\n{extra_state}")
    assert f"admission_bits = {BITS}" in text
    config.write_text(text)
    return config


def admitted(n: int, swarm: str) -> list[dict]:
    """n fresh identities' ticketed op #1s, as wires."""
    adm, now, out = Admission(swarm, BITS), int(time.time() * 1000), []
    for _ in range(n):
        who = Identity.generate()
        out.append(make_op(who.sign, who.peer_id, 1, (now, 0), [], "members",
                           adm.payload(who.peer_id, adm.mint(who.peer_id))).wire())
    return out


async def push(target, wires: list, key: Identity | None = None) -> list[dict]:
    """Push ``wires`` at ``target`` over one connection, 1000 a message; the ACKs."""
    t = P2PDaemonTransport(key or Identity.generate(), P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await t.start()
    acks = []
    try:
        await t.connect(target.tcp_addr)
        async with await t.open_stream(target.peer_id, CRDT_SPEC, timeout=10) as stream:
            for start in range(0, len(wires), 1000):
                await stream.send(PUSH, {"ops": wires[start:start + 1000]})
                acks.append((await stream.read_required()).body)
    finally:
        await t.close()
    return acks


def kv(node) -> dict:
    return http_get(node.url + "/state")["objects"]["kv"]


def write(node, key: str, value) -> dict:
    return http_post(node.url + "/crdt", json_body={"ops": [{"object": "kv", "payload": {"k": key, "v": value}}]})


@pytest.mark.timeout(240)
async def test_admitted_identities_beyond_the_author_table_lock_no_newcomer_out(tmp_path, request):
    # issue 80 item 1: a replica held at most max_authors authors and refused every new one after that
    # (authors_full): a newcomer's write got 200 and never reached any other node. Here the table holds 300, a
    # stranger pushes 1,500 admitted identities at one node, and a newcomer that joins afterwards writes.
    swarm = Swarm(tmp_path / "nodes", config=cheap_config(tmp_path, "max_authors = 300"))
    request.addfinalizer(swarm.close)
    honest = swarm.start_chain(3)
    a = honest[0]
    flood = await asyncio.to_thread(admitted, 1500, a.status()["swarm"])
    acks = await push(a, flood)
    assert sum(ack["rejected"] for ack in acks) == 0  # nothing of it is the sender's fault: held, not refused
    s = a.status()["crdt"]
    assert s["probation"] <= 300 and s["probation_evicted"] >= 1200 and s["authors"] == 3
    assert "authors_full" not in s["rejected"]

    newcomer = swarm.start("late", bootstrap=[a.tcp_addr])
    wait_for(lambda: all(newcomer.peer_id in n.member_ids() for n in honest), 60, "the newcomer to be a member")
    write(newcomer, f"{newcomer.peer_id}/hello", 1)
    started = time.monotonic()
    wait_for(lambda: all(kv(n).get(f"{newcomer.peer_id}/hello") == 1 for n in honest), 30,
             "the newcomer's first write to reach every honest node")
    reached = time.monotonic() - started
    nodes = honest + [newcomer]
    wait_for(lambda: len({http_get(n.url + "/state")["digest"] for n in nodes}) == 1, 30, "every node to converge")
    for n in nodes:
        s = n.status()["crdt"]
        assert s["authors"] == 4 and s["probation"] <= 300 and not s["refused_by"], (n.peer_id, s)
    print(f"newcomer's first write reached 3 honest nodes in {reached:.2f} s")
