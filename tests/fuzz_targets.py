"""Every decoder reachable from the network or the local HTTP endpoint, as fuzz targets: seed inputs (valid
encodings), the call under test, and the exceptions it declares. Used by ``tests/test_fuzz.py`` (a bounded, seeded
run in the suite) and ``bench/bench_fuzz.py`` (10^5 inputs per decoder).

A target's call takes the input bytes and either returns or raises one of its declared exceptions; anything else
is a finding. The loop validators and the CRDT store are real objects (the built-in tasks), driven in one event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import msgpack

from swarmd.crdt import OpStore
from swarmd.crdt.admission import Admission
from swarmd.crdt.ops import OpError, decode_body, make_op
from swarmd.dht.records import Ed25519RecordValidator, NodeRecord
from swarmd.transport.errors import ProtocolViolation
from swarmd.transport.framing import ProtocolSpec, decode, encode, unpack, unpack_record
from swarmd.transport.clock import SYSTEM
from swarmd.transport.wire import WIRE
from swarmd.transport.identity import Identity
from swarmd.transport.penalties import PeerPenalties

SPEC = ProtocolSpec("fuzz", "1.0.0", max_frame=8 << 20, kinds=frozenset({1, 2, 3, 4}))


@dataclass
class Target:
    name: str
    seeds: list[bytes]
    call: Callable[[bytes], Any]
    declared: tuple[type[BaseException], ...]
    close: Callable[[], None] = field(default=lambda: None)


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Bit flips, truncations, inserted noise, msgpack length-field bombs and trailing container headers."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif choice < 0.55 and b:
            del b[rng.randrange(len(b)):]
        elif choice < 0.7 and b:
            i = rng.randrange(len(b))
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif choice < 0.85 and b:
            i = rng.randrange(len(b))
            b[i:i + 4] = rng.choice([b"\xdd\xff\xff\xff", b"\xdf\x7f\xff\xff", b"\xc6\xff\xff\xff", b"\xdc\xff\xff"])
        else:
            b += bytes([rng.choice([0x80, 0x90, 0xc0, 0x91])]) * rng.randint(1, 64)
    return bytes(b)


def inputs(target: Target, n: int, rng: random.Random):
    """The seeds first, then seeded mutations of them."""
    for i in range(n):
        yield target.seeds[i] if i < len(target.seeds) else mutate(rng, rng.choice(target.seeds))


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ------------------------------------------------------------------ wire and state
def _wire_targets(ident: Identity) -> list[Target]:
    from swarmd.node.crdt_wire import answer_sync, answer_want, parse_entries
    from swarmd.protocols import bulk
    from swarmd.protocols.gossip import decode_message as gossip_decode

    now = int(time.time() * 1000)
    admission = Admission("fuzz", bits=4)
    first = make_op(ident.sign, ident.peer_id, 1, (now, 0), [], "members",
                    {"add": ident.peer_id, "ticket": admission.mint(ident.peer_id)})
    kv = make_op(ident.sign, ident.peer_id, 2, (now + 1, 0), [first.id], "kv",
                 {"k": f"{ident.peer_id}/x", "v": [1, {"a": 2.5, "b": None}, "s"]})
    base = make_op(ident.sign, ident.peer_id, 1000, (now + 2, 0), [kv.id], "_base", {
        "parts": {"members": True, "kv": {f"{ident.peer_id}/x": [1, "s"]}, "events": 3, "rounds": 7,
                  "progress": {"step": 1, "samples": 2, "loss": 0.5, "bytes": 3, "round": 1}},
        "ticket": first.payload["ticket"]})  # a base: the author's whole contribution restated
    from swarmd.node.replication import BASE_SCHEMA

    def crdt_op(data: bytes) -> None:
        """An op through a real store (admission, types, causality), then the state served as JSON."""
        store = OpStore(BASE_SCHEMA, lambda *_: True, admission=admission)  # mutated bodies keep their sig
        store.receive(first.wire(), now)
        wire = unpack(data)
        store.receive(wire, now)
        json.dumps(store.values(), allow_nan=False)

    def crdt_body(data: bytes) -> None:
        """A raw op body (the signed bytes) through the store and JSON: state serialisation of any payload."""
        store = OpStore(BASE_SCHEMA, lambda *_: True, admission=admission)
        store.receive(first.wire(), now)
        op = decode_body(data, b"\0" * 64, max_size=store.max_wire_size)
        store.receive_op(op, now)
        json.dumps(store.values(), allow_nan=False)

    sync_store = OpStore(BASE_SCHEMA, lambda *_: True, admission=admission)
    sync_store.receive(first.wire(), now)
    sync_store.receive(kv.wire(), now)

    def crdt_sync(data: bytes) -> None:
        """SYNC / WANT requests answered from a real store, and ENTRIES replies parsed, as the replicator does."""
        body = unpack(data)
        if isinstance(body, dict) and "have" in body:
            answer_want(sync_store, body)
        elif isinstance(body, dict) and "b" in body:
            buckets, theirs, nxt = parse_entries(body)
            sync_store.page_diff(theirs, buckets, None, nxt)
        else:
            answer_sync(sync_store, body)

    record = NodeRecord(ident.peer_id, ("/ip4/127.0.0.1/tcp/4001",), "0.1", ("diloco",), 1.0).to_wire()
    from swarmd.transport._compat import load_hivemind

    hm = load_hivemind()
    DHTRecord, get_dht_time = hm.DHTRecord, hm.get_dht_time
    from swarmd.dht.records import dht_key_id, member_value_ok, owner_tag

    validator = Ed25519RecordValidator(ident, {"swarmd/fuzz/members": member_value_ok})

    def dht_record(data: bytes) -> None:
        NodeRecord.from_wire(unpack_record(data, max_size=8192))

    def dht_entry(data: bytes) -> None:
        """A raw DHT entry [key, subkey, value] through our validator, which must answer, never raise."""
        obj = unpack(data)
        if not isinstance(obj, list) or len(obj) != 3 or not all(isinstance(x, bytes) for x in obj):
            raise ProtocolViolation("not [key, subkey, value]")
        entry = DHTRecord(key=obj[0], subkey=obj[1], value=obj[2], expiration_time=expires)
        if validator.validate(entry) not in (True, False):
            raise AssertionError("validate answered neither True nor False")

    key, subkey, expires = dht_key_id("swarmd/fuzz/members"), owner_tag(ident.peer_id), get_dht_time() + 60
    signed = validator.sign_value(DHTRecord(key, subkey, _pack(record), expires))
    entry_seed = _pack([key, subkey, signed])
    assert validator.validate(DHTRecord(key, subkey, signed, expires))
    gossip_body = _pack([1, "t", ident.peer_id, 1, 0, b"data"])

    ctx = SimpleNamespace(transport=SimpleNamespace(penalties=PeerPenalties()), members=lambda: [ident.peer_id],
                          clock=SYSTEM)
    service = bulk.BulkService(gossip=None)
    service._ctx = ctx
    ts = now
    request = {"hash": bytes(32), "peer": ident.peer_id, "ts": ts,
               "sig": ident.sign(bulk.REQUEST_DOMAIN + bytes(32) + str(ts).encode())}
    announce = {"hash": bytes(32), "size": 10, "codec": "raw", "topic": "diloco/x", "round": 0,
                "fragment": 0, "addrs": ["127.0.0.1:4001"]}

    def bulk_request(data: bytes) -> None:
        service._check(unpack(data))

    def bulk_announcement(data: bytes) -> None:
        bulk.Announcement.parse(_message("bulk", ident.peer_id, data))

    return [
        Target("frame", [encode(1, {"ops": [first.wire()] * 3, "more": False}), encode(2, [{}] * 50_000)],
               lambda b: decode(b, SPEC), (ProtocolViolation,)),
        Target("crdt op", [_pack(first.wire()), _pack(kv.wire()), _pack(base.wire())], crdt_op, (ProtocolViolation,)),
        Target("crdt state", [first.body, kv.body, base.body], crdt_body, (OpError,)),
        Target("crdt sync", [_pack({"d": [[b, d] for b, d in sync_store.digests().items()], "after": None}),
                             _pack({"b": [1, 2], "vv": {ident.peer_id: 2}, "next": [3, ident.peer_id]}),
                             _pack({"have": {ident.peer_id: 0}})],
               crdt_sync, (ProtocolViolation,)),
        Target("dht record", [_pack(record)], dht_record, (ProtocolViolation,)),
        Target("dht entry", [entry_seed], dht_entry, (ProtocolViolation,)),
        Target("gossip message", [_pack({"b": gossip_body, "s": bytes(64)})],
               lambda b: gossip_decode(unpack_record(b, max_size=8 << 20)), (ProtocolViolation,)),
        Target("bulk request", [_pack(request)], bulk_request, (bulk.BulkError, ProtocolViolation)),
        Target("bulk announcement", [WIRE.pack(bulk.ANNOUNCE, announce), WIRE.pack(bulk.HAVE, announce)],
               bulk_announcement, ()),
    ]


def _tensor_target() -> Target:
    import torch

    from swarmd.protocols import codecs

    torch.manual_seed(0)
    seeds = [codecs.encode(torch.randn(300), name) for name in sorted({c.name for c in codecs.CODECS.values()})]
    return Target("tensor codec", seeds, lambda b: codecs.decode(b, max_elements=1 << 20), (codecs.CodecError,))


# ------------------------------------------------------------------ the training loops' messages
def _message(topic: str, author: str, data: bytes):
    from swarmd.protocols.gossip import Message

    return Message(os.urandom(20), topic, author, 1, int(time.time() * 1000), data, b"", b"")


def _loop_targets(ident: Identity, data_dir: Path) -> list[Target]:
    """Each loop's pubsub validator on a real loop object (built-in task), as a node runs it: returns a verdict,
    never raises. DiLoCo's pulls of accepted updates are replaced by a no-op (the pull path is not a decoder)."""
    from swarmd.protocols import bulk, diloco, outer, sapo, spsa
    from swarmd.protocols.gossip import Verdict
    from swarmd.protocols.task import load

    loop = asyncio.new_event_loop()
    peers = [Identity.generate().peer_id for _ in range(3)]
    ctx = SimpleNamespace(identity=ident, data_dir=data_dir, direct=lambda p: True, anchors=lambda: set(peers[:1]),
                          clock=SYSTEM,
                          members=lambda: peers, replicator=None,
                          transport=SimpleNamespace(penalties=PeerPenalties()))
    targets = []

    d_cfg = diloco.DilocoConfig(run="fuzz", task="tinygpt", rounds=8, fragments=2)
    d = diloco.DilocoLoop(None, bulk.BulkService(None), d_cfg, load(d_cfg.task, d_cfg.options(), "diloco"))
    d._ctx = ctx
    d._init_standing(ctx)
    d.state = "running"
    for f in d.fragments:
        f.participants = set(peers)

    async def no_pull(*_a, **_k):
        return None

    d._pull = no_pull
    d._build()  # the model and its global copy: an update for the current round is checked against its hash
    tag = [d.fp["layout"], d.fp["config"]]
    base = outer.params_hash([d.global_flat[1]])
    d_seeds = [WIRE.pack(diloco.READY, {"r": 1, "p": 0, "ready": "h" * 32, "t": tag}),
               WIRE.pack(diloco.JOIN, {"r": 2, "p": 1, "join": True, "t": tag}),
               WIRE.pack(diloco.ROUND_HASH, {"r": 1, "p": 0, "h": "h" * 32, "t": tag}),
               WIRE.pack(diloco.UPDATE, {"r": 1, "p": 1, "parts": [bytes(32), bytes(range(32))], "sizes": [100, 90],
                                         "base": base, "norm": 1.5, "addrs": ["127.0.0.1:4001"], "t": tag}),
               WIRE.pack(diloco.REDUCED, {"r": 1, "p": 1, "red": 3, "blob": bytes(32), "size": 100, "m": "ab" * 8,
                                          "c": b"\x07", "addrs": [], "t": tag}),
               WIRE.pack(diloco.AUDIT, {"r": 1, "p": 0, "aud": 0, "ok": False, "t": tag}),
               WIRE.pack(diloco.MEMBERS, {"r": 1, "p": 0, "m": [bytes(8), b"\x01" * 8], "t": tag}),
               WIRE.pack(diloco.PARTS, {"r": 1, "p": 1, "m": "ab" * 8, "c": [b"\x07", b"\x03"],
                                        "h": [bytes(32), b"\x02" * 32], "t": tag})]

    s_cfg = spsa.SpsaConfig(run="fuzz", task="tinygpt", task_options={"pretrain_steps": 0})
    s = spsa.SPSALoop(None, s_cfg, load(s_cfg.task, s_cfg.options(), "spsa"))
    s._ctx = ctx
    s._init_standing(ctx)
    s.state, s.window = "running", 3
    s_tag = ["layout", "config"]  # s.fp is set when the model is built; until then any well-formed tag matches
    s_seeds = [WIRE.pack(spsa.HASH, {"w": 3, "h": "h" * 32, "t": s_tag}),
               WIRE.pack(spsa.READY, {"w": 3, "ready": "r" * 32, "t": s_tag}),
               WIRE.pack(spsa.JOIN, {"w": 4, "join": True, "t": s_tag}),
               WIRE.pack(spsa.BATCH, {"w": 3, "b": bytes(s_cfg.window), "h": bytes(8), "t": s_tag})]

    a_cfg = sapo.SapoConfig(run="fuzz", task="arith")
    a = sapo.SapoLoop(None, a_cfg, load(a_cfg.task, a_cfg.options(), "sapo"))
    a._ctx = ctx
    a._init_standing(ctx)
    a.state = "running"
    fp = [a.fp["layout"], a.fp["config"]]
    dataset = sorted(a.rules.datasets)[0]
    q_seed = sapo.question_seed(a_cfg.run, a_cfg.seed, peers[1], 2)
    a_seeds = [WIRE.pack(sapo.READY, {"r": 0, "ready": True, "t": fp}),
               WIRE.pack(sapo.ROLLOUTS, {"r": 2, "items": [{"spec": [dataset, q_seed, 0], "comps": ["12", "13"]}],
                                         "t": fp})]

    def validator(obj, topic: str) -> Callable[[bytes], None]:
        rng = random.Random(0)

        def call(data: bytes) -> None:
            async def once():
                verdict = obj._validate(_message(topic, rng.choice(peers), data))
                if asyncio.iscoroutine(verdict):
                    verdict = await verdict
                if not isinstance(verdict, Verdict):
                    raise AssertionError(f"validator answered {verdict!r}")
                await asyncio.sleep(0)  # let any task the validator started run once

            loop.run_until_complete(once())
        return call

    def close() -> None:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()

    targets += [Target("diloco message", d_seeds, validator(d, d.topic), ()),
                Target("spsa message", s_seeds, validator(s, s.topic), ()),
                Target("sapo message", a_seeds, validator(a, a.topic), ())]
    targets[-1].close = close
    return targets


def all_targets(data_dir: Path) -> list[Target]:
    ident = Identity.generate()
    return _wire_targets(ident) + [_tensor_target()] + _loop_targets(ident, data_dir)
