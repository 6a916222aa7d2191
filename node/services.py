"""What a pluggable service (the gossip layer, training loops) gets from the node, and what it gives back.

``protocols/`` is written against this module only: the node hands each service a :class:`NodeContext` and runs
its ``run()`` in the node's task group (restarted with backoff if it crashes); ``status()`` appears under
``/status`` -> ``services`` and ``routes()`` are added to the local HTTP endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from transport.base import Transport
from transport.identity import Identity


@dataclass
class NodeContext:
    identity: Identity
    transport: Transport
    data_dir: Path
    members: Callable[[], list[str]]  # connected peers that are swarm members
    replicator: Any  # node.replication.Replicator: write_many(), store (read the merged state)
    direct: Callable[[str], bool]  # True if our connection to the peer is direct (not through a relay)
    punched: Callable[[str], bool] = lambda peer: False  # True if that direct connection was hole-punched
    anchors: Callable[[], set[str]] = set  # peers the user chose to trust (the bootstrap peers' ids)


class Service(Protocol):
    name: str

    async def start(self, ctx: NodeContext) -> None: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict: ...

    def routes(self) -> list:  # aiohttp RouteDef list
        ...
