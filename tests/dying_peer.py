"""A swarmd node that dies at a chosen point of a DiLoCo run, for the fault tests and the kill bench. Run as a script in
place of ``python -m swarmd``: the first argument names the point, the rest are swarmd's. It runs the real node and
installs a fault plan (protocols/faults.py) on the loops ``swarmd start`` makes (``node.cli.main(on_loops=...)``):
the loop's phases say when to die; a checkpoint's and an op log's writes, below the loops, are wrapped where they
reach the file system.

The tests' points (exit 137, what kill -9 leaves):

  reducing   on its third part reduction (its second round): it announced its update, its chunks are served,
             and the parts it reduces never come
  published  just after it published a reduced part (second round), which it never serves: the others know
             where the part is, and pulling it fails

The kill bench's points, ``kill:<phase>`` (DiLoCo) or ``kill:<loop>:<phase>`` (``spsa``, ``sapo``;
``bench/bench_chaos.py --part kill``): the process sends itself SIGKILL (kill -9: no clean-up, no flush) at the
first such moment after it closed a round (an SPSA window) with the swarm in this life (it rejoined; it prints
``dying_peer: armed at round N`` then, and ``dying_peer: kill at <phase>:<how>`` just before it dies):

  inner        DiLoCo: after 1..H-1 more inner steps (mid-round, its update not computed)
  travel       DiLoCo: 0.05-0.5 s after it announced its update (the others are pulling its chunks)
  reduce       DiLoCo: as it combines a round's updates (scatter: a part; its update announced, the parts it
               reduces never come)
  probe        SPSA: after 1..window-1 more steps of a window (its batch of bytes not sent)
  sapo: rollout  SAPO: once it sampled and scored its round's completions (its items not shared)
  published    SPSA, SAPO: 0.05-0.5 s after it published its window's bytes / its round's items (the others are
               validating, forwarding and applying or scoring them)
  checkpoint   any loop: inside a checkpoint save, at one of: ``torn`` (half the new file written), ``written``
               (the new file written, not fsync'd or renamed), ``renamed`` (renamed over the old one, the directory
               not fsync'd)
  crdt         any loop: inside a CRDT op-log append (a local write, before it is acknowledged), at one of: ``torn``
               (half the records written), ``unsynced`` (written, not fsync'd), ``synced`` (fsync'd, not
               acknowledged)

``kill_plan`` builds a loop phase's kill into a given plan (tests/test_kill_seams.py runs each in the simulator).
"""

import os
import random
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.node import oplog  # noqa: E402
from swarmd.protocols import checkpoint, diloco, spsa  # noqa: E402
from swarmd.protocols.faults import FaultPlan  # noqa: E402

LOOP_PHASES = {"diloco": ["inner", "travel", "reduce"], "spsa": ["probe", "published"],
               "sapo": ["rollout", "published"]}  # the kill points at a loop's phases (the others: file writes)


def arming(plan: FaultPlan, peer: str | None = None) -> dict:
    """{"on": bool}: on once the loop closed a round (an SPSA window) with the swarm in this life."""
    armed = {"on": False, "steps": None}

    async def arm(event) -> None:
        if not armed["on"]:
            armed["on"] = True
            print(f"dying_peer: armed at round {event.r}", flush=True)
    plan.add("closed", "enter", arm, peer=peer)
    return armed


def kill_plan(plan: FaultPlan, loop: str, phase: str, die: Callable[[str], None],
              later: Callable[[str], None], *, peer: str | None = None, rng: random.Random | None = None) -> dict:
    """Add to ``plan`` the faults of the kill point ``loop``:``phase`` (of ``LOOP_PHASES``): armed once a round (an
    SPSA window) closed in this life, then ``die(how)`` at the phase, or ``later(how)`` (dies 0.05-0.5 s on).
    ``peer``: the peer whose loop dies (None: any loop the plan is on). Returns the arming state."""
    rng = rng or random.Random()
    armed = arming(plan, peer)

    def after_steps(count: int, how: str) -> None:
        if armed["steps"] is None:
            armed["steps"] = rng.randrange(1, count)
        armed["steps"] -= 1
        if armed["steps"] <= 0:
            die(how)

    def on() -> dict:
        return {"peer": peer, "when": lambda e: armed["on"]}

    if (loop, phase) == ("diloco", "inner"):  # mid-round: 1..H-1 more inner steps
        async def step(event) -> None:
            after_steps(event.loop.cfg.inner_steps, f"step {event.info['step']}")
        plan.add("step", "enter", step, **on())
    elif (loop, phase) == ("diloco", "travel"):  # its update announced, its chunks being pulled
        plan.on("publish", lambda e: later(f"round {e.r}"), kind=diloco.UPDATE, **on())
    elif (loop, phase) == ("diloco", "reduce"):
        async def reduce(event) -> None:
            die("reducing")
        plan.add("reduce", "enter", reduce, **on())
    elif (loop, phase) == ("spsa", "probe"):  # 1..window-1 more steps of a window, its batch not sent
        def probe(event, code: int) -> int:
            after_steps(event.loop.cfg.window, f"window {event.r} step {event.info['step'] % event.loop.cfg.window}")
            return code
        plan.alter("code", probe, **on())
    elif (loop, phase) == ("spsa", "published"):
        def batch(event, body: dict) -> dict:
            later(f"window {body['w']}")
            return body
        plan.alter("publish", batch, kind=spsa.BATCH, **on())
    elif (loop, phase) == ("sapo", "rollout"):  # its round's completions made, not shared
        def rollout(event, comps):
            die(f"round {event.r}")
            return comps
        plan.alter("share", rollout, **on())
    elif (loop, phase) == ("sapo", "published"):
        def shared(event, comps):
            later(f"round {event.r}")
            return comps
        plan.alter("share", shared, **on())
    else:
        raise SystemExit(f"unknown phase {phase!r} for {loop}")
    return armed


def wrap_writes(phase: str, armed: dict, die: Callable[[str], None], rng: random.Random) -> None:
    """The kill points below the loops: inside a checkpoint save or a CRDT op-log append, once ``armed``."""
    if phase == "checkpoint":
        how = rng.choice(["torn", "written", "renamed"])
        honest_save_file, honest_replace = checkpoint.save_file, os.replace

        def save_file(tensors, filename, metadata=None):
            honest_save_file(tensors, filename, metadata=metadata)
            if armed["on"] and how in ("torn", "written"):
                if how == "torn":
                    os.truncate(filename, os.path.getsize(filename) // 2)
                die(how)

        def replace(src, dst, *a, **k):
            honest_replace(src, dst, *a, **k)
            if armed["on"] and how == "renamed" and str(dst).endswith(".safetensors"):
                die(how)

        checkpoint.save_file = save_file
        # the rename inside transport.files.replace_durably (before its directory fsync), by way of os itself: the
        # checkpoint module holds no os of its own since its writes went through transport.files (this seam
        # then failed at start, and the kill bench's checkpoint phase with it)
        os.replace = replace
    else:  # "crdt"
        how = rng.choice(["torn", "unsynced", "synced"])
        honest_append = oplog.OpLog.append

        def append(self, wires):
            if not (armed["on"] and wires):
                return honest_append(self, wires)
            if how == "synced":
                honest_append(self, wires)
                die(how)
            blob = b"".join(oplog.HEADER.pack(len(p), oplog.zlib.crc32(p)) + p
                            for p in (oplog.msgpack.packb(w, use_bin_type=True) for w in wires))
            self._file.write(blob if how == "unsynced" else blob[:max(1, len(blob) // 2)])
            self._file.flush()
            die(how)

        oplog.OpLog.append = append


def build(point: str, plan: FaultPlan) -> str:
    """The faults of ``point`` in ``plan``; returns the loop they are for."""
    if point == "reducing":  # the third part reduction
        reductions = {"n": 0}

        async def third(event) -> None:
            reductions["n"] += 1
            if reductions["n"] == 3:
                os._exit(137)
        plan.add("reduce", "enter", third)
        return "diloco"
    if point == "published":  # a reduced part (second round on) nobody gets from us
        def unserved(event) -> None:
            event.loop.bulk.drop([event.info["body"]["blob"]])
            threading.Timer(0.5, os._exit, (137,)).start()
        plan.on("publish", unserved, kind=diloco.REDUCED, when=lambda e: e.r >= 1)
        return "diloco"
    if not point.startswith("kill:"):
        raise SystemExit(f"unknown point {point!r}")
    parts = point.split(":")[1:]
    loop, phase = parts if len(parts) == 2 else ("diloco", parts[0])
    if loop not in LOOP_PHASES:
        raise SystemExit(f"unknown loop {loop!r}")
    rng = random.Random()

    def die(how: str) -> None:
        print(f"dying_peer: kill at {phase}:{how}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def later(how: str) -> None:
        threading.Timer(rng.uniform(0.05, 0.5), die, (how,)).start()

    if phase in ("checkpoint", "crdt"):
        wrap_writes(phase, arming(plan), die, rng)
    else:
        kill_plan(plan, loop, phase, die, later, rng=rng)
    return loop


if __name__ == "__main__":
    from swarmd.node.cli import main

    plan = FaultPlan()
    loop_name = build(sys.argv.pop(1), plan)

    def install(loops: list) -> None:
        for loop in loops:
            if loop.name == loop_name:
                loop.faults = plan

    main(on_loops=install)
