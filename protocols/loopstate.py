"""The state every training loop keeps about its task and run (``protocols.taskloop``), in small holders of one
concern each: where it computes, the run's fingerprints, why it stopped (if it did), its checkpoint, the round
timeline with the peers whose contributions were refused, and the progress writes that wait on their interval."""

from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass, field

import torch

MAX_MISMATCHED = 64  # peers whose mismatching fingerprint we remember
TIMELINE_ROUNDS = 64  # closed rounds kept for the dashboard's round timeline
TIMELINE_PEERS = 64  # peer ids kept per list in one round's record (the counts are always whole)
MAX_OFFENDERS = 64  # peers whose refused contributions /status lists (the most recent offenders are kept)
# our progress register (what every peer's dashboard shows of us) is written at most this often: each write is an
# op every peer verifies, logs (fsync'd) and forwards, and a run's rounds can be a second apart
PROGRESS_EVERY = 5.0
NOT_OFFENCES = frozenset({"base"})  # refusals that are no one's fault (an update from weights we just left)


@dataclass
class Runtime:
    """Where the loop computes: the torch device (picked as the loop starts) and torch's CPU threads
    (``tasks.set_threads``, set as the loop starts)."""

    device: torch.device | None = None
    threads: int | None = None


@dataclass
class Fingerprints:
    """The run's fingerprints (``tasks.fingerprint``), set once the model is built."""

    own: dict | None = None  # {"layout": ..., "config": ...}: on every message, in every checkpoint
    # this run's fingerprints under earlier versions whose checkpoints of it we still resume from (the loop checks
    # what changed: DiLoCo's weights hash)
    earlier: list[dict] = field(default_factory=list)
    # this run's fingerprint without the rules of how its peers compute together (a loop sets it: DiLoCo's reduction
    # rule, outer step, encoder, weights hash), saved in each checkpoint: a later version whose rules changed still
    # resumes its weights (never meets its nodes in a round: the full fingerprint differs)
    resumable: dict | None = None

    def tag(self) -> list[str]:
        """What every loop message carries as its ``"t"``."""
        return [self.own["layout"], self.own["config"]]


@dataclass
class Halt:
    """Why the loop does not train, if it does not: its task failed (``error``, a TaskError: the loop stays failed)
    or the run is refused (``refused``: peers are here, and those whose word counts all train something else; it
    lifts once one trains what we train), and the refusal's evidence: the peers whose messages carried another
    fingerprint, the most recent last."""

    error: str | None = None
    refused: str | None = None
    mismatched: collections.OrderedDict[str, list] = field(default_factory=collections.OrderedDict)
    logged_at: float = 0.0  # the clock's monotonic time of the refusal's last log line (once a minute at most)

    def saw(self, peer: str, tag: list) -> None:
        """``peer`` (one whose word counts) sent ``tag``, not ours."""
        self.mismatched[peer] = tag
        self.mismatched.move_to_end(peer)
        while len(self.mismatched) > MAX_MISMATCHED:
            self.mismatched.popitem(last=False)


@dataclass
class CheckpointRecord:
    """What ``/status`` says of our checkpoint: the last one saved, and the one we resumed from (if any)."""

    saved: dict | None = None
    resumed: dict | None = None


@dataclass
class ProgressWrites:
    """Our progress register's writes (``TaskLoop._write_progress``): at most one every ``every`` seconds."""

    every: float = PROGRESS_EVERY
    at: float = -math.inf  # when we last wrote (the clock's monotonic time)
    waiting: dict | None = None  # the newest progress not written yet
    later: asyncio.Task | None = None  # the write that waits for the interval's end


class RoundTimeline:
    """The closed rounds for the dashboard (the last ``TIMELINE_ROUNDS``), and the peers whose contributions were
    refused: peer -> {reason: count} and the last round it offended in (the transport's penalties ban them; this
    says what they did to this run)."""

    def __init__(self) -> None:
        self.rounds: collections.deque[dict] = collections.deque(maxlen=TIMELINE_ROUNDS)
        self.bytes_at = 0  # the loop's bytes_sent() when the last round was recorded
        self.offenders: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def record(self, r: int, fragment: int | None, closed_at: float, waited_s: float, deadline_s: float,
               participants, missing, rejected: dict, sent: int) -> None:
        self.rounds.append({
            "round": r, "fragment": fragment, "closed_at": round(closed_at, 3),
            "waited_s": round(waited_s, 3), "deadline_s": round(deadline_s, 3),
            "participants": len(participants), "missing": len(missing), "late": 0, "rejected": len(rejected),
            "peers": {"participants": sorted(participants)[:TIMELINE_PEERS],
                      "missing": sorted(missing)[:TIMELINE_PEERS], "late": [],
                      "rejected": dict(sorted(rejected.items())[:TIMELINE_PEERS])},
            "bytes_sent": sent - self.bytes_at,
        })
        self.bytes_at = sent
        for peer, reason in rejected.items():
            if reason not in NOT_OFFENCES:
                self.offended(peer, reason, r)

    def offended(self, peer: str, reason: str, r: int) -> None:
        entry = self.offenders.pop(peer, None) or {"refused": {}, "last_round": r}
        entry["refused"][reason] = entry["refused"].get(reason, 0) + 1
        entry["last_round"] = r
        self.offenders[peer] = entry  # the most recent offender last
        while len(self.offenders) > MAX_OFFENDERS:
            self.offenders.popitem(last=False)

    def late(self, r: int, peer: str, fragment: int | None = None) -> None:
        """A peer's contribution to round r came after we had closed it."""
        for entry in reversed(self.rounds):
            if entry["round"] == r and entry["fragment"] == fragment:
                if peer not in entry["peers"]["late"]:
                    entry["late"] += 1
                    if len(entry["peers"]["late"]) < TIMELINE_PEERS:
                        entry["peers"]["late"].append(peer)
                return

    def offenders_view(self) -> dict:
        """``/status`` -> ``offenders``: the most recent offender first."""
        return {peer: {**e, "refused": dict(e["refused"])} for peer, e in reversed(self.offenders.items())}
