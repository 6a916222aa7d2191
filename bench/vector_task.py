"""A task whose model is one parameter vector of ``size`` values, for the exchange benchmark: with the ``none``
codec an update is exactly 4 x size bytes (plus a few bytes of header per part), and an inner step costs O(size),
so a round's time is the exchange's."""

import os
import time
from pathlib import Path

import torch


class VectorTask:
    def __init__(self, size: int):
        self.size = size

    def model(self) -> torch.nn.Module:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(self.size))
        return model

    def data(self, shard: int, seed: int):
        """A different direction per peer and step, so every part of every update has its own bytes: the peer's
        own random vector, rotated by another offset at each step (a view, no copy; drawing ``size``
        fresh normal values each step took 150 ms of CPU for 25 MB, more than a round's exchange costs a peer, on
        the cores the exchange shares)."""
        g = torch.Generator().manual_seed(seed * 1000 + shard)
        base = torch.randn(self.size, generator=g)
        n = self.size
        twice = torch.cat([base, base])
        step = 0
        while True:
            step += 1
            # torch.roll(base, k) as a view of the vector twice over, no copy: a new 4 x size-byte tensor a step
            # would be page faults, and a copy a pass over it, that the exchange's rounds pay for on the cores they
            # share
            k = step * 7919 % n
            yield twice[n - k:2 * n - k]

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        # mean(w * batch) without its product the size of the vector: the same value and the same gradient
        return torch.dot(model.w, batch) / self.size


class SgdVectorTask(VectorTask):
    """The same, trained by plain SGD (no optimizer state): what fits is then the exchange's memory, not AdamW's."""

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-3)


class TogetherVectorTask(SgdVectorTask):
    """Plain SGD, and after each inner step a barrier among the run's ``peers`` nodes (files in the directory
    ``together``, which they share on this machine): every peer's update starts on its way at the same moment, as
    hivemind's averagers trigger their all-reduce together after a barrier in the benchmark. Each node writes when
    it reached the barrier (``time.monotonic``, one clock for every process on this machine), so the bench reads a
    round's period, from the last peer ready to the last peer ready again, out of the files (``periods``). It also
    writes when it starts its next inner step (the round's exchange and outer step done), so the bench reads the
    exchange alone too, from the last peer ready to the last peer done with the round (``windows``): the part of
    a period that hivemind's timing, from its trigger to its all-reduce's end, has a counterpart of."""

    def __init__(self, size: int, together: str, peers: int):
        super().__init__(size)
        self.dir, self.peers, self.steps = Path(together), peers, 0

    def data(self, shard: int, seed: int):
        batches = super().data(shard, seed)
        while True:
            # (when the loop asks for a step's batch: the step begins, the round before it is over)
            if self.steps:
                tmp = self.dir / f".s{self.steps:06d}.{os.getpid()}"
                tmp.write_text(repr(time.monotonic()))
                tmp.rename(self.dir / f"s{self.steps:06d}.{os.getpid()}")
            yield next(batches)

    def optimizer(self, params) -> torch.optim.Optimizer:
        opt = super().optimizer(params)
        opt.register_step_post_hook(lambda *_: self._barrier())
        return opt

    def _barrier(self) -> None:
        """(In the node's worker thread: its event loop serves the others meanwhile.) A blocking wait, as
        hivemind's averagers' ``multiprocessing.Barrier``: no polling. Under a file lock each node opens the step's
        FIFO (read-write, which never blocks on Linux) and counts the arrivals; the last to arrive writes one byte
        for each of the others, each of which blocks reading its byte (every waiter holds the FIFO open before the
        last one counts it, so no byte is lost). Polling a release file every millisecond instead would wake up to
        7 processes 1000 times a second each, on the cores the exchange shares. Up to
        60 s: a node that skips a step (a resync) must not hang the others; ``periods`` leaves out a step that not
        every node reached."""
        import fcntl
        import select

        now = repr(time.monotonic())
        with open(self.dir / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            # a node that skipped an inner step (it joined from a peer's checkpoint) counts one step fewer than
            # the others: it joins the step they wait at, not one they passed (else they wait out the timeout
            # at every step, and it at every round: 60 s a round)
            names = os.listdir(self.dir)
            self.steps = max([self.steps + 1] + [int(name.split(".")[0]) for name in names if name[:1].isdigit()])
            step = f"{self.steps:06d}"
            tmp = self.dir / f".{step}.{os.getpid()}"
            tmp.write_text(now)
            fifo = self.dir / f".go.{step}"
            if not fifo.exists():
                os.mkfifo(fifo)
            fd = os.open(fifo, os.O_RDWR)
            tmp.rename(self.dir / f"{step}.{os.getpid()}")
            last = sum(1 for name in names if name.startswith(step + ".")) + 1 >= self.peers
            if last:
                os.write(fd, b"x" * (self.peers - 1))
        try:
            if not last and select.select([fd], [], [], 60.0)[0]:
                os.read(fd, 1)
        finally:
            os.close(fd)


def periods(together: str, peers: int) -> list[float]:
    """Each round's period from the files of ``TogetherVectorTask``: from the moment the last of the peers was ready
    with its update (trained) to the moment the last was ready with the next one: the exchange, the outer step
    and one (SGD) inner step of every peer, the slowest peer's."""
    ready: dict[int, list[float]] = {}
    for f in Path(together).glob("[0-9]*.*"):
        ready.setdefault(int(f.name.split(".")[0]), []).append(float(f.read_text()))
    steps = sorted(k for k, v in ready.items() if len(v) == peers)
    return [max(ready[b]) - max(ready[a]) for a, b in zip(steps, steps[1:]) if b == a + 1]


def windows(together: str, peers: int) -> list[float]:
    """Each round's exchange from the files of ``TogetherVectorTask``: from the moment the last of the peers was
    ready with its update (trained) to the moment the last began its next inner step: our update's preparation,
    the exchange and the outer step, the slowest peer's; a period less the inner step and the barrier."""
    ready: dict[int, list[float]] = {}
    began: dict[int, list[float]] = {}
    for f in Path(together).glob("[0-9s]*.*"):
        into = began if f.name.startswith("s") else ready
        into.setdefault(int(f.name.lstrip("s").split(".")[0]), []).append(float(f.read_text()))
    return [max(began[k]) - max(ready[k]) for k in sorted(ready)
            if len(ready[k]) == peers and len(began.get(k, ())) == peers]


def make_task(size: int = 1_000_000, sgd: bool = False, together: str = "", peers: int = 0) -> VectorTask:
    if together:
        return TogetherVectorTask(size, together, peers)
    return SgdVectorTask(size) if sgd else VectorTask(size)
