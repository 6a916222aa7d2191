"""SPSA audits across devices: how far an honest peer's losses on other kernels are from ours, against the
allowance the audit gives them (``protocols.spsa.AUDIT_REL``).

An SPSA auditor re-probes a peer's step (the same weights, batch and perturbation) and convicts the peer when its
byte disagrees with the re-probed projected gradient beyond what rounding in the two losses can explain. Peers may
compute on different devices; the weights, the perturbation and every update are CPU fp32 (bit-identical), only
the forward pass runs on each peer's device. This measures, for each built-in SPSA task, along a real SPSA
trajectory (the bytes of one device applied to both copies of the weights, so both stay bit-identical):

- the relative difference of the two devices' losses, |L_a - L_b| / |L| (max and 99th percentile), next to the
  allowance AUDIT_REL;
- the audits an honest peer would fail: a peer on device b sends its byte, an auditor on device a re-probes
  (``audit_agrees``), and the other way round (goal: 0);
- how often the sign is rounding's to decide (|g| within the allowance of 0).

The baseline, in the same run, is the same device twice with other kernels: the CPU with 1 thread against the CPU
with all its threads (what two CPU peers of different core counts compute). Where a CUDA GPU is present, the CPU
against the GPU (fp32, PyTorch's default matmul precision), and the CPU against the GPU with TF32 matmuls allowed
(what a task that calls ``torch.set_float32_matmul_precision("high")`` gets).

And where this CPU has vector kernels (AVX2, AVX-512), the CPU with them against the CPU with torch's plain ones
(``ATEN_CPU_CAPABILITY=default``, which torch reads once at import: that side runs in a child process), what two
CPU peers of different generations compute. That row probes one set of weights (the task's initial ones, passed
to the child in a safetensors file) with each step's batch and perturbation, without the trajectory.

    python bench/bench_audit.py [--steps 200] [--tasks tinygpt digits hf-text regression] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_model, save_model  # noqa: E402

from swarmd.protocols import spsa  # noqa: E402
from swarmd.protocols import task as tasks  # noqa: E402
from swarmd.protocols.spsa import (AUDIT_REL, DEFAULT_TASK_OPTIONS, SpsaConfig, Weights, audit_agrees,  # noqa: E402
                            encode_grad, step_seed)

OPTIONS = {  # the options bench_spsa.py measures learning with (hf-text: its small Llama, last layer perturbed)
    "tinygpt": DEFAULT_TASK_OPTIONS,
    "digits": {},
    "regression": {},
    "hf-text": {"pretrain_steps": 300, "finetune": "tail", "perturb_layers": 1, "batch": 8, "seq_len": 64,
                "eval_batches": 4, "config": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2}},
    # a wider model, every parameter perturbed: longer reductions in every matmul
    "hf-text-wide": {"batch": 4, "seq_len": 64, "eval_batches": 1,
                     "config": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                                "num_attention_heads": 8, "num_key_value_heads": 8}},
}
STEPS_AT_MOST = {"hf-text-wide": 50}  # its 1-thread CPU forward takes ~0.3 s
EPS, CLIP, LR = SpsaConfig().eps, SpsaConfig().clip, SpsaConfig().lr  # the loop's defaults
RUN, AUTHOR = "audit-bench", "12D3KooWAuthor"


class Side:
    """One peer's view: its copy of the model on its device, under its kernel settings."""

    def __init__(self, label: str, task, model: torch.nn.Module, names: list[str], device: str, threads: int,
                 tf32: bool):
        self.label, self.threads, self.tf32 = label, threads, tf32
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device).eval()
        by_name = dict(self.model.named_parameters())
        self.weights = Weights(self.model, [by_name[n] for n in names],
                               loss=lambda batch: tasks.loss_value(task, self.model, tasks.to_device(batch,
                                                                                                     self.device)))

    def losses(self, batch, seed: int) -> tuple[float, float]:
        torch.set_num_threads(self.threads)
        if not self.tf32:
            return self.weights.losses(batch, seed, EPS)  # as the loop computes them: full fp32 (spsa.exact_fp32)
        # what a task that turns TF32 on would get, were the loop not to turn it off: exact_fp32 left out
        with mock.patch.object(spsa, "exact_fp32", lambda: None):
            torch.set_float32_matmul_precision("high")
            try:
                return self.weights.losses(batch, seed, EPS)
            finally:
                torch.set_float32_matmul_precision("highest")


def judged(losses: list[tuple[float, float, float, float]]) -> dict:
    """Each step's losses on the two sides, (L+ a, L- a, L+ b, L- b), against the audit's allowance."""
    rel, used, unjudged, fail_ab, fail_ba = [], [], 0, 0, 0
    for pa, ma, pb, mb in losses:
        scale = max(abs(pa), abs(ma))
        rel.append(max(abs(pa - pb), abs(ma - mb)) / scale)
        ga, gb = (pa - ma) / (2 * EPS), (pb - mb) / (2 * EPS)
        noise = AUDIT_REL * scale / EPS
        used.append(abs(ga - gb) / noise)  # the share of the allowance the two devices' g differ by
        unjudged += abs(ga) <= noise
        fail_ab += not audit_agrees(encode_grad(gb, CLIP), pa, ma, EPS, CLIP)  # b's byte, a audits
        fail_ba += not audit_agrees(encode_grad(ga, CLIP), pb, mb, EPS, CLIP)  # a's byte, b audits
    rel.sort()
    used.sort()
    return {"steps": len(losses), "rel_max": rel[-1], "rel_p99": rel[min(len(rel) - 1, math.ceil(0.99 * len(rel)) - 1)],
            "rel_median": rel[len(rel) // 2], "allowance_used_max": used[-1], "unjudged": unjudged,
            "fail_b_audited_by_a": fail_ab, "fail_a_audited_by_b": fail_ba}


def compare(task, a: Side, b: Side, steps: int) -> dict:
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        batch = task.call("batch_at", 1, 1, step)
        seed = step_seed(RUN, step, AUTHOR)
        pa, ma = a.losses(batch, seed)
        pb, mb = b.losses(batch, seed)
        losses.append((pa, ma, pb, mb))
        byte = {AUTHOR: encode_grad((pa - ma) / (2 * EPS), CLIP)}  # the swarm's update: both copies stay identical
        a.weights.apply(RUN, step, byte, LR)
        b.weights.apply(RUN, step, byte, LR)
        assert a.weights.hash() == b.weights.hash()
    return {**judged(losses), "seconds": time.perf_counter() - t0}


PLAIN_KERNELS = "cpu plain kernels"  # ATEN_CPU_CAPABILITY=default


def probe_losses(name: str, task, model, names: list[str], steps: int) -> list[tuple[float, float]]:
    """L+ and L- of each step's probe at the model's weights as they are (no update applied)."""
    side = Side("b", task, model, names, "cpu", torch.get_num_threads(), False)
    out = []
    for step in range(min(steps, STEPS_AT_MOST.get(name, steps))):
        out.append(side.losses(task.call("batch_at", 1, 1, step), step_seed(RUN, step, AUTHOR)))
    return out


def kernels_row(name: str, task, model, names: list[str], steps: int) -> dict | None:
    """This CPU's vector kernels against torch's plain ones (a child process), at the task's initial weights."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT":
        return None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="swarmd-audit-") as tmp:
        path = Path(tmp) / "weights.safetensors"
        save_model(model, str(path))
        child = subprocess.run([sys.executable, __file__, "--plain-kernels-child", name, str(path), str(steps)],
                               env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}, capture_output=True, text=True,
                               timeout=3600)
    if child.returncode != 0:
        raise RuntimeError(f"the plain-kernels child failed: {child.stderr[-2000:]}")
    got = json.loads(child.stdout.strip().splitlines()[-1])
    if got["capability"] != "DEFAULT":
        raise RuntimeError(f"the child ran {got['capability']} kernels, not the plain ones")
    theirs = [(float.fromhex(p), float.fromhex(m)) for p, m in got["losses"]]
    ours = probe_losses(name, task, model, names, steps)
    row = judged([(pa, ma, pb, mb) for (pa, ma), (pb, mb) in zip(ours, theirs, strict=True)])
    return {**row, "pair": f"cpu {capability} vs {PLAIN_KERNELS}", "seconds": time.perf_counter() - t0}


def build(name: str):
    """The task, its model (seed 1) and the names of the parameters SPSA perturbs."""
    builtin = "hf-text" if name.startswith("hf-text") else name
    task = tasks.load(builtin, OPTIONS[name], tasks.SPSA)
    model = tasks.build_model(task, 1).eval()
    names = [n for n, _ in tasks.trainable(model)]
    if task.has("perturbed"):
        chosen = set(task.call("perturbed", model))
        names = [n for n in names if n in chosen]
    return task, model, names


def plain_kernels_child(name: str, path: str, steps: int) -> None:
    task, model, names = build(name)
    load_model(model, path)
    losses = probe_losses(name, task, model, names, steps)
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                      "losses": [(float(p).hex(), float(m).hex()) for p, m in losses]}))


def pairs(cuda: bool) -> list[tuple[str, tuple, tuple]]:
    threads = torch.get_num_threads()
    out = [(f"cpu 1 thread vs cpu {threads} threads (baseline)", ("cpu", 1, False), ("cpu", threads, False))]
    if cuda:
        out.append(("cpu vs cuda (fp32)", ("cpu", threads, False), ("cuda", threads, False)))
        out.append(("cpu vs cuda, TF32 matmuls", ("cpu", threads, False), ("cuda", threads, True)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tasks", nargs="+", default=["tinygpt", "digits", "regression", "hf-text", "hf-text-wide"])
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--plain-kernels-child", nargs=3, metavar=("TASK", "WEIGHTS", "STEPS"),
                        help=argparse.SUPPRESS)  # the plain-kernels side of kernels_row, in its own process
    args = parser.parse_args()
    if args.plain_kernels_child:
        name, path, steps = args.plain_kernels_child
        plain_kernels_child(name, path, int(steps))
        return
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else "none"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, CUDA GPU: {device_name}; "
          f"allowance AUDIT_REL = {AUDIT_REL:g} of the loss; eps {EPS:g}; {args.steps} steps per row", flush=True)
    rows = []
    for name in args.tasks:
        t0 = time.perf_counter()
        task, model, names = build(name)
        n_params = sum(p.numel() for n, p in model.named_parameters() if n in set(names))
        print(f"{name}: built in {time.perf_counter() - t0:.1f}s, {n_params:,} parameters perturbed", flush=True)
        for label, a, b in pairs(cuda):
            steps = min(args.steps, STEPS_AT_MOST.get(name, args.steps))
            row = compare(task, Side("a", task, model, names, *a), Side("b", task, model, names, *b), steps)
            rows.append({"task": name, "perturbed": n_params, "pair": label, **row})
            print(f"  {label}: {row}", flush=True)
        row = kernels_row(name, task, model, names, args.steps)
        if row is not None:
            rows.append({"task": name, "perturbed": n_params, **row})
            print(f"  {row['pair']}: {row}", flush=True)
    head = (f"{'task':13} | {'perturbed':>10} | {'devices':44} | {'rel diff max':>12} | {'p99':>9} | "
            f"{'x allowance':>11} | {'sign unjudged':>13} | {'honest audits failed':>20}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['task']:13} | {r['perturbed']:>10,} | {r['pair']:44} | {r['rel_max']:12.2e} | {r['rel_p99']:9.2e} | "
              f"{r['allowance_used_max']:11.3f} | {r['unjudged']:>6}/{r['steps']:<6} | "
              f"{r['fail_b_audited_by_a'] + r['fail_a_audited_by_b']:>9}/{2 * r['steps']:<10}")
    print(f"\nrel diff: max over steps of |L_a - L_b| / |L| for L+ and L- (allowance {AUDIT_REL:g}); x allowance: the "
          "largest |g_a - g_b| as a multiple of what the audit allows rounding to move g by (< 1: inside it); "
          "honest audits failed: each step audited both ways (goal 0); plain kernels: torch's own without AVX2 or "
          "AVX-512 (ATEN_CPU_CAPABILITY=default, a child process), at the initial weights, no trajectory")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "torch": torch.__version__, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
