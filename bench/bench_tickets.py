"""What an admission ticket (crdt/admission.py) costs at each bit setting: in Python (the miner every node runs) and
with a native miner of the same construction (bench/ticket_miner.c, compiled here with cc -O3 -march=native), one
core each: four nonces per vector instruction (AVX2's 256 bits) and, where the CPU has AVX-512, eight.

    python bench/bench_tickets.py                 # about a minute on an idle core
    python bench/bench_tickets.py --tries 4000000 # more tries per miner: steadier rates

Each miner mines tickets at 16 bits for about ``--tries`` hashes (its tickets checked against
``Admission.ticket_ok``), timed in CPU seconds (``time.process_time``; the native one reads its own CPU clock), so a
busy machine inflates the numbers less than wall time would. A ticket at b bits takes 2^b tries on average (a
geometric draw: the spread is as large as the mean), so the table gives 2^b / rate: one ticket, and the 20,000 and
100,000 identities of issue 80's lock-out row, in core-seconds (or core-hours) of each miner.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmd.crdt.admission import Admission  # noqa: E402
from swarmd.transport.identity import Identity  # noqa: E402

BITS = (8, 12, 16, 20, 22, 24, 28)
MINER = Path(__file__).with_name("ticket_miner.c")


def python_rate(swarm: str, author: str, tries: int) -> float:
    adm = Admission(swarm, 16)
    done, nonce, started = 0, 0, time.process_time()
    while done < tries:
        found = adm.mint(author, nonce)
        done += found - nonce + 1
        nonce = found + 1
    return done / (time.process_time() - started)


def native_rates(swarm: str, author: str, tries: int) -> dict[int, float]:
    """The native miner's tries/s per core, by lanes (4, and 8 where the CPU has AVX-512); {} without cc."""
    cc = shutil.which("cc")
    if cc is None:
        return {}
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "ticket_miner"
        subprocess.run([cc, "-O3", "-march=native", "-o", str(exe), str(MINER)], check=True)
        avx512 = "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
        for lanes in (4, 8) if avx512 else (4,):
            count = max(1, tries >> 16)
            out = subprocess.run([str(exe), swarm, author, "16", "0", str(count)], check=True, capture_output=True,
                                 text=True, env={**os.environ, "TICKET_MINER_LANES": str(lanes)}).stdout.split("\n")
            adm = Admission(swarm, 16)
            nonces = [int(line.split()[0]) for line in out if line and not line.startswith("total")]
            assert nonces and all(adm.ticket_ok(author, n) for n in nonces), "the native miner's tickets do not check"
            assert nonces[0] == adm.mint(author), "the native miner found another first ticket than Python's"
            total, seconds = next(line for line in out if line.startswith("total")).split()[1:]
            rates[lanes] = int(total) / float(seconds)
    return rates


def human(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=2_000_000, help="hashes per miner (default 2,000,000)")
    args = parser.parse_args()
    swarm, author = "demo-3f1c2a9b7d5e6f80", Identity.generate().peer_id
    py = python_rate(swarm, author, args.tries)
    native = native_rates(swarm, author, args.tries * 4)
    print(f"python: {py / 1e6:.2f} M tries/s per core; "
          + ("; ".join(f"native (cc -O3, {lanes} lanes): {r / 1e6:.2f} M tries/s per core ({r / py:.1f}x)"
                       for lanes, r in native.items()) if native else "native: no cc"))
    heads = ["Python"] + [f"native {lanes} lanes" for lanes in native]
    rates = [py] + list(native.values())
    print("| bits | tries (mean) | " + " | ".join(f"{what}, {h}" for what in ("one ticket", "20,000 ids", "100,000 ids")
                                                for h in heads) + " |")
    print("|---|---|" + "---|" * (3 * len(heads)))
    for bits in BITS:
        n = 2.0 ** bits
        cells = [f"{n:,.0f}"]
        for ids in (1, 20_000, 100_000):
            cells += [human(ids * n / r) for r in rates]
        print(f"| {bits} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
