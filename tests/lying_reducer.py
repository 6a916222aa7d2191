"""A swarmd node whose DiLoCo reducer lies: every part it reduces is shifted by +0.05 before it is encoded and
published. Run as a script in place of ``python -m node`` (a test seam from outside production code)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.protocols import exchange  # noqa: E402

honest = exchange.reduce_part


def lying(chunks, factors, size):
    return honest(chunks, factors, size) + 0.05


exchange.reduce_part = lying

from swarmd.node.cli import main  # noqa: E402

main()
