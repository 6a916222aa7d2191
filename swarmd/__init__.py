"""swarmd: a peer-to-peer daemon for decentralized training, and the library a training script imports.

A training script embeds a node and wraps its own loop::

    import swarmd
    node = swarmd.Node(bootstrap=["/ip4/.../p2p/..."], data_dir="my-node")
    with swarmd.DiLoCo(node, run="my-run", model=model, inner_optimizer=opt, sync_every=50) as run:
        for batch in loader:          # the script's loop, unchanged
            ...

The repository's folders are this package's subpackages (``swarmd.node``, ``swarmd.protocols``, ...). The public
API is the names in ``__all__``; they load on first use, so importing ``swarmd`` (or running the ``swarmd``
command, which imports ``swarmd.node.cli``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from swarmd.node import __version__

# public name -> the module that defines it
_EXPORTS = {
    "Node": "swarmd.embedded",
    "NodeError": "swarmd.embedded",
    "DiLoCo": "swarmd.training",
    "SwarmError": "swarmd.training",
    "TaskRun": "swarmd.training",
    "SPSA": "swarmd.training",
    "SAPO": "swarmd.training",
    "DiLoCoCallback": "swarmd.integrations",
    "DiLoCoLightningCallback": "swarmd.lightning_callback",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
