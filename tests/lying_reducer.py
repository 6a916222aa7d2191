"""A swarmd node whose DiLoCo reducer lies: every part it reduces is shifted by +0.05 before it is encoded and
published. Run as a script in place of ``python -m swarmd``; it runs the real node with a fault plan on its DiLoCo
loop (the ``reduced`` phase, protocols/faults.py; ``node.cli.main(on_loops=...)``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.node.cli import main  # noqa: E402
from swarmd.protocols.faults import FaultPlan  # noqa: E402

plan = FaultPlan()
plan.alter("reduced", lambda event, part: part + 0.05)


def install(loops: list) -> None:
    for loop in loops:
        if loop.name == "diloco":
            loop.faults = plan


main(on_loops=install)
