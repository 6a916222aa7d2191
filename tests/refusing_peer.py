"""A swarmd node whose replicated store refuses every op from the network as stamped in the future, as a node whose
clock runs far behind would (a test seam from outside production code). Run in place of ``python -m swarmd``:

    python tests/refusing_peer.py start --config ...

Its own ops (its identity read from its ``--data-dir``) are taken as usual.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.crdt.store import OpStore  # noqa: E402
from swarmd.transport.identity import Identity  # noqa: E402

DATA_DIR = Path(sys.argv[sys.argv.index("--data-dir") + 1])
DATA_DIR.mkdir(parents=True, exist_ok=True)
ME = Identity.load_or_create(DATA_DIR / "identity.key")[0].peer_id
honest_receive_op = OpStore.receive_op


def refusing_receive_op(self, op, now_ms, *args, **kwargs):
    if op.author == ME:  # its own log
        return honest_receive_op(self, op, now_ms, *args, **kwargs)
    return self._reject("future_clock", op)


OpStore.receive_op = refusing_receive_op

from swarmd.node.cli import main  # noqa: E402

main()
