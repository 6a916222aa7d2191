"""swarmd: a peer-to-peer daemon for decentralized training, and the library a training script imports.

The repository's folders are this package's subpackages (``swarmd.node``, ``swarmd.protocols``, ...). The public
API is the names in ``__all__``; they load on first use, so importing ``swarmd`` (or running the ``swarmd``
command, which imports ``swarmd.node.cli``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS = {
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
