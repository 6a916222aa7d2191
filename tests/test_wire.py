"""The wire registry (transport/wire.py): every message swarmd sends is declared once, and its golden bytes are
fixed here, so a wire change is a deliberate, versioned act.

After a deliberate change (a new kind, or a new version of one), rewrite the fixture and review its diff:

    python tests/test_wire.py --write
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import msgpack
import pytest

from swarmd.node.cli import WIRE_MODULES
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import ProtocolSpec, encode
from swarmd.transport.wire import WIRE, Map, Str, UnknownKind

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "wire.json"
# every module that declares messages, and every module that serves a protocol
MODULES = list(WIRE_MODULES)


def _load() -> None:
    for name in MODULES:
        importlib.import_module(name)


def golden() -> dict:
    _load()
    return {k.name: {"carrier": k.carrier, "kind": k.code, "version": k.version,
                     "hex": WIRE.example_bytes(k).hex()} for k in sorted(WIRE.kinds.values(), key=lambda k: k.name)}


def test_every_kind_has_its_golden_bytes():
    want = json.loads(FIXTURE.read_text())
    have = golden()
    changed = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
    assert not changed, (f"wire kinds added, removed or changed: {changed}. If that is deliberate (a new kind or a "
                         "new version), run `python tests/test_wire.py --write` and review the diff")


def test_every_served_protocol_declares_every_kind():
    _load()
    specs = {id(v): v for name in MODULES for v in vars(importlib.import_module(name)).values()
             if isinstance(v, ProtocolSpec)}
    assert len(specs) >= 10
    for spec in specs.values():
        assert WIRE.declared(spec), spec.id
        for code in spec.kinds:
            WIRE.check_frame(spec, code, [k for k in WIRE.kinds.values()
                                          if k.carrier == spec.id and k.code == code][0].example)


def test_topic_messages_carry_kind_and_version_and_are_checked():
    _load()
    from swarmd.protocols import diloco

    tag = ["a" * 16, "b" * 16]
    data = WIRE.pack(diloco.ROUND_HASH, {"r": 3, "p": 0, "h": "ab" * 16, "t": tag})
    assert msgpack.unpackb(data)["k"] == diloco.ROUND_HASH.code and msgpack.unpackb(data)["v"] == 1
    kind, body = WIRE.unpack(diloco.CARRIER, data)
    assert kind is diloco.ROUND_HASH and body == {"r": 3, "p": 0, "h": "ab" * 16, "t": tag}
    # a newer peer's kind or version: unknown (ignored), not malformed (no penalty)
    for k, v in ((99, 1), (diloco.ROUND_HASH.code, 2)):
        with pytest.raises(UnknownKind):
            WIRE.unpack(diloco.CARRIER, msgpack.packb({"k": k, "v": v, "r": 3}))
    # a known kind that breaks its schema, or no kind at all: malformed (the sender's fault)
    for bad in ({"k": 3, "v": 1, "r": 3, "p": 0, "h": 5, "t": tag}, {"k": 3, "v": 1, "r": -1, "p": 0, "h": "x",
                                                                     "t": tag},
                {"k": 3, "v": 1, "r": 3, "p": 0, "h": "x", "t": tag, "extra": 1}, {"r": 3}, [1, 2]):
        with pytest.raises(MalformedMessage):
            WIRE.unpack(diloco.CARRIER, msgpack.packb(bad))
    with pytest.raises(ValueError):  # our own bug: refused before it leaves
        WIRE.pack(diloco.ROUND_HASH, {"r": 3, "p": 0, "h": 5, "t": tag})
    # larger than any message of the carrier: refused as oversized before decoding (0xc1 is never valid msgpack)
    largest = max(k.max_size for k in WIRE.kinds.values() if k.carrier == diloco.CARRIER)
    with pytest.raises(MalformedMessage) as refused:
        WIRE.unpack(diloco.CARRIER, b"\xc1" * (largest + 1))
    assert refused.value.kind == "oversized"


def test_a_frame_whose_body_breaks_its_schema_is_refused_at_the_stream():
    _load()
    from swarmd.node.crdt_wire import ACK, CRDT_SPEC
    from swarmd.transport.base import _decode

    message, refusal = _decode(encode(ACK, {"applied": 1, "rejected": 0}), CRDT_SPEC)
    assert refusal is None and message.body == {"applied": 1, "rejected": 0}
    message, refusal = _decode(encode(ACK, {"applied": "1", "rejected": 0}), CRDT_SPEC)
    assert message is None and isinstance(refusal, MalformedMessage) and "crdt.ack" in str(refusal)


def test_registry_refuses_duplicates_and_examples_that_do_not_fit():
    from swarmd.transport.wire import Registry

    r = Registry()
    r.message("t/<x>", 1, "t.one", Map.of(a=Str(4)), {"a": "x"})
    with pytest.raises(ValueError):
        r.message("t/<x>", 1, "t.two", Map.of(a=Str(4)), {"a": "x"})
    with pytest.raises(ValueError):
        r.message("t/<x>", 2, "t.one", Map.of(a=Str(4)), {"a": "x"})
    with pytest.raises(ValueError):
        r.message("t/<x>", 3, "t.three", Map.of(a=Str(4)), {"a": "too long"})


def test_swarmd_wire_prints_the_table():
    import subprocess

    # ~3.5 s of CPU (it imports torch) at nice 19 beside the real-time tests: a limit far above that (tests/conftest.py)
    out = subprocess.run([sys.executable, "-m", "swarmd", "wire", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert {r["name"] for r in rows} == set(golden())


if __name__ == "__main__":
    if "--write" in sys.argv:
        sys.path.insert(0, str(ROOT))
        FIXTURE.write_text(json.dumps(golden(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {FIXTURE}")
