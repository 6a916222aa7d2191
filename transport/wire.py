"""The wire registry: every message swarmd sends, declared once, with its kind, version, schema, size limit and
signing domain.

Two carriers:

- **stream protocols** (``/swarmd/<name>/<version>``, :mod:`transport.framing`): a frame is ``[kind, body]``; each
  (protocol, kind) is declared here, and :class:`transport.base.Stream` checks every frame it reads against its
  declaration (:meth:`Registry.check_frame`) before the handler sees it;
- **pubsub topics** (a loop's ``diloco/<run>``, the bulk announcements' ``swarmd/bulk``): the message is a msgpack
  map that carries its kind and version, ``{"k": kind, "v": version, ...fields}``, built only by :func:`pack` and
  read only by :func:`unpack`, which checks the schema. A kind or version we do not know is :class:`UnknownKind`
  (an older node meeting a newer peer: ignored, not the sender's fault); a known kind that breaks its schema is
  :class:`~transport.errors.MalformedMessage` (the sender's fault).

A wire change is a deliberate act: a new field or meaning is a new version (or kind), and ``tests/test_wire.py``
holds the golden bytes of every declared kind (its ``example``), so an unintended change fails the suite.
``swarmd wire`` prints the table.

Schemas are small and strict (hivemind's rule: no type coercion): :class:`Int`, :class:`Float`, :class:`Str`,
:class:`Bytes`, :class:`Bool`, :class:`Nil`, :class:`List`, :class:`Tuple` (a fixed array), :class:`Dict` (any keys
of one schema), :class:`Map` (exact keys; ``optional`` ones may be missing), :class:`OneOf`, and :func:`ANY` for a
body a handler parses itself (it names where: a signed envelope whose inside is checked after the signature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import ProtocolSpec, encode, unpack


class UnknownKind(Exception):
    """A topic message of a kind or version this node does not know (a newer peer's): ignore it, no penalty."""


# ---------------------------------------------------------------------------------------------------- schemas
class Schema:
    def ok(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Schema):
    lo: int = -(2**63)
    hi: int = 2**64 - 1

    def ok(self, value: Any) -> bool:
        return type(value) is int and self.lo <= value <= self.hi

    def describe(self) -> str:
        return "int" if (self.lo, self.hi) == (-(2**63), 2**64 - 1) else f"int[{self.lo}..{self.hi}]"


@dataclass(frozen=True)
class Float(Schema):
    finite: bool = True

    def ok(self, value: Any) -> bool:
        return type(value) is float and (not self.finite or math.isfinite(value))

    def describe(self) -> str:
        return "float"


@dataclass(frozen=True)
class Str(Schema):
    max: int = 64
    min: int = 0

    def ok(self, value: Any) -> bool:
        return isinstance(value, str) and self.min <= len(value) <= self.max

    def describe(self) -> str:
        return f"str<={self.max}"


@dataclass(frozen=True)
class Bytes(Schema):
    max: int = 64
    exact: int | None = None

    def ok(self, value: Any) -> bool:
        if not isinstance(value, bytes):
            return False
        return len(value) == self.exact if self.exact is not None else len(value) <= self.max

    def describe(self) -> str:
        return f"bytes[{self.exact}]" if self.exact is not None else f"bytes<={self.max}"


@dataclass(frozen=True)
class Bool(Schema):
    only: bool | None = None  # True: the value must be true (a flag)

    def ok(self, value: Any) -> bool:
        return type(value) is bool and (self.only is None or value is self.only)

    def describe(self) -> str:
        return "true" if self.only is True else "bool"


@dataclass(frozen=True)
class Nil(Schema):
    def ok(self, value: Any) -> bool:
        return value is None

    def describe(self) -> str:
        return "nil"


@dataclass(frozen=True)
class List(Schema):
    item: Schema
    max: int
    min: int = 0

    def ok(self, value: Any) -> bool:
        return (isinstance(value, list) and self.min <= len(value) <= self.max
                and all(self.item.ok(x) for x in value))

    def describe(self) -> str:
        return f"[{self.item.describe()}]<={self.max}"


@dataclass(frozen=True)
class Tuple(Schema):
    items: tuple[Schema, ...]

    @classmethod
    def of(cls, *items: Schema) -> Tuple:
        return cls(items)

    def ok(self, value: Any) -> bool:
        return (isinstance(value, list) and len(value) == len(self.items)
                and all(s.ok(x) for s, x in zip(self.items, value)))

    def describe(self) -> str:
        return "[" + ", ".join(s.describe() for s in self.items) + "]"


@dataclass(frozen=True)
class Dict(Schema):
    key: Schema
    value: Schema
    max: int

    def ok(self, value: Any) -> bool:
        return (isinstance(value, dict) and len(value) <= self.max
                and all(self.key.ok(k) and self.value.ok(v) for k, v in value.items()))

    def describe(self) -> str:
        return f"{{{self.key.describe()}: {self.value.describe()}}}<={self.max}"


@dataclass(frozen=True)
class Map(Schema):
    fields: tuple[tuple[str, Schema], ...]
    optional: frozenset[str] = frozenset()

    @classmethod
    def of(cls, optional: tuple[str, ...] = (), **fields: Schema) -> Map:
        return cls(tuple(fields.items()), frozenset(optional))

    def ok(self, value: Any) -> bool:
        if not isinstance(value, dict):
            return False
        names = {name for name, _ in self.fields}
        if not set(value) <= names or not names - self.optional <= set(value):
            return False
        return all(schema.ok(value[name]) for name, schema in self.fields if name in value)

    def describe(self) -> str:
        return "{" + ", ".join(f"{name}{'?' if name in self.optional else ''}: {schema.describe()}"
                               for name, schema in self.fields) + "}"


@dataclass(frozen=True)
class OneOf(Schema):
    options: tuple[Schema, ...]

    def ok(self, value: Any) -> bool:
        return any(s.ok(value) for s in self.options)

    def describe(self) -> str:
        return " | ".join(s.describe() for s in self.options)


@dataclass(frozen=True)
class Anything(Schema):
    checked_by: str  # where the body is parsed (documentation)

    def ok(self, value: Any) -> bool:
        return True

    def describe(self) -> str:
        return f"(parsed by {self.checked_by})"


def ANY(checked_by: str) -> Anything:  # noqa: N802 (reads as a constant in declarations)
    return Anything(checked_by)


# ---------------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Kind:
    name: str  # "crdt.push", "diloco.update": unique
    carrier: str  # a protocol id ("/swarmd/crdt/2.0.0"), a topic ("diloco/<run>") or "(other carrier)"
    code: int  # the frame's kind byte, or a topic message's "k"
    version: int  # a topic message's "v" (stream protocols version in their id)
    schema: Schema  # the body (topic messages: the fields besides k and v)
    example: Any  # a valid body: the golden bytes, the fuzzers' seed
    max_size: int  # bytes of the encoded frame or message
    signed: str | None = None  # the signing domain, for what carries a signature
    doc: str = ""

    @property
    def topic(self) -> bool:
        return not self.carrier.startswith(("/", "("))


class Registry:
    def __init__(self):
        self.kinds: dict[str, Kind] = {}
        self._by_carrier: dict[str, dict[int, Kind]] = {}
        self._specs: dict[str, ProtocolSpec] = {}

    def _add(self, kind: Kind) -> Kind:
        if kind.name in self.kinds:
            raise ValueError(f"wire kind {kind.name!r} declared twice")
        codes = self._by_carrier.setdefault(kind.carrier, {})
        if kind.code in codes:
            raise ValueError(f"{kind.carrier}: kind {kind.code} is both {codes[kind.code].name} and {kind.name}")
        if not 0 <= kind.code <= 0x7F:
            raise ValueError("kinds are 0..127 (one msgpack byte)")
        if not kind.schema.ok(kind.example):
            raise ValueError(f"wire kind {kind.name}: its example does not fit its schema")
        self.kinds[kind.name] = kind
        codes[kind.code] = kind
        return kind

    def frame(self, spec: ProtocolSpec, code: int, name: str, schema: Schema, example: Any, *,
              signed: str | None = None, doc: str = "") -> Kind:
        """Declare kind ``code`` of stream protocol ``spec``."""
        if spec.kinds and code not in spec.kinds:
            raise ValueError(f"{spec.id} does not list kind {code}")
        self._specs[spec.id] = spec
        return self._add(Kind(name, spec.id, code, 1, schema, example, spec.max_frame, signed, doc))

    def message(self, carrier: str, code: int, name: str, schema: Map, example: dict, *, version: int = 1,
                max_size: int = 64 << 10, signed: str | None = None, doc: str = "") -> Kind:
        """Declare a topic message: ``{"k": code, "v": version, **fields}``."""
        if "k" in dict(schema.fields) or "v" in dict(schema.fields):
            raise ValueError("k and v are the registry's")
        return self._add(Kind(name, carrier, code, version, schema, example, max_size, signed, doc))

    def blob(self, carrier: str, name: str, schema: Schema, example: Any, *, max_size: int,
             signed: str | None = None, doc: str = "") -> Kind:
        """Declare a standalone msgpack value on another carrier (a TCP request, a signed record, a log entry)."""
        return self._add(Kind(name, carrier, 0, 1, schema, example, max_size, signed, doc))

    def check_blob(self, kind: Kind, value: Any) -> Any:
        if not kind.schema.ok(value):
            raise MalformedMessage(f"{kind.carrier}: a {kind.name} must be {kind.schema.describe()}")
        return value

    # -------------------------------------------------------------- streams
    def check_frame(self, spec: ProtocolSpec, code: int, body: Any) -> Kind:
        """The declared kind of a frame just decoded; raises MalformedMessage if the body breaks its schema or the
        kind was never declared."""
        kind = self._by_carrier.get(spec.id, {}).get(code)
        if kind is None:
            raise MalformedMessage(f"{spec.id}: kind {code} is not declared")
        if not kind.schema.ok(body):
            raise MalformedMessage(f"{spec.id}: a {kind.name} body must be {kind.schema.describe()}")
        return kind

    def declared(self, spec: ProtocolSpec) -> bool:
        return spec.id in self._by_carrier

    # -------------------------------------------------------------- topics
    def pack(self, kind: Kind, body: dict) -> bytes:
        """A topic message of ``kind``: checked against its schema (our own bug otherwise) and its size limit."""
        if not kind.topic:
            raise ValueError(f"{kind.name} is a stream frame, not a topic message")
        if not kind.schema.ok(body):
            raise ValueError(f"{kind.name}: {body!r:.200} does not fit {kind.schema.describe()}")
        data = msgpack.packb({"k": kind.code, "v": kind.version, **body}, use_bin_type=True)
        if len(data) > kind.max_size:
            raise ValueError(f"{kind.name}: {len(data)} B exceeds its limit of {kind.max_size} B")
        return data

    def unpack(self, carrier: str, data: bytes) -> tuple[Kind, dict]:
        """A topic message's kind and fields. Raises MalformedMessage (undecodable, no kind, a known kind that
        breaks its schema or size) or UnknownKind (a kind or version we do not know)."""
        kinds = self._by_carrier.get(carrier)
        if kinds is None:
            raise ValueError(f"no messages declared for {carrier!r}")
        largest = max(k.max_size for k in kinds.values())
        if len(data) > largest:  # before decoding: no message of this carrier is that large
            raise MalformedMessage(f"{carrier}: a message is at most {largest} B", kind="oversized")
        obj = unpack(data, what=carrier)
        if not isinstance(obj, dict) or type(obj.get("k")) is not int or type(obj.get("v")) is not int:
            raise MalformedMessage(f"{carrier}: a message is a map with an int kind k and version v")
        kind = kinds.get(obj["k"])
        if kind is None or obj["v"] != kind.version:
            raise UnknownKind(f"{carrier}: kind {obj['k']} version {obj['v']}")
        if len(data) > kind.max_size:
            raise MalformedMessage(f"{carrier}: a {kind.name} is at most {kind.max_size} B", kind="oversized")
        del obj["k"], obj["v"]
        if not kind.schema.ok(obj):
            raise MalformedMessage(f"{carrier}: a {kind.name} must be {kind.schema.describe()}")
        return kind, obj

    # -------------------------------------------------------------- golden bytes and the table
    def example_bytes(self, kind: Kind) -> bytes:
        if kind.carrier in self._specs:
            return encode(kind.code, kind.example)
        if kind.code == 0 and kind.carrier.startswith("("):
            return msgpack.packb(kind.example, use_bin_type=True)
        return self.pack(kind, kind.example)

    def table(self) -> list[dict]:
        return [{"name": k.name, "carrier": k.carrier, "kind": k.code, "version": k.version,
                 "max_bytes": k.max_size, "signed": k.signed or "", "schema": k.schema.describe(), "doc": k.doc}
                for k in sorted(self.kinds.values(), key=lambda k: (k.carrier, k.code))]


WIRE = Registry()
