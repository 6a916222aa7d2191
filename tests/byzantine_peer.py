"""A swarmd node that trains like the others but sends Byzantine contributions to its loops. Run as a script in place
of ``python -m node`` with the behaviour as its first argument (a test seam from outside production code):

    python tests/byzantine_peer.py diloco:scale100 start --config ...

DiLoCo (its pseudo-gradient, before it is encoded and announced with the current base's hash):
  ``scale100`` x100; ``nan`` NaN and Inf values; ``noise`` Gaussian noise of the honest update's norm; ``stale`` the
  update it computed 3 rounds before (from an old base); ``same`` the update of its first round, every round.
SPSA (its bytes): ``extreme`` the largest allowed |g| with a random sign at every step; ``random`` a random allowed
  byte at every step; ``noise`` its honest |g| with a random sign (honest-sized noise); ``inverted`` its honest |g|
  with the opposite sign (gradient ascent at an honest size).
SAPO (the completions it shares): ``garbage`` random strings of the task's alphabet; ``wrong`` every completion
  replaced by a well-formed wrong answer (the right answer's length, valid on the wire, scored 0 by the verifier).
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from swarmd.protocols import codecs, diloco, sapo, spsa  # noqa: E402

MODE = sys.argv.pop(1)
loop, behaviour = MODE.split(":")
rng = random.Random(7)

if loop == "diloco":
    honest_update = diloco.DilocoLoop._pseudo_gradient
    sent: dict[int, list[torch.Tensor]] = {}

    def byzantine_update(self, p, local):
        u = honest_update(self, p, local)
        history = sent.setdefault(p, [])
        history.append(u.clone())
        del history[:-4]
        if behaviour == "scale100":
            return u * 100
        if behaviour == "nan":
            u = u.clone()
            u[::7] = float("nan")
            u[1::7] = float("inf")
            return u
        if behaviour == "noise":
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            z = torch.randn(u.numel(), generator=g)
            return z * (u.norm() / z.norm().clamp(min=1e-30))
        if behaviour == "stale":
            return history[0] if len(history) == 4 else u
        if behaviour == "same":
            first = sent.setdefault(-1 - p, [u.clone()])
            return first[0]
        raise SystemExit(f"unknown diloco behaviour {behaviour!r}")

    diloco.DilocoLoop._pseudo_gradient = byzantine_update
    if behaviour == "nan":
        # our own codec refuses to encode NaN: this peer's lets them through to the wire, and reads its own update
        # back as finite, so it announces a finite norm and serves bytes that decode to NaN and infinity
        honest_decode = codecs.decode
        codecs._check_finite = lambda x: None
        codecs.decode = lambda *a, **k: torch.nan_to_num(honest_decode(*a, **k), nan=0.0, posinf=0.0, neginf=0.0)
        codecs.NoneCodec.lossless = False  # (with codec none too: the norm measured on what it reads back)

elif loop == "spsa":
    honest_code = spsa.SPSALoop._code

    def byzantine_code(self, g, step):
        if behaviour == "noise":
            return honest_code(self, g, step) ^ (0x80 if rng.random() < 0.5 else 0)
        if behaviour == "inverted":
            return honest_code(self, g, step) ^ 0x80
        if behaviour == "extreme":
            return (0x80 if rng.random() < 0.5 else 0) | self._max_code
        if behaviour == "random":
            return (0x80 if rng.random() < 0.5 else 0) | rng.randrange(self._max_code + 1)
        raise SystemExit(f"unknown spsa behaviour {behaviour!r}")

    spsa.SPSALoop._code = byzantine_code

elif loop == "sapo":
    honest_publish = sapo.SapoLoop._publish

    def wrong(self, dataset, q_seed, index) -> str:
        """A well-formed wrong answer: as long as the right one, passing the wire rules, scoring 0 with the task's
        own verifier (what a receiver cannot tell from a right one without verifying it)."""
        q = sapo.question(self.task, dataset, q_seed, index)
        size = len(getattr(q, "answer", "00"))
        for _ in range(100):
            x = "".join(rng.choice("0123456789") for _ in range(size))
            if self.rules.valid(x) and sapo.reward(self.task, q, x) == 0.0:
                return x
        raise SystemExit("no wrong answer found")

    def byzantine_publish(self, r, q_seed, specs, comps):
        if behaviour == "garbage":
            alphabet = "0123456789-+ abcdefghijklmnopqrstuvwxyz"
            comps = [["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in c]
                     for c in comps]
            comps = [[x if self.rules.valid(x) else "0" for x in c] for c in comps]
        elif behaviour == "wrong":
            comps = [[wrong(self, d, q_seed, k) for _ in c] for (d, k), c in zip(specs, comps)]
        else:
            raise SystemExit(f"unknown sapo behaviour {behaviour!r}")
        honest_publish(self, r, q_seed, specs, comps)

    sapo.SapoLoop._publish = byzantine_publish

else:
    raise SystemExit(f"unknown loop {loop!r}")

from swarmd.node.cli import main  # noqa: E402

main()
