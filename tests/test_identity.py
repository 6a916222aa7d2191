import os
import stat

import pytest

from swarmd.transport.errors import IdentityError
from swarmd.transport.identity import Identity, is_valid_peer_id, public_key_from_peer_id, verify

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def test_save_load_roundtrip_keeps_peer_id_and_mode(tmp_path):
    path = tmp_path / "identity.key"
    a = Identity.generate()
    a.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    b = Identity.load(path)
    assert a.peer_id == b.peer_id and a.peer_id.startswith("12D3KooW")
    again, created = Identity.load_or_create(path)
    assert again.peer_id == a.peer_id and not created
    with pytest.raises(IdentityError, match="already exists"):
        Identity.generate().save(path)


def test_load_or_create_creates_once(tmp_path):
    path = tmp_path / "k"
    first, created = Identity.load_or_create(path)
    second, created_again = Identity.load_or_create(path)
    assert created and not created_again and first.peer_id == second.peer_id


def test_sign_and_verify_with_key_from_peer_id():
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    assert verify(ident.peer_id, b"hello", sig)
    assert not verify(ident.peer_id, b"hellO", sig)
    assert not verify(Identity.generate().peer_id, b"hello", sig)
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    assert not verify(ident.peer_id, b"hello", flipped)
    # garbage never raises
    assert not verify("not-a-peer-id", b"x", sig)
    assert not verify(ident.peer_id, b"x", b"short")
    assert not verify(ident.peer_id, b"x", None)
    assert public_key_from_peer_id(ident.peer_id).to_bytes() == ident.public_key_bytes


def test_rsa_style_or_garbage_peer_ids_are_rejected():
    assert not is_valid_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # sha256 multihash, no key inside
    assert not is_valid_peer_id("")
    assert not is_valid_peer_id("12D3KooW" + "1" * 44)


@pytest.mark.parametrize(
    "content, message",
    [(b"", "Ed25519"), (b"\xff\xfe garbage", "not a libp2p private key"), (None, "does not exist")],
)
def test_bad_key_files_give_clear_errors(tmp_path, content, message):
    path = tmp_path / "identity.key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(IdentityError, match=message):
        Identity.load(path)


def test_key_with_mismatched_public_half_is_rejected(tmp_path):
    from libp2p.crypto.pb import crypto_pb2

    a, b = Identity.generate(), Identity.generate()
    data = crypto_pb2.PrivateKey.FromString(a.to_p2pd_bytes()).data[:32] + b.public_key_bytes
    path = tmp_path / "k"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=data).SerializeToString())
    with pytest.raises(IdentityError, match="corrupt"):
        Identity.load(path)
