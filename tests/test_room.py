"""dht/room.py on hivemind's real DHT storage: the members key's records stay bounded by making room."""

import pytest

from swarmd.dht.records import owner_tag
from swarmd.dht.room import BoundedKey, owner_of
from swarmd.transport._compat import load_hivemind

pytestmark = pytest.mark.beside  # pure computation (tests/conftest.py)


def b58(i: int) -> str:
    """``i`` in characters a peer id may hold (base58 has no 0)."""
    return "".join("123456789A"[int(c)] for c in str(i))


def _storage():
    load_hivemind()
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils.serializer import MSGPackSerializer
    from hivemind.utils.timed_storage import get_dht_time

    return DHTLocalStorage(), DHTID.generate(source="swarmd/x/members"), MSGPackSerializer.dumps, get_dht_time()


@pytest.mark.timeout(60)
def test_strangers_make_room_for_each_other_and_known_peers_keep_their_place():
    storage, key, dumps, now = _storage()
    known = {"12D3KooWKnownA", "12D3KooWKnownB"}
    counters = {}
    room = BoundedKey(storage, key, lambda peer: peer in known, counters, limit=4, max_bytes=1 << 20)
    sub = lambda peer: dumps(owner_tag(peer))  # noqa: E731 - as the DHT protocol stores a subkey
    assert owner_of(sub("12D3KooWKnownA")) == "12D3KooWKnownA"
    assert storage.store_subkey(key, sub("12D3KooWKnownA"), b"a", now + 60)
    for i in range(3):
        assert storage.store_subkey(key, sub(f"12D3KooWStranger{b58(i)}"), b"s", now + 100 + i)
    # full: a stranger evicts the stranger's record that expires first; a known peer too
    assert storage.store_subkey(key, sub("12D3KooWStranger9"), b"s", now + 500)
    assert storage.store_subkey(key, sub("12D3KooWKnownB"), b"b", now + 60)
    held = {owner_of(k) for k in storage.get(key).value.data}
    assert held == {"12D3KooWKnownA", "12D3KooWKnownB", "12D3KooWStranger3", "12D3KooWStranger9"}
    assert counters["members_key_evicted"] == 2
    # a thousand more strangers: never more than 4, the known peers stay, refreshes need no room
    for i in range(1000):
        storage.store_subkey(key, sub(f"12D3KooWFresh{b58(i)}"), b"s", now + 1000 + i)
        assert len(storage.get(key).value) == 4
    assert storage.store_subkey(key, sub("12D3KooWKnownA"), b"a2", now + 120)  # a refresh
    held = {owner_of(k) for k in storage.get(key).value.data}
    assert {"12D3KooWKnownA", "12D3KooWKnownB"} <= held and len(held) == 4 and None not in held
    assert len(room._heap) <= 4 * 4 + 1  # the heap of strangers' records is rebuilt, not grown without end
    # only known peers' records left: a stranger is refused, a known peer still gets in
    known.update(owner_of(k) for k in storage.get(key).value.data)
    assert not storage.store_subkey(key, sub("12D3KooWLate"), b"s", now + 5000)
    assert counters["members_key_refused"] == 1
    known.add("12D3KooWKnownC")
    assert storage.store_subkey(key, sub("12D3KooWKnownC"), b"c", now + 60)
    # other keys are not this key's business
    other = key.generate(source="other")
    assert all(storage.store(other, b"v", now + 60, subkey=dumps(f"k{i}")) for i in range(10))


@pytest.mark.timeout(60)
def test_the_members_key_is_bounded_in_bytes_too():
    storage, key, dumps, now = _storage()
    counters = {}
    BoundedKey(storage, key, lambda peer: False, counters, limit=1000, max_bytes=10_000)
    for i in range(100):
        assert storage.store_subkey(key, dumps(owner_tag(f"12D3KooWPeer{b58(i)}")), bytes(1000), now + 100 + i)
    table = storage.get(key).value
    assert sum(len(item.value) for item in table.data.values()) <= 10_000 and len(table) == 10
    assert counters["members_key_evicted"] == 90
