"""Signed records: the Ed25519 DHT record validator and the node record every member publishes.

DHT records (hivemind ``DHTNode``)
    A protected record names its owner in the *subkey* (``[owner:ed25519:<peer id>]``): validators only see the main
    key as its DHTID hash, so an owner tag there would protect nothing. The value gets a fixed-size suffix
    ``[ed25519sig:<base64 of 64 bytes>]`` holding the owner's signature over msgpack((key id, subkey, value,
    expiration)). The owner's public key comes from the peer id itself (identity multihash). Only our own keys are
    accepted (``protected_keys``), each entry only owner-signed, with an expiration at most ``max_ttl`` ahead, and
    with a value that decodes and passes the key's check (for the members key: one node record about its owner):
    nobody can write unsigned junk, store 31-year records, or plant a value that breaks a reader.
    hivemind ships only an RSA validator; this one is written for Ed25519 and strips the signature by its fixed
    length, not by a regex over the payload.

Envelopes (direct streams)
    ``seal``/``open_envelope``: ``{"p": payload bytes, "s": signature}``; the signature covers a domain tag and the
    payload bytes exactly as sent, so no canonical re-encoding is needed to verify.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import re
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from swarmd.transport import identity as ident
from swarmd.transport._compat import load_hivemind
from swarmd.transport.errors import BadSignature, FrameTooLarge, MalformedMessage
from swarmd.transport.framing import pack_record, unpack_record
from swarmd.transport.identity import Identity
from swarmd.transport.multiaddrs import validate_multiaddr
from swarmd.transport.wire import WIRE, Float, Int, List, Map, OneOf, Str

_hm = load_hivemind()

OWNER_PREFIX = b"[owner:ed25519:"
_OWNER_RE = re.compile(rb"\[owner:ed25519:([1-9A-HJ-NP-Za-km-z]{1,64})\]")
_SIG_PREFIX = b"[ed25519sig:"
_SIG_B64_LEN = 88  # base64 of 64 bytes
_SIG_SUFFIX_LEN = len(_SIG_PREFIX) + _SIG_B64_LEN + 1
MAX_RECORD_VALUE = 8 * 1024


ValueCheck = Callable[[str, Any], "bool | str"]  # True, or False / a refusal reason


def _any_value(owner: str, value: Any) -> bool:
    return True


def _member_record(owner: str, value: Any) -> NodeRecord | None:
    """The node record a members-key value holds, if it is one record about the peer that signed it."""
    try:
        record = NodeRecord.from_wire(value)
    except MalformedMessage:
        return None
    return record if record.peer_id == owner else None


def member_value_ok(owner: str, value: Any) -> bool:
    """The members key's check: the value is one node record, about the peer that signed it."""
    return _member_record(owner, value) is not None


def member_check(admitted: Callable[[NodeRecord], bool | str],
                 window: Callable[[], int] | None = None) -> ValueCheck:
    """The members key's check in a swarm that prices identities: one node record about its signer, and
    ``admitted`` by the swarm's rule (its ticket, or the allowlist); a record that is not is refused as
    "unadmitted" (or the reason ``admitted`` names). ``window``: the time window the rule's verdicts hold in (a
    record's ticket is bound to one): a value accepted in one window is checked again in the next."""
    def check(owner: str, value: Any) -> bool | str:
        record = _member_record(owner, value)
        if record is None:
            return False
        verdict = admitted(record)
        return True if verdict is True else verdict if isinstance(verdict, str) and verdict else "unadmitted"

    if window is not None:
        check.window = window
    return check


def owner_tag(peer_id: str) -> bytes:
    return OWNER_PREFIX + peer_id.encode() + b"]"


def dht_key_id(key: str) -> bytes:
    """The DHTID bytes hivemind uses for a raw key (what validators see as ``record.key``)."""
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=key).to_bytes()


def _digest(*parts: bytes) -> bytes:
    """A 32-byte BLAKE2b digest of ``parts``, each prefixed by its length (no two lists of parts share one)."""
    h = hashlib.blake2b(digest_size=32)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


class _Recent:
    """A bounded set of digests, the least recently seen dropped first (``size`` 0: holds nothing)."""

    def __init__(self, size: int):
        self._size = size
        self._items: OrderedDict[bytes, None] = OrderedDict()

    def seen(self, digest: bytes | None) -> bool:
        if digest is None or digest not in self._items:
            return False
        self._items.move_to_end(digest)
        return True

    def add(self, digest: bytes | None) -> None:
        if digest is None or self._size <= 0:
            return
        self._items[digest] = None
        if len(self._items) > self._size:
            self._items.popitem(last=False)


class Ed25519RecordValidator(_hm.RecordValidatorBase):
    """hivemind record validator for Ed25519-owned records. Never raises on bad input: it answers False."""

    def __init__(self, identity: Identity, protected_keys: dict[str, ValueCheck] | list[str] = (),
                 *, max_ttl: float = 600.0, remember: int = 20_000):
        """``protected_keys``: our keys, each with a check of (owner peer id, decoded value) -> bool (a list: any
        value that decodes). Records on any other key are refused. ``remember``: how many accepted records to know
        again without re-checking (0: check every time)."""
        self._identity = identity
        self.local_owner_tag = owner_tag(identity.peer_id)
        checks = protected_keys if isinstance(protected_keys, dict) else {k: _any_value for k in protected_keys}
        self._protected = {dht_key_id(k): check for k, check in checks.items()}
        self.max_ttl = max_ttl
        self.refused: Counter = Counter()  # by reason, for /status
        # Every member poll returns every member's record, and most are ones an earlier poll checked. A record
        # accepted once is accepted again without its checks: the digest covers every byte the signature and the
        # value check read (the time bound is checked every time). A member's refresh changes only the expiry its
        # signature covers, so its value's check (a strict parse: half the cost) is remembered apart, by owner,
        # key and value bytes. Accepted ones only: a flood of bad records can neither fill these nor be answered
        # from them.
        self._accepted = _Recent(remember)
        self._values_ok = _Recent(remember)
        self._remember = remember
        # "verified" (signature checked; "value_remembered" of those: their value's check was not redone) or
        # "remembered" (the whole record known), for /status
        self.checks: Counter = Counter()

    def validate(self, record) -> bool:
        try:
            reason = self._refusal(record)
        except Exception:
            reason = "malformed"
        if reason is not None:
            self.refused[reason] += 1
        return reason is None

    def _refusal(self, record) -> str | None:
        check = self._protected.get(record.key)
        if check is None:
            return "foreign_key"
        if len(record.value) > MAX_RECORD_VALUE + _SIG_SUFFIX_LEN:
            return "oversized"
        if record.expiration_time > _hm.get_dht_time() + self.max_ttl:
            return "expiry_too_far"
        owners = set(_OWNER_RE.findall(record.subkey or b""))
        if len(owners) != 1:
            return "unsigned"
        signature = self._signature_of(record.value)
        if signature is None:
            return "unsigned"
        owner = owners.pop().decode()
        stripped = dataclasses.replace(record, value=record.value[:-_SIG_SUFFIX_LEN])
        if len(signature) != ident.SIGNATURE_SIZE:
            return "bad_signature"
        signed = self._signed_bytes(stripped)
        remember = self._remember > 0
        whole = _digest(signature, signed) if remember else None
        if self._accepted.seen(whole):
            self.checks["remembered"] += 1
            return None
        self.checks["verified"] += 1
        if not ident.verify(owner, signed, signature):
            return "bad_signature"
        window = getattr(check, "window", None)
        value_digest = _digest(record.key, owner.encode(), stripped.value,
                               b"" if window is None else str(window()).encode()) if remember else None
        if self._values_ok.seen(value_digest):
            self.checks["value_remembered"] += 1
        else:
            try:
                value = unpack_record(stripped.value, max_size=MAX_RECORD_VALUE)
            except (MalformedMessage, FrameTooLarge):
                return "malformed"
            verdict = check(owner, value)
            if verdict is not True:
                return verdict if isinstance(verdict, str) else "malformed"
            self._values_ok.add(value_digest)
        self._accepted.add(whole)
        return None

    def sign_value(self, record) -> bytes:
        if self.local_owner_tag not in (record.subkey or b""):
            return record.value
        signature = self._identity.sign(self._signed_bytes(record))
        return record.value + _SIG_PREFIX + base64.b64encode(signature) + b"]"

    def strip_value(self, record) -> bytes:
        if self._signature_of(record.value) is None:
            return record.value
        return record.value[:-_SIG_SUFFIX_LEN]

    @staticmethod
    def _signature_of(value: bytes) -> bytes | None:
        if len(value) < _SIG_SUFFIX_LEN or not value.endswith(b"]"):
            return None
        suffix = value[-_SIG_SUFFIX_LEN:]
        if not suffix.startswith(_SIG_PREFIX):
            return None
        try:
            return base64.b64decode(suffix[len(_SIG_PREFIX) : -1], validate=True)
        except (binascii.Error, ValueError):
            return None

    @staticmethod
    def _signed_bytes(record) -> bytes:
        # a packer sized to the record: packb's default 256 KiB buffer would cost every check 64x a small record
        size = len(record.key) + len(record.subkey or b"") + len(record.value) + 64
        return msgpack.Packer(use_bin_type=True, buf_size=size).pack(
            (record.key, record.subkey, record.value, record.expiration_time))

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other) -> bool:
        return False  # one instance per node; never merge keys from another validator


# ------------------------------------------------------------------------------------------------ envelopes
_ENVELOPE_DOMAIN = b"swarmd/envelope/v1\x00"


def seal(identity: Identity, payload: Any) -> dict:
    data = pack_record(payload)
    return {"p": data, "s": identity.sign(_ENVELOPE_DOMAIN + data)}


def open_envelope(envelope: Any, author: str, *, max_size: int) -> Any:
    """Verify ``author``'s signature and decode. Raises MalformedMessage / BadSignature."""
    if not isinstance(envelope, dict) or set(envelope) != {"p", "s"}:
        raise MalformedMessage("envelope must be {p: bytes, s: bytes}")
    data, sig = envelope["p"], envelope["s"]
    if not isinstance(data, bytes) or not isinstance(sig, bytes):
        raise MalformedMessage("envelope fields must be bytes")
    if len(data) > max_size:
        raise FrameTooLarge(f"envelope payload of {len(data)} B exceeds limit {max_size} B")
    if not ident.verify(author, _ENVELOPE_DOMAIN + data, sig):
        raise BadSignature(f"envelope signature does not verify for {author}")
    return unpack_record(data, max_size=max_size)


# ------------------------------------------------------------------------------------------------ node record
MAX_ADDRS = 16
MAX_LOOPS = 16
MAX_TEXT = 64
MAX_POLICY = 32
_RECORD_FIELDS = {"v", "peer", "addrs", "version", "loops", "issued"}
MAX_TICKET = 2**64 - 1  # crdt.admission's nonces are 8 bytes
RECORD = WIRE.blob("(DHT value, hello)", "dht.record", Map.of(
    optional=("adm", "tk"), v=Int(1, 1), peer=Str(128), addrs=List(Str(512), MAX_ADDRS), version=Str(MAX_TEXT),
    loops=List(Str(MAX_TEXT, min=1), MAX_LOOPS), issued=OneOf((Float(), Int(0))), adm=Str(MAX_POLICY, min=1),
    tk=Int(0, MAX_TICKET)), {
    "v": 1, "peer": "12D3KooW...", "addrs": ["/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW..."], "version": "0.1.0",
    "loops": ["diloco/run"], "issued": 1_800_000_000.5, "adm": "0123456789abcdef", "tk": 48_211}, max_size=8192,
    signed="swarmd/envelope/v1", doc="a node's record of itself, sealed ({p: this, s: its signature}) in the DHT and "
    "in hello; adm: the digest of its admission rule (crdt.admission), absent in records of nodes before it; tk: its "
    "admission ticket in an open swarm (the work that puts a price on an identity), which the members key asks for")


@dataclass(frozen=True)
class NodeRecord:
    """What a member publishes about itself under the swarm's members key."""

    peer_id: str
    addrs: tuple[str, ...]
    version: str
    loops: tuple[str, ...]
    issued: float  # issuer's wall clock (seconds)
    policy: str = ""  # the digest of its admission rule ("": not said, by an older node)
    ticket: int | None = None  # its admission ticket (crdt.admission), in an open swarm

    def to_wire(self) -> dict:
        wire = {
            "v": 1,
            "peer": self.peer_id,
            "addrs": list(self.addrs),
            "version": self.version,
            "loops": list(self.loops),
            "issued": self.issued,
        }
        if self.policy:
            wire["adm"] = self.policy
        if self.ticket is not None:
            wire["tk"] = self.ticket
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> NodeRecord:
        """Strict parse: exact field set and types, bounded sizes. Raises MalformedMessage."""
        if not isinstance(obj, dict) or set(obj) - {"adm", "tk"} != _RECORD_FIELDS:
            raise MalformedMessage("node record: wrong fields")
        ticket = obj.get("tk")
        if "tk" in obj and (type(ticket) is not int or not 0 <= ticket <= MAX_TICKET):
            raise MalformedMessage("node record: bad admission ticket")
        policy = obj.get("adm", "")
        if not isinstance(policy, str) or len(policy) > MAX_POLICY or ("adm" in obj and not policy):
            raise MalformedMessage("node record: bad admission digest")
        if obj["v"] != 1:
            raise MalformedMessage(f"node record: unsupported version {obj['v']!r}")
        peer, addrs, version, loops, issued = obj["peer"], obj["addrs"], obj["version"], obj["loops"], obj["issued"]
        if not isinstance(peer, str) or not ident.is_valid_peer_id(peer):
            raise MalformedMessage("node record: bad peer id")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS or not all(isinstance(a, str) for a in addrs):
            raise MalformedMessage("node record: bad addrs")
        try:
            addrs = tuple(validate_multiaddr(a) for a in addrs)
        except ValueError as e:
            raise MalformedMessage(f"node record: {e}") from None
        if not isinstance(version, str) or len(version) > MAX_TEXT:
            raise MalformedMessage("node record: bad version")
        if (
            not isinstance(loops, list)
            or len(loops) > MAX_LOOPS
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_TEXT for x in loops)
        ):
            raise MalformedMessage("node record: bad loops")
        if type(issued) is not float or issued != issued:
            raise MalformedMessage("node record: bad issued time")
        return cls(peer, addrs, version, tuple(loops), issued, policy, ticket)


def now() -> float:
    return time.time()
