"""Fuzz every decoder reachable from the network or the HTTP endpoint (the targets of ``tests/fuzz_targets.py``,
the same the test suite runs a bounded sample of): inputs tried, exceptions outside the declared types, and the
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
import random
import sys
import time
import tracemalloc
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fuzz_targets import all_targets, mutate  # noqa: E402

FLOOR = 4096  # inputs smaller than this are measured against it (a few KiB of bookkeeping is no amplification)


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


def run(target, n, rng):
    name, inputs, fn, declared = target.name, target.seeds, target.call, target.declared
    undeclared, worst_ratio, worst_time, worst_base, worst_input = {}, 0.0, 0.0, 0.0, (None, b"")
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
            if peak / max(len(data), FLOOR) > worst_ratio:
                worst_ratio, worst_input = peak / max(len(data), FLOOR), (i, data)
            worst_time = max(worst_time, dt)
    finally:
        tracemalloc.stop()
    return {"decoder": name, "inputs": n, "undeclared": sum(undeclared.values()), "kinds": undeclared,
            "peak_x_input": worst_ratio, "worst_input": worst_input, "baseline_x_input": worst_base,
            "worst_ms": worst_time * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", help="run one decoder (its name), e.g. 'sapo message'")
    parser.add_argument("--show-worst", action="store_true", help="print the input that allocated most, per decoder")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        targets = all_targets(Path(tmp))
        try:
            rows = [run(target, args.n, rng) for target in targets if args.only in (None, target.name)]
        finally:
            for target in targets:
                target.close()
    print(f"{'decoder':18} | {'inputs':>7} | {'undeclared':>10} | {'peak / input':>12} | "
          f"{'unbudgeted unpackb / input':>26} | {'worst ms':>8}")
    for r in rows:
        print(f"{r['decoder']:18} | {r['inputs']:>7} | {r['undeclared']:>10} | {r['peak_x_input']:>11.1f}x | "
              f"{r['baseline_x_input']:>25.1f}x | {r['worst_ms']:>8.1f}")
        if args.show_worst:
            print(f"    worst: input #{r['worst_input'][0]}: {r['worst_input'][1][:96].hex()}")
        if r["kinds"]:
            print(f"    undeclared: {r['kinds']}")
    print("peak / input: the largest traced allocation one input caused, over max(input size, 4 KiB); the baseline "
          "column is what an unbudgeted msgpack decode of the same inputs allocates (sampled)")
    print("goals: 0 undeclared exceptions; peak allocation a small multiple of the input")


if __name__ == "__main__":
    main()
