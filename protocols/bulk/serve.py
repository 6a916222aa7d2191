"""The server side of BulkService (a mixin: the service composes it, and it shares the service's state): the TCP
connections served (each carrying requests one after another, kept KEEPALIVE s for the next, at most
``max_served()`` at once, a waiting one closed to make room), the same request over a stream, the checks a request
must pass (signature, time, membership, rate, transfers at once) and what is being served.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

import msgpack

from swarmd.protocols.bulk.wire import (
    CHUNK,
    DATA,
    HEAD,
    HEADER,
    MAX_REQUEST,
    OK,
    REFUSED,
    REQUEST,
    REQUEST_DOMAIN,
    UNKNOWN,
    BulkError,
)
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import unpack
from swarmd.transport.identity import verify

logger = logging.getLogger("swarmd.protocols.bulk")  # one logger for the whole package

SERVE_RATE, SERVE_BURST = 200.0, 400.0  # requests per second a peer may make of us (fast runs pull often)
MAX_SERVING_PER_PEER = 4  # transfers to one peer at once
KEEPALIVE = 10.0  # s a server waits for a connection's next request (and for its first)
# connections a server holds at once (idle ones included), so that a flood of them (anyone may dial the port we
# announce) cannot take the file descriptors the node needs: a quarter of the process's limit, 64 to 1024
SERVED_MIN, SERVED_MAX = 64, 1024


def max_served() -> int:
    """The connections a bulk server holds at once (see SERVED_MIN): a quarter of the soft RLIMIT_NOFILE."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return SERVED_MIN * 4
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        return SERVED_MAX
    return max(SERVED_MIN, min(SERVED_MAX, soft // 4))


class ServingMixin:
    """BulkService's serving methods (the service composes them; they share its state: ``blobs``, ``counters``,
    ``_ctx``, ``_clock``, ``_log``, ``_rate``, the connections it holds and the transfers under way)."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection's requests, one after another: each read whole and answered whole before the next is read;
        the connection closed once none came for KEEPALIVE s (its first too), at
        the client's end, or at the first bad request."""
        self.counters["connections"] += 1
        peername = writer.get_extra_info("peername")
        host = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        cap = self.max_connections if self.max_connections is not None else max_served()  # (a limit may change)
        if len(self._connections) >= cap and not self._make_room():
            self.counters["connections_refused_full"] += 1
            self._log.log(logging.WARNING, ("full",), "bulk: %d connections served at once, every one mid-request: "
                          "a connection from %s closed unread", len(self._connections), host)
            writer.close()
            return
        served = 0
        self._connections[writer] = asyncio.current_task()
        try:
            while True:
                self._wait(writer, host)
                try:
                    header = await asyncio.wait_for(reader.readexactly(4), KEEPALIVE)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                    if writer in self._evicted or (served and (isinstance(e, asyncio.TimeoutError) or not e.partial)):
                        return  # between requests: the client is done with it, or let it idle out
                    raise
                (length,) = struct.unpack(">I", header)
                if length > MAX_REQUEST:
                    raise BulkError("request too large")
                request = unpack(await asyncio.wait_for(reader.readexactly(length), 10.0))
                self._unwait(writer)
                status, blob = self._check(request)
                writer.write(HEADER.pack(status, len(blob) if blob is not None else 0))
                if blob is not None:
                    peer = request["peer"]
                    self._begin_serving(peer, request["hash"])
                    try:
                        writer.write(memoryview(blob))
                        await writer.drain()
                    finally:
                        self._served(peer, request["hash"])
                    self.counters["served"] += 1
                    self.counters["bytes_served"] += len(blob)
                await writer.drain()
                if status != OK:
                    # a refusal ends the connection: a stream of refused requests costs the sender a connection
                    # each, as a connection that carries one request does (each costs us a signature check)
                    return
                served += 1
                if served > 1:
                    self.counters["served_on_kept_connections"] += 1
        except (BulkError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, TypeError,
                msgpack.UnpackException, MalformedMessage, ConnectionError) as e:
            if writer not in self._evicted:  # (one we closed to make room: not the client's fault)
                self.counters["bad_requests"] += 1
                logger.debug("bulk request refused: %s", e)
        finally:
            self._connections.pop(writer, None)
            self._unwait(writer)
            self._evicted.discard(writer)
            writer.close()

    def _make_room(self) -> bool:
        """(At a new connection to a full server.) Close one connection that waits for a request: of the host
        with the most connections waiting, the one waiting longest, so that a host flooding us closes its own, and an
        idle kept connection costs its client a new one at worst (a pooled connection closed before its reply is
        retried once). False if none waits (every connection is being served)."""
        if not self._waiting:
            return False
        host = max(self._waiting, key=lambda h: len(self._waiting[h]))  # (O(hosts): one flooding host is one)
        held = len(self._waiting[host])
        writer = next(iter(self._waiting[host]))
        self._unwait(writer)
        self._evicted.add(writer)
        self.counters["connections_evicted"] += 1
        self._log.log(logging.WARNING, ("evicted", host), "bulk: %d connections served at once: the one waiting "
                      "longest of the %d from %s closed to make room", len(self._connections), held, host)
        writer.close()
        return True

    def _wait(self, writer: asyncio.StreamWriter, host: str) -> None:
        self._waiting.setdefault(host, {})[writer] = None  # (at the end: the host's newest waiting)
        self._waiting_host[writer] = host

    def _unwait(self, writer: asyncio.StreamWriter) -> None:
        host = self._waiting_host.pop(writer, None)
        if host is not None:
            waiting = self._waiting[host]
            del waiting[writer]
            if not waiting:
                del self._waiting[host]

    async def _serve_stream(self, stream) -> None:
        """The stream flavour of ``_serve``, for peers that reach us on a direct or hole-punched connection."""
        request = await asyncio.wait_for(stream.read_required(), 10)
        if request.kind != REQUEST:
            raise MalformedMessage("bulk: expected REQUEST")
        if "/p2p-circuit" in (stream.remote_addr or ""):
            self.counters["refused_relayed"] += 1
            status, blob = REFUSED, None
        else:
            try:
                status, blob = self._check(request.body)
            except BulkError as e:
                raise MalformedMessage(f"bulk: {e}") from None
            if request.body["peer"] != stream.peer_id:
                status, blob = REFUSED, None  # a request signed by someone else: replayed or relayed on
        await stream.send(HEAD, {"status": status, "size": len(blob) if blob is not None else 0})
        if blob is not None:
            view = memoryview(blob)
            self._begin_serving(stream.peer_id, request.body["hash"])
            try:
                for offset in range(0, len(blob), CHUNK):
                    await stream.send(DATA, view[offset:offset + CHUNK])
            finally:
                self._served(stream.peer_id, request.body["hash"])
            self.counters["served"] += 1
            self.counters["served_over_stream"] += 1
            self.counters["bytes_served"] += len(blob)
        await stream.close(linger=10.0)

    def _begin_serving(self, peer: str, blob_hash: bytes) -> None:
        self._serving[peer] += 1
        self._serving_blobs[blob_hash] += 1

    def _served(self, peer: str, blob_hash: bytes) -> None:
        for counter, key in ((self._serving, peer), (self._serving_blobs, blob_hash)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]
        self._served_at = self._clock().monotonic()

    def serving_until(self, blobs) -> float | None:
        """None while we serve one of ``blobs`` (hashes: peers are still waiting for those bytes of ours), else
        when the last transfer we served ended (monotonic; 0.0: never)."""
        return None if any(h in self._serving_blobs for h in blobs) else self._served_at

    def _check(self, request: Any) -> tuple[int, bytearray | None]:
        if not isinstance(request, dict) or set(request) != {"hash", "peer", "ts", "sig"}:
            raise BulkError("malformed request")
        blob_hash, peer, ts, sig = request["hash"], request["peer"], request["ts"], request["sig"]
        if not isinstance(blob_hash, bytes) or not isinstance(peer, str) or type(ts) is not int:
            raise BulkError("malformed request")
        if abs(self._clock().time() * 1000 - ts) > 60_000 or not isinstance(sig, bytes):
            return REFUSED, None
        if not verify(peer, REQUEST_DOMAIN + blob_hash + str(ts).encode(), sig):
            return REFUSED, None
        if self._ctx.transport.penalties.is_banned(peer):
            return REFUSED, None
        if peer not in self._ctx.members():
            return self._refuse("refused_not_member", peer)
        if self._serving[peer] >= MAX_SERVING_PER_PEER or not self._rate.allow(peer):
            return self._refuse("refused_rate", peer)
        blob = self.blobs.get(blob_hash)
        return (OK, blob) if blob is not None else (UNKNOWN, None)

    def _refuse(self, why: str, peer: str) -> tuple[int, None]:
        self.counters[why] += 1
        self._log.log(logging.INFO, (why, peer), "bulk: request from %s refused (%s)", peer, why)
        return REFUSED, None
