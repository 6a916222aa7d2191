"""Workarounds for third-party packages, all in one place.

Each workaround here has a test in ``tests/test_compat.py`` that fails if it stops working *or* stops being
needed (so we notice when an upgrade lets us delete it).

1. **protobuf ``crypto.pb`` clash.** hivemind and py-libp2p both register the protobuf package ``crypto.pb``
   (``PublicKey``/``PrivateKey``/``KeyType``) under different file names; whichever is imported second fails with
   ``TypeError: duplicate symbol 'crypto.pb.KeyType'``. py-libp2p's module is a superset, so we alias hivemind's
   module name to it *before* anything from hivemind is imported.
2. **hivemind imports torch at package import.** ``import hivemind.p2p`` runs ``hivemind/__init__.py``, which pulls in
   torch (~1.2 s, ~200 MB RSS) although the P2P and DHT parts never use it. We register light package stubs for
   ``hivemind``, ``hivemind.utils`` and ``hivemind.dht`` so their submodules import without the package ``__init__``s.
3. **py-libp2p's package ``__init__`` loads the whole stack** (trio, aioquic, the transports: ~0.5 s and ~45 MB RSS)
   although identity needs only ``libp2p.crypto`` and ``libp2p.peer.id``. We register a *lazy* ``libp2p`` package
   module: its submodules import without the ``__init__``, and the first attribute looked up on the package itself
   (e.g. ``libp2p.new_host``) runs the real ``__init__`` into it, so a py-libp2p backend still works.
4. **p2pd's Ed25519 key format.** go-libp2p reads Ed25519 private key data as seed(32) || public key(32); py-libp2p
   writes only the 32-byte seed, which p2pd refuses ("expected ed25519 data size to be 64 or 96, got 32").
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Any

_HIVEMIND_CRYPTO_PB2 = "hivemind.proto.crypto_pb2"


class _LazyPackage(types.ModuleType):
    """A package whose ``__init__`` runs only when an attribute of the package itself is first looked up."""

    def __getattr__(self, name: str):
        if name.startswith("__") or self.__dict__.get("_swarmd_initialized"):
            raise AttributeError(name)
        self.__dict__["_swarmd_initialized"] = True
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def _install_lazy_libp2p() -> None:
    """Workaround 3."""
    if "libp2p" in sys.modules:
        return
    spec = importlib.util.find_spec("libp2p")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("py-libp2p is not installed (pip install libp2p==0.8.1)")
    module = _LazyPackage("libp2p")
    module.__spec__ = spec
    module.__file__ = spec.origin
    module.__path__ = list(spec.submodule_search_locations)
    module.__package__ = "libp2p"
    sys.modules["libp2p"] = module


def install_protobuf_alias() -> None:
    """Workaround 1: make ``hivemind.proto.crypto_pb2`` resolve to py-libp2p's ``crypto_pb2``."""
    if _HIVEMIND_CRYPTO_PB2 in sys.modules:
        return
    _install_lazy_libp2p()
    import libp2p.crypto.pb.crypto_pb2 as lp_crypto_pb2

    sys.modules[_HIVEMIND_CRYPTO_PB2] = lp_crypto_pb2


def _install_hivemind_stubs() -> None:
    """Workaround 2: stub the hivemind package ``__init__``s that would import torch."""
    if "hivemind" in sys.modules:
        return  # the real package (or our stubs) is already loaded; nothing to gain
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("hivemind is not installed (pip install hivemind==1.1.12)")
    root = list(spec.submodule_search_locations)[0]

    def stub(name: str, path: str) -> types.ModuleType:
        module = types.ModuleType(name, f"swarmd stub for {name} (see transport/_compat.py)")
        module.__path__ = [path]
        module.__swarmd_stub__ = True
        sys.modules[name] = module
        return module

    stub("hivemind", root)
    utils = stub("hivemind.utils", f"{root}/utils")
    stub("hivemind.dht", f"{root}/dht")
    # names that the P2P/DHT modules import from the ``hivemind.utils`` package itself
    from hivemind.utils.logging import get_logger
    from hivemind.utils.serializer import MSGPackSerializer, SerializerBase
    from hivemind.utils.timed_storage import get_dht_time

    utils.get_logger = get_logger
    utils.MSGPackSerializer = MSGPackSerializer
    utils.SerializerBase = SerializerBase
    utils.get_dht_time = get_dht_time


@dataclass(frozen=True)
class Hivemind:
    """The parts of hivemind that swarmd uses, imported without torch."""

    P2P: Any
    P2PDaemonError: Any
    PeerID: Any
    Multiaddr: Any
    DHTNode: Any
    DHTRecord: Any
    RecordValidatorBase: Any
    get_dht_time: Any
    use_hivemind_log_handler: Any


_hivemind: Hivemind | None = None


def load_hivemind() -> Hivemind:
    """Import hivemind's P2P and DHTNode with workarounds 1 and 2 applied. Idempotent."""
    global _hivemind
    if _hivemind is None:
        install_protobuf_alias()
        _install_hivemind_stubs()
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import DHTRecord, RecordValidatorBase
        from hivemind.p2p.p2p_daemon import P2P
        from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError
        from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
        from hivemind.utils.logging import use_hivemind_log_handler
        from hivemind.utils.multiaddr import Multiaddr
        from hivemind.utils.timed_storage import get_dht_time

        _hivemind = Hivemind(
            P2P=P2P,
            P2PDaemonError=P2PDaemonError,
            PeerID=PeerID,
            Multiaddr=Multiaddr,
            DHTNode=DHTNode,
            DHTRecord=DHTRecord,
            RecordValidatorBase=RecordValidatorBase,
            get_dht_time=get_dht_time,
            use_hivemind_log_handler=use_hivemind_log_handler,
        )
    return _hivemind


def p2pd_ed25519_key_data(seed: bytes, public_key: bytes) -> bytes:
    """Workaround 4: the private key ``data`` field that go-libp2p accepts for Ed25519 (seed || public key)."""
    if len(seed) != 32 or len(public_key) != 32:
        raise ValueError("Ed25519 seed and public key must be 32 bytes each")
    return seed + public_key
