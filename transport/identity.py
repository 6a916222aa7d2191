"""The node's identity: one Ed25519 key (py-libp2p crypto) that names the peer and signs all it publishes.

The key file is a libp2p protobuf ``PrivateKey`` in go-libp2p's layout (seed || public key, see ``_compat``), so the
same file is read by the p2p daemon and by us, and both derive the same peer id. It is created with mode 0600.

Peer ids of Ed25519 keys are identity multihashes, so anyone can recover the public key from the peer id alone:
:func:`verify` needs nothing but the claimed author's peer id.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from pathlib import Path

from swarmd.transport._compat import install_protobuf_alias, p2pd_ed25519_key_data

install_protobuf_alias()

from libp2p.crypto.ed25519 import Ed25519PrivateKey, Ed25519PublicKey  # noqa: E402
from libp2p.crypto.keys import KeyType  # noqa: E402
from libp2p.crypto.pb import crypto_pb2  # noqa: E402
from libp2p.peer.id import ID  # noqa: E402

from swarmd.transport.errors import IdentityError  # noqa: E402
from swarmd.transport.files import write_durably  # noqa: E402

logger = logging.getLogger(__name__)

SIGNATURE_SIZE = 64


class Identity:
    """An Ed25519 key pair and the peer id derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self._public_key = private_key.get_public_key()
        self._id = ID.from_pubkey(self._public_key)
        self.peer_id: str = self._id.to_base58()
        self.peer_id_bytes: bytes = self._id.to_bytes()

    @classmethod
    def generate(cls, seed: bytes | None = None) -> Identity:
        """A new key; from a 32-byte ``seed`` the same key every time (simulations, tests), else a random one."""
        if seed is not None and len(seed) != 32:
            raise ValueError("an Ed25519 seed is 32 bytes")
        return cls(Ed25519PrivateKey.new(seed))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        """Read a key file. Raises :class:`IdentityError` with a readable message on any problem."""
        path = Path(path)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            raise IdentityError(f"identity file {path} does not exist (create one with `swarmd keygen`)") from None
        except OSError as e:
            raise IdentityError(f"cannot read identity file {path}: {e.strerror}") from None
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("identity file %s has mode %o; it should be readable by its owner only (0600)", path, mode)
        try:
            pb = crypto_pb2.PrivateKey.FromString(blob)
        except Exception:
            raise IdentityError(f"identity file {path} is not a libp2p private key") from None
        if pb.key_type != crypto_pb2.KeyType.Ed25519 or len(pb.data) not in (32, 64):
            raise IdentityError(f"identity file {path} does not hold an Ed25519 key (swarmd needs Ed25519)")
        identity = cls(Ed25519PrivateKey.from_bytes(pb.data[:32]))
        if len(pb.data) == 64 and pb.data[32:] != identity.public_key_bytes:
            raise IdentityError(f"identity file {path} is corrupt: its public key does not match its seed")
        return identity

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write the key file atomically with mode 0600 (never readable by others, not even briefly)."""
        path = Path(path)
        if path.exists() and not overwrite:
            raise IdentityError(f"identity file {path} already exists; refusing to overwrite it")
        write_durably(path, self.to_p2pd_bytes(), mode=0o600)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> tuple[Identity, bool]:
        """Load the key at ``path``, creating it first if there is none. Returns (identity, created)."""
        if Path(path).exists():
            return cls.load(path), False
        identity = cls.generate()
        identity.save(path)
        return identity, True

    def to_p2pd_bytes(self) -> bytes:
        data = p2pd_ed25519_key_data(self._private_key.to_bytes(), self.public_key_bytes)
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=data).SerializeToString()

    @property
    def public_key_bytes(self) -> bytes:
        return self._public_key.to_bytes()

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


@functools.lru_cache(maxsize=4096)
def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 public key inside an identity-multihash peer id. Raises ValueError for anything else.

    Cached: verifying many ops from the same authors otherwise spends a fifth of its time re-parsing keys."""
    try:
        key = ID.from_base58(peer_id).extract_public_key()
    except Exception as e:
        raise ValueError(f"malformed peer id {peer_id[:64]!r}") from e
    if key is None or key.get_type() != KeyType.Ed25519:
        raise ValueError(f"peer id {peer_id[:64]!r} is not an Ed25519 peer id")
    return key


def is_valid_peer_id(peer_id: str) -> bool:
    try:
        public_key_from_peer_id(peer_id)
    except ValueError:
        return False
    return True


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is ``peer_id``'s Ed25519 signature over ``data``. Never raises on bad input."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        return bool(public_key_from_peer_id(peer_id).verify(data, signature))
    except Exception:
        return False
