"""Bulk transfer: a 100 MB tensor announced by one node is pulled and verified by 4 others; bad bytes are caught."""

import asyncio
import os
import time

import pytest

from node.services import NodeContext
from protocols.bulk import (HEADER, OK, REQUEST_DOMAIN, STREAM_SPEC, BadData, BulkError, BulkService, content_hash,
                            fetch, fetch_stream)
from swarmproc import http_get, http_post as post, wait_for
from test_punch import free_port
from transport.identity import Identity
from transport.p2pd import P2PDaemonConfig, P2PDaemonTransport


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


@pytest.mark.timeout(60)
async def test_a_blob_pulled_over_a_libp2p_stream_is_checked_like_one_over_tcp(tmp_path):
    """The stream flavour (used on hole-punched connections, where the holder's TCP port is behind its NAT)."""
    holder = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"]))
    puller = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"]))
    await holder.start()
    await puller.start()
    try:
        service = BulkService(gossip=None)
        service._ctx = NodeContext(holder.identity, holder, tmp_path, list, None, lambda p: True)
        data = os.urandom(3 * (1 << 20) + 17)  # several DATA frames and a short last one
        service.blobs[content_hash(data)] = bytearray(data)
        await holder.serve(STREAM_SPEC, service._serve_stream)
        await puller.connect(f"/ip4/127.0.0.1/tcp/{holder.config.listen[0].rsplit('/', 1)[1]}/p2p/{holder.peer_id}")

        def request(blob_hash, signer=puller.identity):
            ts = int(time.time() * 1000)
            return {"hash": blob_hash, "peer": signer.peer_id, "ts": ts,
                    "sig": signer.sign(REQUEST_DOMAIN + blob_hash + str(ts).encode())}

        h = content_hash(data)
        assert await fetch_stream(puller, holder.peer_id, h, len(data), request(h)) == data
        assert service.counters["served_over_stream"] == 1
        with pytest.raises(BadData):  # announced with another size
            await fetch_stream(puller, holder.peer_id, h, len(data) - 1, request(h))
        with pytest.raises(BulkError, match="status 1"):  # a hash it does not hold
            await fetch_stream(puller, holder.peer_id, b"\0" * 32, 10, request(b"\0" * 32))
        other = Identity.generate()  # a request signed by someone else, replayed by the puller: refused
        with pytest.raises(BulkError, match="status 2"):
            await fetch_stream(puller, holder.peer_id, h, len(data), request(h, other))
        service.blobs[h][12345] ^= 1  # the holder serves other bytes: caught by the hash
        with pytest.raises(BadData):
            await fetch_stream(puller, holder.peer_id, h, len(data), request(h))
    finally:
        await holder.close()
        await puller.close()
