"""Bulk transfer: a 100 MB tensor announced by one node is pulled and verified by 4 others; bad bytes are caught."""

import asyncio
import os

import pytest

from protocols.bulk import HEADER, OK, BadData, content_hash, fetch
from swarmproc import http_get, http_post as post, wait_for


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_100_mb_tensor_pulled_and_verified_by_four_nodes(swarm):
    import threading

    import torch

    from protocols import codecs

    nodes = swarm.start_chain(5)
    ids = {n.peer_id for n in nodes}
    wait_for(lambda: all(n.status()["services"]["gossip"]["topics"]["swarmd/bulk"]["mesh"] >= 4 for n in nodes), 20,
             "the bulk announcement topic to mesh")
    tensor = torch.randn(25 * 1024 * 1024)  # 100 MiB of fp32
    payload = codecs.encode(tensor, "none")
    put = post(nodes[0].url + "/bulk?codec=none", payload, timeout=120)
    assert put["size"] == len(payload)
    blob = put["hash"]
    wait_for(lambda: all(n.status()["services"]["bulk"]["announcements"] >= 1 for n in nodes[1:]), 10,
             "the announcement to reach every node")
    results = {}

    def pull(n):
        results[n.peer_id] = post(f"{n.url}/bulk/{blob}/pull", timeout=150)

    threads = [threading.Thread(target=pull, args=(n,)) for n in nodes[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(160)
    assert len(results) == 4
    for n in nodes[1:]:
        r = results[n.peer_id]
        assert r["size"] == len(payload) and r["source"] in ids
        held = http_get(n.url + "/bulk")
        assert held[blob] == {"size": len(payload), "verified": True}
    assert content_hash(payload).hex() == blob


async def test_a_source_serving_other_bytes_is_caught():
    data = os.urandom(1 << 20)

    async def liar(reader, writer):
        await reader.read(100)
        bad = bytearray(data)
        bad[12345] ^= 1
        writer.write(HEADER.pack(OK, len(bad)) + bad)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(liar, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(BadData):
            await fetch(f"127.0.0.1:{port}", content_hash(data), len(data), b"req")
    finally:
        server.close()
        await server.wait_closed()
