"""Signed records: the DHT validator (unit and against real DHT nodes), envelopes, node records."""

import dataclasses

import msgpack

import pytest

from swarmd.dht.records import (
    Ed25519RecordValidator,
    NodeRecord,
    dht_key_id,
    member_value_ok,
    open_envelope,
    owner_tag,
    seal,
)
from swarmd.transport._compat import load_hivemind
from swarmd.transport.errors import BadSignature, FrameTooLarge, MalformedMessage
from swarmd.transport.identity import Identity

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)

hm = load_hivemind()
KEY = "swarmd/test/members"


def record(identity, value=b"\x81\xa1a\x01", subkey=None, key=KEY, expiration=None):
    from hivemind.utils.serializer import MSGPackSerializer

    expiration = hm.get_dht_time() + 60 if expiration is None else expiration
    sub = MSGPackSerializer.dumps(subkey if subkey is not None else owner_tag(identity.peer_id))
    return hm.DHTRecord(dht_key_id(key), sub, value, expiration)


def test_owner_signed_record_validates_and_strips():
    alice = Identity.generate()
    v = Ed25519RecordValidator(alice, protected_keys=[KEY])
    rec = record(alice)
    signed = dataclasses.replace(rec, value=v.sign_value(rec))
    assert signed.value != rec.value
    assert v.validate(signed)
    assert v.strip_value(signed) == rec.value
    # any other node's validator accepts it too (the key comes from the peer id)
    assert Ed25519RecordValidator(Identity.generate(), protected_keys=[KEY]).validate(signed)


def test_forged_altered_unsigned_and_replayed_records_are_rejected():
    alice, mallory = Identity.generate(), Identity.generate()
    v_alice = Ed25519RecordValidator(alice, protected_keys=[KEY])
    v_mallory = Ed25519RecordValidator(mallory, protected_keys=[KEY])
    checker = Ed25519RecordValidator(Identity.generate(), protected_keys=[KEY])

    rec = record(alice)
    good = dataclasses.replace(rec, value=v_alice.sign_value(rec))
    # mallory cannot sign in alice's name: her validator does not sign records she does not own
    assert v_mallory.sign_value(rec) == rec.value and not checker.validate(rec)
    # a signature by mallory over alice's slot
    forged_sig = dataclasses.replace(rec, value=v_mallory.sign_value(record(mallory, value=rec.value))[len(rec.value):])
    assert not checker.validate(dataclasses.replace(rec, value=rec.value + forged_sig.value))
    # altered value, altered expiration (replay with a longer life), moved to another key
    assert not checker.validate(dataclasses.replace(good, value=b"\x00" + good.value))
    assert not checker.validate(dataclasses.replace(good, expiration_time=good.expiration_time + 1))
    assert not checker.validate(dataclasses.replace(good, key=dht_key_id("swarmd/other/members")))
    # two owners in one subkey
    both = record(alice, subkey=owner_tag(alice.peer_id) + owner_tag(mallory.peer_id))
    assert not checker.validate(dataclasses.replace(both, value=v_alice.sign_value(both)))
    # keys that are not ours are refused (issue 14 item 2: 8,000 records with a 31-year expiry: +69 MB), and the
    # protected key refuses unsigned records
    assert not checker.validate(record(alice, subkey=b"plain", key="somewhere/else"))
    other = record(alice, key="somewhere/else")
    assert not checker.validate(dataclasses.replace(other, value=v_alice.sign_value(other)))
    assert not checker.validate(record(alice, subkey=b"plain"))
    assert checker.refused["foreign_key"] == 3 and checker.refused["unsigned"] >= 1
    # oversized
    big = record(alice, value=b"x" * 20000)
    assert not checker.validate(dataclasses.replace(big, value=v_alice.sign_value(big)))


def test_member_entries_must_be_one_record_about_their_signer_with_a_bounded_expiry():
    # issue 14 item 2: one signed entry whose value was not a record made hivemind's search raise and every
    # member poll hang
    from hivemind.utils.serializer import MSGPackSerializer

    alice, bob = Identity.generate(), Identity.generate()
    own = Ed25519RecordValidator(alice, {KEY: member_value_ok})
    checker = Ed25519RecordValidator(Identity.generate(), {KEY: member_value_ok}, max_ttl=600)
    now = hm.get_dht_time()

    def signed(value_bytes, expiration=now + 60, who=alice):
        rec = record(who, value=value_bytes, expiration=expiration)
        return dataclasses.replace(rec, value=Ed25519RecordValidator(who, [KEY]).sign_value(rec))

    mine = NodeRecord(alice.peer_id, ("/ip4/127.0.0.1/tcp/1",), "0.1", (), 1.0)
    about_bob = NodeRecord(bob.peer_id, (), "0.1", (), 1.0)
    assert checker.validate(signed(MSGPackSerializer.dumps(mine.to_wire())))
    assert own.validate(signed(MSGPackSerializer.dumps(mine.to_wire())))
    for bad, reason in [
        (signed(b"\xc1"), "malformed"),  # not msgpack at all
        (signed(MSGPackSerializer.dumps(12345)), "malformed"),  # not a record
        (signed(MSGPackSerializer.dumps(about_bob.to_wire())), "malformed"),  # a record about someone else
        (signed(MSGPackSerializer.dumps([{}] * 3000)), "malformed"),  # a container bomb
        (signed(MSGPackSerializer.dumps(mine.to_wire()), expiration=now + 31 * 365 * 86400), "expiry_too_far"),
    ]:
        before = checker.refused[reason]
        assert not checker.validate(bad)
        assert checker.refused[reason] == before + 1, reason


def test_a_record_accepted_once_is_known_again_but_any_changed_byte_is_checked_in_full():
    """Every member poll returns every member's record: the validator remembers the ones it accepted (a bounded
    number), keyed by every byte the signature and the value check read, and still redoes the time-bound check."""
    from hivemind.utils.serializer import MSGPackSerializer

    alice, mallory = Identity.generate(), Identity.generate()
    now = hm.get_dht_time()

    def signed(who=alice, issued=1.0, expiration=now + 60):
        value = MSGPackSerializer.dumps(NodeRecord(who.peer_id, ("/ip4/127.0.0.1/tcp/1",), "0.1", (), issued).to_wire())
        rec = record(who, value=value, expiration=expiration)
        return dataclasses.replace(rec, value=Ed25519RecordValidator(who, [KEY]).sign_value(rec))

    checker = Ed25519RecordValidator(Identity.generate(), {KEY: member_value_ok}, remember=2)
    good = signed()
    assert checker.validate(good) and checker.validate(good)
    assert checker.checks == {"verified": 1, "remembered": 1}

    # one changed byte anywhere the signature covers, or another signature over the same bytes: checked in full
    sig_at = len(good.value) - 2
    other_sig = good.value[:sig_at - 10] + (b"B" if good.value[sig_at - 10:sig_at - 9] != b"B" else b"C") + \
        good.value[sig_at - 9:]
    for changed, accepted in [
        (dataclasses.replace(good, expiration_time=good.expiration_time + 1), False),  # signed over the old expiry
        (dataclasses.replace(good, value=b"\x00" + good.value[1:]), False),
        (dataclasses.replace(good, value=other_sig), False),
        (signed(issued=2.0), True),
    ]:
        before = checker.checks["verified"]
        assert checker.validate(changed) is accepted
        assert checker.checks["verified"] == before + 1
    assert checker.refused["bad_signature"] == 3
    for _ in range(3):  # refused records are never remembered: each is checked again
        assert not checker.validate(dataclasses.replace(good, value=other_sig))
    assert checker.refused["bad_signature"] == 6

    # mallory re-signs alice's exact value under her own subkey: a new record, checked, refused as not about her
    stolen = record(mallory, value=Ed25519RecordValidator(alice, [KEY]).strip_value(good), expiration=now + 60)
    stolen = dataclasses.replace(stolen, value=Ed25519RecordValidator(mallory, [KEY]).sign_value(stolen))
    assert not checker.validate(stolen) and checker.refused["malformed"] == 1

    # the time bound is not remembered: a record known as good is refused once its expiry is too far ahead
    checker.max_ttl = 10
    assert not checker.validate(good) and checker.refused["expiry_too_far"] == 1
    checker.max_ttl = 600

    # bounded: with room for 2, the oldest of 3 accepted records is checked in full again
    third = signed(issued=3.0)
    assert checker.validate(third)
    before = checker.checks["verified"]
    assert checker.validate(third) and checker.validate(signed(issued=2.0))
    assert checker.checks["verified"] == before
    assert checker.validate(good) and checker.checks["verified"] == before + 1

    never = Ed25519RecordValidator(Identity.generate(), {KEY: member_value_ok}, remember=0)
    assert never.validate(good) and never.validate(good) and never.checks == {"verified": 2}

    # a member's refresh re-signs the same value with a later expiry: its signature is checked, its value's check
    # is remembered (by owner and value bytes: the same value under mallory's name was refused above)
    fresh = Ed25519RecordValidator(Identity.generate(), {KEY: member_value_ok})
    assert fresh.validate(signed()) and fresh.validate(signed(expiration=now + 90))
    assert fresh.checks == {"verified": 2, "value_remembered": 1}
    assert not fresh.validate(stolen) and fresh.refused["malformed"] == 1


def test_strip_value_does_not_mangle_payloads_that_look_like_signatures():
    alice = Identity.generate()
    v = Ed25519RecordValidator(alice, [KEY])
    payload = msgpack.packb("[ed25519sig:" + "A" * 88 + "] and more")
    rec = record(alice, value=payload)
    signed = dataclasses.replace(rec, value=v.sign_value(rec))
    assert v.validate(signed) and v.strip_value(signed) == payload


def test_envelopes():
    alice, bob = Identity.generate(), Identity.generate()
    env = seal(alice, {"x": 1})
    assert open_envelope(env, alice.peer_id, max_size=100) == {"x": 1}
    with pytest.raises(BadSignature):
        open_envelope(env, bob.peer_id, max_size=100)
    with pytest.raises(BadSignature):
        open_envelope({"p": env["p"] + b"\x00", "s": env["s"]}, alice.peer_id, max_size=100)
    for bad in (None, [], {"p": 1, "s": 2}, {"p": b"", "s": b"", "x": 1}):
        with pytest.raises(MalformedMessage):
            open_envelope(bad, alice.peer_id, max_size=100)
    with pytest.raises(FrameTooLarge):
        open_envelope(seal(alice, "y" * 500), alice.peer_id, max_size=100)


def test_node_record_parsing_is_strict():
    ident = Identity.generate()
    good = NodeRecord(ident.peer_id, ("/ip4/127.0.0.1/tcp/1",), "0.1.0", ("diloco",), 1.5).to_wire()
    assert NodeRecord.from_wire(good).peer_id == ident.peer_id
    bad_variants = [
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "loops"},
        {**good, "v": 2},
        {**good, "peer": "QmNotEd25519"},
        {**good, "addrs": ["not an addr"]},
        {**good, "addrs": ["/ip4/1.2.3.4/tcp/1"] * 17},
        {**good, "loops": ["x" * 65]},
        {**good, "issued": 1},  # int, not float: no coercion
        {**good, "issued": float("nan")},
        {**good, "version": None},
        {**good, "adm": ""},
        {**good, "adm": 7},
        {**good, "adm": "x" * 33},
        "not a dict",
    ]
    for bad in bad_variants:
        with pytest.raises(MalformedMessage):
            NodeRecord.from_wire(bad)


def test_a_record_says_its_admission_rule_and_one_without_it_still_parses():
    from swarmd.crdt.admission import Admission

    ident = Identity.generate()
    rule = Admission("s", 22).policy()
    assert rule != Admission("s", 12).policy() != Admission("s", 22, allow=[ident.peer_id]).policy()
    assert rule == Admission("s", 22).policy() and len(rule) == 16
    record = NodeRecord(ident.peer_id, (), "0.1.0", (), 1.5, rule)
    assert record.to_wire()["adm"] == rule and NodeRecord.from_wire(record.to_wire()) == record
    older = NodeRecord(ident.peer_id, (), "0.1.0", (), 1.5)  # a node from before records said it
    assert "adm" not in older.to_wire() and NodeRecord.from_wire(older.to_wire()).policy == ""


@pytest.mark.timeout(60)
async def test_real_dht_nodes_refuse_forged_member_records():
    """Two DHTNodes on real p2p daemons: the storing node itself refuses a record signed by the wrong key."""
    from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport

    alice, mallory = Identity.generate(), Identity.generate()
    ta = P2PDaemonTransport(alice, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    tm = P2PDaemonTransport(mallory, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await ta.start()
    await tm.start()
    try:
        va = Ed25519RecordValidator(alice, protected_keys=[KEY])
        vm = Ed25519RecordValidator(mallory, protected_keys=[KEY])
        node_a = await hm.DHTNode.create(p2p=ta.hivemind_p2p, record_validator=va)
        addr = (await ta.addresses())[0]
        await tm.connect(addr)
        node_m = await hm.DHTNode.create(p2p=tm.hivemind_p2p, record_validator=vm, initial_peers=[addr])
        exp = hm.get_dht_time() + 30
        assert await node_a.store(KEY, {"me": "alice"}, exp, subkey=owner_tag(alice.peer_id))
        # mallory overwrites alice's slot: her validator will not sign it, so it goes out unsigned -> refused
        assert not await node_m.store(KEY, {"me": "EVIL"}, exp + 10, subkey=owner_tag(alice.peer_id))
        # and an unsigned plain subkey on the protected key is refused too
        assert not await node_m.store(KEY, {"junk": 1}, exp, subkey=b"plain")
        # mallory's own slot is fine
        assert await node_m.store(KEY, {"me": "mallory"}, exp, subkey=owner_tag(mallory.peer_id))
        got = await node_a.get(KEY, latest=True)
        values = {k: v.value for k, v in got.value.items()}
        assert values == {owner_tag(alice.peer_id): {"me": "alice"}, owner_tag(mallory.peer_id): {"me": "mallory"}}
        await node_m.shutdown()
        await node_a.shutdown()
    finally:
        await tm.close()
        await ta.close()


def test_the_members_key_asks_for_an_admitted_identity_a_ticket_or_the_allowlist():
    """Identities are free: without a price, ~9,000 fresh keys each storing one record push the members key past
    what a DHT answer can carry (4 MB), and every node's member poll then reads nothing. The key asks for what the
    replicated state asks for (crdt.admission): a work ticket in an open swarm, the allowlist in a closed one."""
    from hivemind.utils.serializer import MSGPackSerializer

    from swarmd.crdt.admission import Admission
    from swarmd.dht.records import member_check

    alice, mallory = Identity.generate(), Identity.generate()
    now = hm.get_dht_time()

    def rule_of(admission):
        return member_check(lambda r: admission.admits(r.peer_id, "members",
                                                       admission.payload(r.peer_id, r.ticket)) is None)

    def signed(who, ticket):
        wire = NodeRecord(who.peer_id, ("/ip4/127.0.0.1/tcp/1",), "0.1", (), 1.0, "", ticket).to_wire()
        rec = record(who, value=MSGPackSerializer.dumps(wire), expiration=now + 60)
        return dataclasses.replace(rec, value=Ed25519RecordValidator(who, [KEY]).sign_value(rec))

    open_swarm = Admission("s", 10)
    ticket = open_swarm.mint(alice.peer_id)
    checker = Ed25519RecordValidator(Identity.generate(), {KEY: rule_of(open_swarm)})
    assert checker.validate(signed(alice, ticket))
    wrong = next(n for n in range(ticket + 1, ticket + 100_000) if not open_swarm.ticket_ok(alice.peer_id, n))
    # no ticket, alice's ticket (a ticket is for one identity), a nonce that is no ticket
    for bad in (signed(mallory, None), signed(mallory, ticket), signed(alice, wrong)):
        assert not checker.validate(bad)
    assert checker.refused == {"unadmitted": 3}
    assert NodeRecord.from_wire(MSGPackSerializer.loads(
        Ed25519RecordValidator(alice, [KEY]).strip_value(signed(alice, ticket)))).ticket == ticket

    closed = Admission("s", 22, allow=[alice.peer_id])  # no ticket asked, the list decides
    checker = Ed25519RecordValidator(Identity.generate(), {KEY: rule_of(closed)})
    assert checker.validate(signed(alice, None)) and not checker.validate(signed(mallory, None))
    assert checker.refused == {"unadmitted": 1}
    for bad in (-1, 2**64, 1.5, "7"):  # a ticket is an 8-byte nonce
        with pytest.raises(MalformedMessage):
            NodeRecord.from_wire({**NodeRecord(alice.peer_id, (), "0.1", (), 1.0).to_wire(), "tk": bad})


def test_a_records_ticket_is_bound_to_a_time_window_and_an_older_swarmds_is_refused_by_name():
    """Issue 80 item 7: tickets never expired, so a stock minted once (or ahead of time) held the members key for
    good. A record's ticket is good in the window it was minted for and the next one; a record that carries an op's
    ticket (an older swarmd's record) is refused as old_ticket; a value accepted in one window is checked again in
    the next, not answered from what was remembered."""
    from hivemind.utils.serializer import MSGPackSerializer

    from swarmd.crdt.admission import WINDOW, Admission
    from swarmd.dht.records import member_check

    alice = Identity.generate()
    rule = Admission("s", 16)  # 16 bits: a nonce that is a ticket for another window by chance is rare (2^-15)
    clock = [hm.get_dht_time()]
    epoch = rule.epoch(clock[0])
    checker = Ed25519RecordValidator(Identity.generate(), {KEY: member_check(
        lambda r: rule.record_refusal(r.peer_id, r.ticket, clock[0]) or True, lambda: rule.epoch(clock[0]))})

    def signed(ticket):
        wire = NodeRecord(alice.peer_id, ("/ip4/127.0.0.1/tcp/1",), "0.1", (), 1.0, "", ticket).to_wire()
        rec = record(alice, value=MSGPackSerializer.dumps(wire), expiration=hm.get_dht_time() + 60)
        return dataclasses.replace(rec, value=Ed25519RecordValidator(alice, [KEY]).sign_value(rec))

    ticket = rule.mint_record(alice.peer_id, epoch)
    assert checker.validate(signed(ticket))
    clock[0] += WINDOW  # the next window: still good (a node renews as a window begins)
    assert checker.validate(signed(ticket)) and checker.checks["value_remembered"] == 0
    clock[0] += WINDOW  # two windows on: the same record bytes, checked again and refused
    assert not checker.validate(signed(ticket))
    assert rule.record_refusal(alice.peer_id, rule.mint_record(alice.peer_id, rule.epoch(clock[0])), clock[0]) is None
    # an op's ticket (what an older swarmd put in its record) is named as such; a ticket for another swarm is not one
    assert not checker.validate(signed(rule.mint(alice.peer_id)))
    assert rule.record_refusal(alice.peer_id, Admission("t", 16).mint_record(alice.peer_id, rule.epoch(clock[0])),
                               clock[0]) == "unadmitted"
    assert checker.refused == {"unadmitted": 1, "old_ticket": 1}
    assert Admission("s", 16).policy() != _digest_before_windows("s", 16)


def _digest_before_windows(swarm: str, bits: int) -> str:
    import hashlib

    from swarmd.crdt.admission import DOMAIN

    return hashlib.blake2b(DOMAIN + f"{swarm}\n{bits}".encode(), digest_size=8).hexdigest()


def test_a_nodes_record_ticket_is_renewed_as_a_window_begins_and_only_then():
    from swarmd.crdt.admission import WINDOW, Admission, RecordTicket

    me = Identity.generate().peer_id
    rule = Admission("s", 16)  # a ticket valid in another window by chance: 2^-15
    ours = RecordTicket(rule, me)
    start = (rule.epoch(hm.get_dht_time()) + 0.5) * WINDOW  # mid-window
    first = ours.at(start)
    assert ours.at(start + WINDOW / 4) == first and ours.minted == 1  # the same window: kept
    renewed = ours.at(start + WINDOW)
    assert ours.minted == 2 and all(rule.record_refusal(me, t, start + WINDOW) is None for t in (first, renewed))
    assert rule.record_refusal(me, first, start + 2 * WINDOW) == "unadmitted"
    assert rule.record_refusal(me, renewed, start + 2 * WINDOW) is None
    assert RecordTicket(Admission("s", 22, allow=[me]), me).at(start) is None  # closed: the list admits
