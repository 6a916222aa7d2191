"""A swarmd node that dies at a chosen point of a DiLoCo run, for the fault tests and the kill bench. Run as a script in
place of ``python -m node`` (a test seam from outside production code): the first argument names the point, the rest
are swarmd's.

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
  reduce       DiLoCo: inside a part reduction (scatter: its update announced, the parts it reduces never come)
  probe        SPSA: after 1..window-1 more steps of a window (its batch of bytes not sent)
  sapo: rollout  SAPO: while it samples and scores its round's completions (its items not shared)
  published    SPSA, SAPO: 0.05-0.5 s after it published its window's bytes / its round's items (the others are
               validating, forwarding and applying or scoring them)
  checkpoint   any loop: inside a checkpoint save, at one of: ``torn`` (half the new file written), ``written``
               (the new file written, not fsync'd or renamed), ``renamed`` (renamed over the old one, the directory
               not fsync'd)
  crdt         any loop: inside a CRDT op-log append (a local write, before it is acknowledged), at one of: ``torn``
               (half the records written), ``unsynced`` (written, not fsync'd), ``synced`` (fsync'd, not
               acknowledged)
"""

import os
import random
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.node import oplog  # noqa: E402
from swarmd.protocols import checkpoint, diloco, exchange, sapo, spsa  # noqa: E402

point = sys.argv.pop(1)
calls = {"reduce": 0}
honest_reduce = exchange.reduce_part
honest_publish = diloco.DilocoLoop._publish


def reduce_part(chunks, factors, size):
    calls["reduce"] += 1
    if point == "reducing" and calls["reduce"] == 3:
        os._exit(137)
    return honest_reduce(chunks, factors, size)


def publish(self, kind, body):
    if point == "published" and kind is diloco.REDUCED and body["r"] >= 1:
        self.bulk.drop([body["blob"]])  # nobody gets it from us
        threading.Timer(0.5, os._exit, (137,)).start()
    return honest_publish(self, kind, body)


exchange.reduce_part = reduce_part
diloco.DilocoLoop._publish = publish

if point.startswith("kill:"):
    parts = point.split(":")[1:]
    loop_name, phase = parts if len(parts) == 2 else ("diloco", parts[0])
    loop_cls = {"diloco": diloco.DilocoLoop, "spsa": spsa.SPSALoop, "sapo": sapo.SapoLoop}[loop_name]
    rng = random.Random()
    armed = {"on": False, "steps": None}

    def die(how: str) -> None:
        print(f"dying_peer: kill at {phase}:{how}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def arm_after(method: str) -> None:
        """Armed once ``method`` (the loop's round close, async) returned once in this life."""
        honest = getattr(loop_cls, method)

        async def closing(self, r, *a, **k):
            out = await honest(self, r, *a, **k)
            if not armed["on"]:
                armed["on"] = True
                print(f"dying_peer: armed at round {r}", flush=True)
            return out

        setattr(loop_cls, method, closing)

    arm_after({"diloco": "_after_round", "spsa": "_close_window", "sapo": "_close_round"}[loop_name])

    if (loop_name, phase) == ("diloco", "inner"):
        honest_inner = diloco.DilocoLoop._inner_step

        def inner_step(self):
            if armed["on"]:
                if armed["steps"] is None:
                    armed["steps"] = rng.randrange(1, self.cfg.inner_steps)
                armed["steps"] -= 1
                if armed["steps"] <= 0:
                    die(f"step {self.step}")
            honest_inner(self)

        diloco.DilocoLoop._inner_step = inner_step
    elif (loop_name, phase) == ("diloco", "travel"):
        def travel_publish(self, kind, body):
            mid = publish(self, kind, body)
            if armed["on"] and kind is diloco.UPDATE:
                threading.Timer(rng.uniform(0.05, 0.5), die, (f"round {body['r']}",)).start()
            return mid

        diloco.DilocoLoop._publish = travel_publish
    elif (loop_name, phase) == ("diloco", "reduce"):
        def reduce_dying(chunks, factors, size):
            if armed["on"]:
                die("reducing")
            return reduce_part(chunks, factors, size)

        exchange.reduce_part = reduce_dying
    elif (loop_name, phase) == ("spsa", "probe"):
        honest_step = spsa.SPSALoop._step

        def step(self, window, i):
            if armed["on"] and window.contribute:
                if armed["steps"] is None:
                    armed["steps"] = rng.randrange(1, self.cfg.window)
                armed["steps"] -= 1
                if armed["steps"] <= 0:
                    die(f"window {window.w} step {i}")
            return honest_step(self, window, i)

        spsa.SPSALoop._step = step
    elif (loop_name, phase) == ("sapo", "rollout"):
        honest_rollouts = sapo.SapoLoop._rollouts

        def rollouts(self, q_seed, specs):
            if armed["on"]:
                die(f"round {self.round}")
            return honest_rollouts(self, q_seed, specs)

        sapo.SapoLoop._rollouts = rollouts
    elif (loop_name, phase) == ("spsa", "published"):
        honest_spsa_publish = spsa.SPSALoop._publish

        def spsa_publish(self, kind, body):
            honest_spsa_publish(self, kind, body)
            if armed["on"] and kind is spsa.BATCH:
                threading.Timer(rng.uniform(0.05, 0.5), die, (f"window {body['w']}",)).start()

        spsa.SPSALoop._publish = spsa_publish
    elif (loop_name, phase) == ("sapo", "published"):
        honest_sapo_publish = sapo.SapoLoop._publish

        def sapo_publish(self, r, q_seed, specs, comps):
            honest_sapo_publish(self, r, q_seed, specs, comps)
            if armed["on"]:
                threading.Timer(rng.uniform(0.05, 0.5), die, (f"round {r}",)).start()

        sapo.SapoLoop._publish = sapo_publish
    elif phase == "checkpoint":
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
    elif phase == "crdt":
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
    else:
        raise SystemExit(f"unknown phase {phase!r} for {loop_name}")

from swarmd.node.cli import main  # noqa: E402

main()
