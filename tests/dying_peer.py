"""A swarmd node that dies (exit 137, no clean-up: what kill -9 leaves) at a chosen point of a DiLoCo exchange, for
the fault tests. Run as a script in place of ``python -m node`` (a test seam from outside production code): the
first argument names the point, the rest are swarmd's.

  reducing   on its third part reduction (its second round): it announced its update, its chunks are served,
             and the parts it reduces never come
  published  just after it published a reduced part (second round), which it never serves: the others know
             where the part is, and pulling it fails
"""

import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocols import diloco, exchange  # noqa: E402

point = sys.argv.pop(1)
calls = {"reduce": 0}
honest_reduce = exchange.reduce_part
honest_publish = diloco.DilocoLoop._publish


def reduce_part(chunks, factors, size):
    calls["reduce"] += 1
    if point == "reducing" and calls["reduce"] == 3:
        os._exit(137)
    return honest_reduce(chunks, factors, size)


def publish(self, body):
    if point == "published" and "red" in body and body["r"] >= 1:
        self.bulk.drop([body["blob"]])  # nobody gets it from us
        threading.Timer(0.5, os._exit, (137,)).start()
    honest_publish(self, body)


exchange.reduce_part = reduce_part
diloco.DilocoLoop._publish = publish

from node.cli import main  # noqa: E402

main()
