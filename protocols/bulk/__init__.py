"""Bulk tensor transfer: announce through pubsub, pull over a direct TCP connection, verify the hash, then hand over.

Small messages go through :mod:`protocols.gossip`; tensors do not. A publisher stores the bytes, announces
``{hash, size, codec, topic, round, fragment, addrs}`` on the ``swarmd/bulk`` topic (signed like every pubsub
message), and receivers pull the bytes from the announcer, or from any peer that already has them (holders announce
``HAVE`` for a hash they verified). Nothing is handed to a loop before its BLAKE3 hash matches; a source that serves
other bytes is penalised and the next source is tried.

Transport: a plain TCP connection to the holder's bulk port (the address it announces), never a relayed libp2p
connection: relays carry announcements only. The receiver reads into one preallocated buffer with an asyncio
``BufferedProtocol`` (measured here: a whole-message ``readexactly`` halves asyncio throughput, and the p2p daemon's
streams peak at ~0.5 GB/s on loopback). A request is signed by the requester (peer id, hash, time), so a holder
serves members only and can rate-limit them; integrity comes from the hash, so the stream itself needs no
encryption (the same bytes are announced to the whole swarm).

Wire (TCP): request ``u32 length | msgpack {"hash", "peer", "ts", "sig"}``; reply ``u8 status | u64 size | bytes``
(status 0 ok, 1 unknown hash, 2 refused). A connection carries further requests, one after another, each
answered in full before the next is sent (a server keeps an idle one KEEPALIVE s; a client keeps its idle ones in a
``ConnectionPool`` for less), so a round's pulls from one source reuse one connection: no new TCP handshake, and on
a real link no new slow start, for each chunk. A server that closes after one reply (an older node) is still
understood: a pooled connection closed before its reply is retried once on a new one. A server holds at most
``max_served()`` connections at once; at a new one past that it closes one that waits for a request, the longest
waiting of the host with the most waiting (a flood of idle connections from one host closes its own), counted
(``connections_evicted``).

Behind NATs a holder's TCP port is not reachable, but a hole-punched libp2p connection is (``node.nat``). So the
same request also works as a stream, ``/swarmd/bulk/1.0.0``: REQUEST {hash, peer, ts, sig} (peer must be the
stream's authenticated peer), HEAD {status, size}, then DATA frames of at most 1 MiB. A holder refuses it on a
relayed connection (relays carry control traffic only). A receiver uses it for sources it reaches on a
hole-punched connection, and for directly connected sources whose TCP address did not answer.

The package's modules, one concept each: ``wire`` (the topic, the announcements and the requests, their limits, the
errors, the content hash), ``receive`` (the client side: ``fetch`` over TCP with its ``ConnectionPool``,
``fetch_stream`` over a stream), ``serve`` (the server side, ``ServingMixin``: connections, keep-alive and eviction,
the request's checks and the serving limits) and ``service`` (``BulkService``: the store, announcing, keeping the
others' announcements, pulling from their sources, ``/status`` and the HTTP routes; it composes ``ServingMixin``).
"""

from swarmd.protocols.bulk.receive import (  # noqa: F401
    GROW,
    HOLD,
    IDLE_TIMEOUT,
    INLINE_HASH,
    LOWAT,
    POOL_IDLE,
    POOL_MAX,
    POOL_PER_ADDR,
    WAKE_EVERY,
    ConnectionPool,
    _Closed,
    _fetch_on,
    _large_buffer,
    _Receiver,
    fetch,
    fetch_stream,
)
from swarmd.protocols.bulk.serve import (  # noqa: F401
    KEEPALIVE,
    MAX_SERVING_PER_PEER,
    SERVE_BURST,
    SERVE_RATE,
    SERVED_MAX,
    SERVED_MIN,
    ServingMixin,
    max_served,
)
from swarmd.protocols.bulk.service import DEFAULT_MAX_BYTES, BulkService  # noqa: F401
from swarmd.protocols.bulk.wire import (  # noqa: F401
    ANNOUNCE,
    ANNOUNCEMENT_TTL,
    CHUNK,
    DATA,
    HASH_THREADS_FROM,
    HAVE,
    HEAD,
    HEADER,
    MAX_ANNOUNCEMENTS,
    MAX_BLOB,
    MAX_PER_AUTHOR,
    MAX_REQUEST,
    OK,
    REFUSED,
    REQUEST,
    REQUEST_DOMAIN,
    STREAM_SPEC,
    TOPIC,
    UNKNOWN,
    Announcement,
    BadData,
    BulkError,
    content_hash,
    hasher,
)
