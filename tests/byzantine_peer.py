"""A swarmd node that trains like the others but sends Byzantine contributions to its loops. Run as a script in place
of ``python -m swarmd`` with the behaviour as its first argument:

    python tests/byzantine_peer.py diloco:scale100 start --config ...

It runs the real node and installs a fault plan (protocols/faults.py) on the loops ``swarmd start`` makes
(``node.cli.main(on_loops=...)``): what it sends is altered at the loop's named phases, its code is the honest one.

DiLoCo (its pseudo-gradient, phase ``update``, before it is encoded and announced with the current base's hash):
  ``scale100`` x100; ``noise`` Gaussian noise of the honest update's norm; ``stale`` the update it computed 3 rounds
  before (from an old base); ``same`` the update of its first round, every round; ``nan`` (phase ``encoded``) its
  honest update's parts in the run's codec with NaN in place of every float the codec keeps (its block scales, else
  its values): it announces the honest, finite norm and serves bytes that decode to NaN.
SPSA (its bytes, phase ``code``): ``extreme`` the largest allowed |g| with a random sign at every step; ``random`` a
  random allowed byte at every step; ``noise`` its honest |g| with a random sign (honest-sized noise); ``inverted``
  its honest |g| with the opposite sign (gradient ascent at an honest size).
SAPO (the completions it shares, phase ``share``): ``garbage`` random strings of the task's alphabet; ``wrong`` every
  completion replaced by a well-formed wrong answer (the right answer's length, valid on the wire, scored 0 by the
  verifier).
"""

import dataclasses
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from swarmd.node.cli import main  # noqa: E402
from swarmd.protocols import codecs, sapo, spsa  # noqa: E402
from swarmd.protocols.bulk import content_hash  # noqa: E402
from swarmd.protocols.faults import FaultPlan  # noqa: E402

MODE = sys.argv.pop(1)
LOOP, BEHAVIOUR = MODE.split(":")
rng = random.Random(7)


def diloco_faults(plan: FaultPlan) -> None:
    sent: dict[int, list[torch.Tensor]] = {}  # fragment -> its last 4 honest updates
    first: dict[int, torch.Tensor] = {}  # fragment -> its first round's update

    def update(event, u: torch.Tensor) -> torch.Tensor:
        history = sent.setdefault(event.p, [])
        history.append(u.clone())
        del history[:-4]
        if BEHAVIOUR == "scale100":
            return u * 100
        if BEHAVIOUR == "noise":
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            z = torch.randn(u.numel(), generator=g)
            return z * (u.norm() / z.norm().clamp(min=1e-30))
        if BEHAVIOUR == "stale":  # (a copy: the loop reuses the buffer of the update it sent)
            return history[0].clone() if len(history) == 4 else u
        return first.setdefault(event.p, u.clone()).clone()  # "same"

    def nan_parts(event, prepared: tuple) -> tuple:
        payloads, hashes, mine, norm, base = prepared
        poisoned = []
        for payload in payloads:
            enc = codecs.from_wire(bytes(payload))
            field = "scales" if enc.scales else "data"
            nan = b"\xff" * len(getattr(enc, field))  # a float whose bytes are all 0xff is NaN, in any width
            poisoned.append(bytearray(dataclasses.replace(enc, **{field: nan}).to_wire()))
        return poisoned, [content_hash(x) for x in poisoned], mine, norm, base

    if BEHAVIOUR == "nan":
        plan.alter("encoded", nan_parts)
    elif BEHAVIOUR in ("scale100", "noise", "stale", "same"):
        plan.alter("update", update)
    else:
        raise SystemExit(f"unknown diloco behaviour {BEHAVIOUR!r}")


def spsa_faults(plan: FaultPlan) -> None:
    def code(event, honest: int) -> int:
        cfg = event.loop.cfg
        top = spsa.encode_grad(cfg.clip, cfg.clip) & 0x7F  # the largest |g| a byte may carry
        sign = 0x80 if rng.random() < 0.5 else 0
        if BEHAVIOUR == "noise":
            return honest ^ sign
        if BEHAVIOUR == "inverted":
            return honest ^ 0x80
        if BEHAVIOUR == "extreme":
            return sign | top
        return sign | rng.randrange(top + 1)  # "random"

    if BEHAVIOUR not in ("noise", "inverted", "extreme", "random"):
        raise SystemExit(f"unknown spsa behaviour {BEHAVIOUR!r}")
    plan.alter("code", code)


def sapo_faults(plan: FaultPlan) -> None:
    def wrong(loop, dataset, q_seed, index) -> str:
        """A well-formed wrong answer: as long as the right one, passing the wire rules, scoring 0 with the task's
        own verifier (what a receiver cannot tell from a right one without verifying it)."""
        q = sapo.question(loop.task, dataset, q_seed, index)
        size = len(getattr(q, "answer", "00"))
        for _ in range(100):
            x = "".join(rng.choice("0123456789") for _ in range(size))
            if loop.rules.valid(x) and sapo.reward(loop.task, q, x) == 0.0:
                return x
        raise SystemExit("no wrong answer found")

    def share(event, comps: list[list[str]]) -> list[list[str]]:
        loop = event.loop
        if BEHAVIOUR == "garbage":
            alphabet = "0123456789-+ abcdefghijklmnopqrstuvwxyz"
            comps = [["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in c] for c in comps]
            return [[x if loop.rules.valid(x) else "0" for x in c] for c in comps]
        return [[wrong(loop, d, event.info["q_seed"], k) for _ in c] for (d, k), c in zip(event.info["specs"], comps)]

    if BEHAVIOUR not in ("garbage", "wrong"):
        raise SystemExit(f"unknown sapo behaviour {BEHAVIOUR!r}")
    plan.alter("share", share)


PLANS = {"diloco": diloco_faults, "spsa": spsa_faults, "sapo": sapo_faults}
if LOOP not in PLANS:
    raise SystemExit(f"unknown loop {LOOP!r}")
PLAN = FaultPlan()
PLANS[LOOP](PLAN)


def install(loops: list) -> None:
    for loop in loops:
        if loop.name == LOOP:
            loop.faults = PLAN


main(on_loops=install)
