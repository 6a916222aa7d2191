"""Fuzz every decoder reachable from the network: inputs tried, exceptions outside the declared types, and the
largest allocation and time one input caused, next to the same inputs through plain ``msgpack.unpackb`` (the
baseline: what an unbudgeted decoder would have done with them).

    python bench/bench_fuzz.py              # 10^5 inputs per decoder (issue 14's goal), seeded
    python bench/bench_fuzz.py --n 2000     # a quick look

Inputs: seeded mutations (bit flips, truncations, splices, length-field edits) of valid encodings, plus crafted
bombs (a frame of empty maps, deep nesting, a huge block claim). Goals: 0 undeclared exceptions; the largest
allocation a small multiple of the input's size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from crdt.ops import OpError, decode_wire, make_op  # noqa: E402
from dht.records import NodeRecord  # noqa: E402
from protocols import codecs  # noqa: E402
from protocols.gossip import _decode as gossip_decode  # noqa: E402
from transport.errors import ProtocolViolation  # noqa: E402
from transport.framing import ProtocolSpec, decode, encode, unpack_record  # noqa: E402
from transport.identity import Identity  # noqa: E402

FLOOR = 4096  # inputs smaller than this are measured against it (a few KiB of bookkeeping is no amplification)
SPEC = ProtocolSpec("fuzz", "1.0.0", max_frame=8 << 20, kinds=frozenset({1, 2, 3, 4}))


def seeds() -> dict[str, tuple[list[bytes], callable, tuple]]:
    ident = Identity.generate()
    op = make_op(ident.sign, ident.peer_id, 1, (1, 0), [], "kv", {"k": f"{ident.peer_id}/x", "v": [1, {"a": 2}]})
    record = NodeRecord(ident.peer_id, ("/ip4/127.0.0.1/tcp/4001",), "0.1", ("diloco",), 1.0).to_wire()
    body = msgpack.packb([1, "t", ident.peer_id, 1, 0, b"data"], use_bin_type=True)
    torch.manual_seed(0)
    tensors = [codecs.encode(torch.randn(300), name) for name in sorted({c.name for c in codecs.CODECS.values()})]
    return {
        "frame": ([encode(1, {"ops": [op.wire()] * 3, "more": False, "vv": {ident.peer_id: 1}}),
                   encode(2, [{}] * 50_000)],
                  lambda b: decode(b, SPEC), (ProtocolViolation,)),
        "crdt op": ([msgpack.packb(op.wire())],
                    lambda b: decode_wire(msgpack.unpackb(b, raw=False), max_size=4096), (OpError, ValueError,
                                                                                          msgpack.UnpackException)),
        "dht record": ([msgpack.packb(record)],
                       lambda b: NodeRecord.from_wire(unpack_record(b, max_size=8192)), (ProtocolViolation,)),
        "gossip message": ([msgpack.packb({"b": body, "s": bytes(64)})],
                           lambda b: gossip_decode(unpack_record(b, max_size=8 << 20)), (ProtocolViolation,)),
        "tensor codec": (tensors, lambda b: codecs.decode(b, max_elements=1 << 20), (codecs.CodecError,)),
    }


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif choice < 0.55 and b:
            del b[rng.randrange(len(b)):]
        elif choice < 0.7 and b:
            i = rng.randrange(len(b))
            b[i:i] = os.urandom(rng.randint(1, 16))
        elif choice < 0.85 and b:
            i = rng.randrange(len(b))
            b[i:i + 4] = rng.choice([b"\xdd\xff\xff\xff", b"\xdf\x7f\xff\xff", b"\xc6\xff\xff\xff", b"\xdc\xff\xff"])
        else:
            b += bytes([rng.choice([0x80, 0x90, 0xc0, 0x91])]) * rng.randint(1, 64)
    return bytes(b)


def _peak(call, declared) -> tuple[int, float, str | None]:
    """(bytes allocated at the peak of ``call`` above what was live before it, seconds, undeclared error name)."""
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    error = None
    try:
        call()
    except declared:
        pass
    except Exception as e:  # noqa: BLE001 - counting exactly these is the point
        error = type(e).__name__
    return tracemalloc.get_traced_memory()[1] - before, time.perf_counter() - t0, error


def run(name, inputs, fn, declared, n, rng):
    undeclared, worst_ratio, worst_time, worst_base = {}, 0.0, 0.0, 0.0
    for data in inputs:  # warm up: first-call caches (regexes, imports) are not the input's doing
        try:
            fn(data)
        except Exception:  # noqa: BLE001
            pass
    tracemalloc.start()
    try:
        for i in range(n):
            data = inputs[i % len(inputs)] if i < len(inputs) else mutate(rng, rng.choice(inputs))
            if i % 50 == 0 or i < len(inputs):  # the baseline on a sample: what plain unpackb allocates
                worst_base = max(worst_base, _peak(lambda: msgpack.unpackb(data, raw=False), Exception)[0]
                                 / max(len(data), FLOOR))
            peak, dt, error = _peak(lambda: fn(data), declared)
            if error is not None:
                undeclared[error] = undeclared.get(error, 0) + 1
            worst_ratio = max(worst_ratio, peak / max(len(data), FLOOR))
            worst_time = max(worst_time, dt)
    finally:
        tracemalloc.stop()
    return {"decoder": name, "inputs": n, "undeclared": sum(undeclared.values()), "kinds": undeclared,
            "peak_x_input": worst_ratio, "baseline_x_input": worst_base, "worst_ms": worst_time * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = [run(name, inputs, fn, declared, args.n, rng) for name, (inputs, fn, declared) in seeds().items()]
    print(f"{'decoder':16} | {'inputs':>7} | {'undeclared':>10} | {'peak / input':>12} | "
          f"{'unbudgeted unpackb / input':>26} | {'worst ms':>8}")
    for r in rows:
        print(f"{r['decoder']:16} | {r['inputs']:>7} | {r['undeclared']:>10} | {r['peak_x_input']:>11.1f}x | "
              f"{r['baseline_x_input']:>25.1f}x | {r['worst_ms']:>8.1f}")
        if r["kinds"]:
            print(f"    undeclared: {r['kinds']}")
    print("peak / input: the largest traced allocation one input caused, over max(input size, 4 KiB); the baseline "
          "column is what an unbudgeted msgpack decode of the same inputs allocates (sampled)")
    print("goals: 0 undeclared exceptions; peak allocation a small multiple of the input")


if __name__ == "__main__":
    main()
