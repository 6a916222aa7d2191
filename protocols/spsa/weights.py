"""The perturbation z drawn the same on every CPU, the canonical float32 weights that probe and apply it, and the
hashes of tensors."""

from __future__ import annotations

import hashlib
import logging
import math
import statistics

import torch

from swarmd.protocols.spsa.audits import AUDIT_REL
from swarmd.protocols.spsa.codes import decode_grad, step_seed

logger = logging.getLogger("swarmd.protocols.spsa")  # one logger for the package


_fp32_said = False


def exact_fp32() -> None:
    """Float32 matmuls and cuDNN convolutions in full precision (no TF32) from here on, whatever a task set: an
    auditor compares our losses with its own, computed on another device, within AUDIT_REL. On an H200
    (``docs/benchmarks/audit.md``): fp32 on the GPU is within 2.6e-7 of the CPU, TF32 matmuls up to 4.6e-5 (an
    honest peer fails about 1 audit in 400); PyTorch turns TF32 on for convolutions by default. Process-wide: every
    loop of a node that runs SPSA computes float32 without TF32. (The legacy flags: reading them raises once the newer
    per-backend ``fp32_precision`` API has set them inconsistently.)"""
    global _fp32_said
    try:
        tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cudnn.allow_tf32
    except RuntimeError:  # flags set through both APIs: set them again below
        tf32 = True
    if not tf32:
        return
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not _fp32_said:
        _fp32_said = True
        logger.info("spsa: float32 matmuls and convolutions run without TF32 in this process (audits compare our "
                    "losses with other devices' within %g)", AUDIT_REL)


# z: each value a draw of Z_BITS bits from the seeded CPU generator (torch.randint: integer arithmetic, the same
# on every CPU) looked up in a table of the standard normal's quantiles at the midpoints of 2^Z_BITS bins of equal
# probability (float32; symmetric, |z| <= 4.325, variance 0.99998). torch.randn draws other low bits with torch's
# scalar kernels (a CPU without AVX2) than with its AVX2 ones (38% of 100,000 values), so peers on other CPUs
# would apply other perturbations; this is the same bits everywhere, and costs what randn does
Z_BITS = 16


def _normal_quantiles(bits: int) -> torch.Tensor:
    n = 1 << bits
    normal = statistics.NormalDist()
    return torch.tensor([normal.inv_cdf((i + 0.5) / n) for i in range(n)], dtype=torch.float32)


NORMAL_TABLE = _normal_quantiles(Z_BITS)
# how z is drawn and how a step applies it, with the table's hash (a platform whose libm rounded a quantile
# otherwise would hash otherwise): the weights' bits depend on both, so they are part of a run's fingerprint
# (SpsaConfig.shared) and peers of versions that draw or step otherwise never meet in one run
PERTURBATION = (f"z = table[randint(0, 2^{Z_BITS}, int32)] per parameter in order from one seeded CPU generator, "
                f"table[i] = float32(inv_cdf((i + 1/2) / 2^{Z_BITS})) blake2b-64 "
                f"{hashlib.blake2b(NORMAL_TABLE.numpy().tobytes(), digest_size=8).hexdigest()}; a step adds "
                "coeff x z, the product and the sum each rounded on its own (1)")

DRAW_CHUNK = 1 << 20  # values whose indices are drawn at a time (a 4 MB buffer; the same draws as all at once)


def _perturbation_flat(numel: int, seed: int) -> torch.Tensor:
    """The first ``numel`` values of the perturbation of ``seed``, as one flat tensor."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.empty(numel, dtype=torch.float32)
    index = torch.empty(min(DRAW_CHUNK, numel), dtype=torch.int32)
    for start in range(0, numel, DRAW_CHUNK):
        end = min(start + DRAW_CHUNK, numel)
        drawn = torch.randint(0, 1 << Z_BITS, (end - start,), generator=g, dtype=torch.int32,
                              out=index[:end - start])
        torch.index_select(NORMAL_TABLE, 0, drawn, out=z[start:end])
    return z


def perturbation(shapes: list[torch.Size], seed: int) -> list[torch.Tensor]:
    """The perturbation of a probe's seed, one tensor per shape in order (views of one new flat tensor)."""
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(_perturbation_flat(sum(sizes), seed).split(sizes), shapes)]


class Weights:
    """Canonical fp32 weights of the perturbed parameters of a model, and the loss that probes them."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter] | None = None, loss=None):
        self.model = model
        self.params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
        self.canonical = [p.detach().to("cpu", torch.float32).clone() for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.loss = loss if loss is not None else model.loss

    @torch.no_grad()
    def _load(self, offset: list[torch.Tensor] | None, scale: float) -> None:
        for p, c, z in zip(self.params, self.canonical, offset or [None] * len(self.params)):
            value = c if z is None else c + scale * z
            p.copy_(value)  # to the parameter's device and dtype

    @torch.no_grad()
    def probe(self, batch, seed: int, eps: float) -> float:
        plus, minus = self.losses(batch, seed, eps)
        return (plus - minus) / (2 * eps)

    @torch.no_grad()
    def losses(self, batch, seed: int, eps: float) -> tuple[float, float]:
        """L+ and L- of a probe (the weights restored after, bit-exact), in full float32 precision."""
        exact_fp32()
        z = perturbation(self.shapes, seed)
        self._load(z, eps)
        plus = float(self.loss(batch))
        self._load(z, -eps)
        minus = float(self.loss(batch))
        self._load(None, 0.0)  # restore by copy: bit-exact
        return plus, minus

    @torch.no_grad()
    def apply(self, run: str, step: int, updates: dict[str, int], lr: float) -> None:
        """Apply every peer's byte for ``step`` in canonical order."""
        if not updates:
            return
        m = len(updates)
        sizes = [c.numel() for c in self.canonical]
        for peer_id in sorted(updates):
            coeff = -lr / m * decode_grad(updates[peer_id])
            # a product, then a sum: add(alpha=) is one fused multiply-add in torch's AVX2 and AVX-512 kernels and
            # two roundings in its scalar ones, so the weights' bits would depend on the CPU
            step_z = _perturbation_flat(sum(sizes), step_seed(run, step, peer_id)).mul_(coeff)
            for c, z in zip(self.canonical, step_z.split(sizes)):
                c.add_(z.view(c.shape))
        self._load(None, 0.0)

    def hash(self) -> str:
        return tensors_hash(self.canonical)


def tensors_hash(tensors: list[torch.Tensor]) -> str:
    """The hash of float32 CPU tensors (a Weights' canonical ones, or a base's): their bytes in order."""
    return base_digest([_bytes_of(c) for c in tensors])


def _bytes_of(t: torch.Tensor):
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()


def base_digest(arrays: list) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(a)
    return h.hexdigest()
