"""The pubsub wire protocol and its message: the kinds spoken on ``/swarmd/pubsub/1.0.0``, their size limits, and
the signed message itself.

A message is ``{"b": [1, topic, author, seq, ts_ms, data], "s": Ed25519 sig}``: the author signs the msgpack body in
:data:`SIGN_DOMAIN`, and its id is the BLAKE2b-128 of the body, so a verbatim copy has the same id wherever it comes
from. :func:`decode_message` checks a message's structure only; a receiver verifies the author's signature
(:func:`signed_by_author`) before anything else. The mesh that carries messages is :mod:`protocols.gossip`.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgpack

from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import ProtocolSpec, unpack
from swarmd.transport.identity import Identity, verify
from swarmd.transport.wire import WIRE, Bytes, List, Map, Str

SUB, UNSUB, MSG, IHAVE, IWANT, GRAFT, PRUNE = range(1, 8)
MAX_MESSAGE = 4 << 20
PUBSUB_SPEC = ProtocolSpec("pubsub", "1.0.0", max_frame=MAX_MESSAGE + 65536,
                           kinds=frozenset({SUB, UNSUB, MSG, IHAVE, IWANT, GRAFT, PRUNE}), idle_timeout=120.0)
SIGN_DOMAIN = b"swarmd/pubsub/v1\x00"
MAX_TOPIC = 128
MAX_TOPICS_PER_PEER = 256
MAX_IDS = 512

_TOPICS = List(Str(MAX_TOPIC, min=1), MAX_TOPICS_PER_PEER)
_ID = Bytes(exact=16)
for _code, _name, _doc in ((SUB, "sub", "topics the sender subscribes to (also a keepalive, empty)"),
                           (UNSUB, "unsub", "topics it leaves"), (GRAFT, "graft", "add me to your mesh of these"),
                           (PRUNE, "prune", "take me out of your mesh of these")):
    WIRE.frame(PUBSUB_SPEC, _code, f"pubsub.{_name}", _TOPICS, ["diloco/run"], doc=_doc)
WIRE.frame(PUBSUB_SPEC, MSG, "pubsub.msg", Map.of(b=Bytes(MAX_MESSAGE + 1024), s=Bytes(exact=64)),
           {"b": msgpack.packb([1, "diloco/run", "12D3KooW...", 1, 1_800_000_000_000, b"data"]), "s": bytes(64)},
           signed=SIGN_DOMAIN.rstrip(b"\0").decode(),
           doc="b: msgpack [1, topic, author, seq, ts_ms, data], signed by the author; id = BLAKE2b-128(b)")
WIRE.frame(PUBSUB_SPEC, IHAVE, "pubsub.ihave", Map.of(topic=Str(MAX_TOPIC), ids=List(_ID, MAX_IDS)),
           {"topic": "diloco/run", "ids": [bytes(16)]}, doc="ids of recent messages of a topic")
WIRE.frame(PUBSUB_SPEC, IWANT, "pubsub.iwant", List(_ID, MAX_IDS), [bytes(16)], doc="send me these messages")


class Verdict(enum.Enum):
    ACCEPT = "accept"
    REJECT = "reject"  # invalid: not forwarded, counts against the sender
    IGNORE = "ignore"  # not for us (e.g. a round already closed): not forwarded, no penalty


@dataclass(frozen=True)
class Message:
    id: bytes
    topic: str
    author: str
    seq: int
    ts_ms: int
    data: bytes
    body: bytes
    sig: bytes
    received_from: str | None = None

    def wire(self) -> dict:
        return {"b": self.body, "s": self.sig}


Validator = Callable[[Message], "Verdict | Awaitable[Verdict]"]


def sign_message(identity: Identity, topic: str, seq: int, ts_ms: int, data: bytes) -> Message:
    """``data`` on ``topic`` as ``identity`` publishes it: its body, signed, and its id."""
    body = msgpack.packb([1, topic, identity.peer_id, seq, ts_ms, data], use_bin_type=True)
    return Message(_mid(body), topic, identity.peer_id, seq, ts_ms, data, body, identity.sign(SIGN_DOMAIN + body))


def signed_by_author(message: Message) -> bool:
    """Whether the message's signature is its claimed author's, over its body."""
    return verify(message.author, SIGN_DOMAIN + message.body, message.sig)


def _mid(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


def decode_message(wire: Any) -> Message:
    """A signed pubsub message from its wire form (structure only: the caller verifies the signature)."""
    if not isinstance(wire, dict) or set(wire) != {"b", "s"}:
        raise MalformedMessage("pubsub: message must be {b, s}")
    body, sig = wire["b"], wire["s"]
    if not isinstance(body, bytes) or not isinstance(sig, bytes) or len(body) > MAX_MESSAGE + 1024:
        raise MalformedMessage("pubsub: bad message fields")
    try:
        obj = unpack(body)
    except MalformedMessage:
        raise MalformedMessage("pubsub: undecodable message body") from None
    if (
        not isinstance(obj, list)
        or len(obj) != 6
        or obj[0] != 1
        or not isinstance(obj[1], str)
        or not 0 < len(obj[1]) <= MAX_TOPIC
        or not isinstance(obj[2], str)
        or type(obj[3]) is not int
        or type(obj[4]) is not int
        or not isinstance(obj[5], bytes)
    ):
        raise MalformedMessage("pubsub: message body must be [1, topic, author, seq, ts_ms, data]")
    _, topic, author, seq, ts_ms, data = obj
    return Message(_mid(body), topic, author, seq, ts_ms, data, body, sig)
