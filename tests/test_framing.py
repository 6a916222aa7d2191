import asyncio
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.transport.errors import FrameTooLarge, MalformedMessage, StreamClosed
from swarmd.transport.framing import HEADER, ProtocolSpec, decode, encode, frame, read_message

SPEC = ProtocolSpec("test", "1.0.0", max_frame=1024, kinds=frozenset({1, 2}))


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


async def test_roundtrip_and_clean_eof():
    r = reader_with(frame(1, {"a": [1, b"x", "y"]}, SPEC) + frame(2, None, SPEC))
    m1, m2, end = await read_message(r, SPEC), await read_message(r, SPEC), await read_message(r, SPEC)
    assert (m1.kind, m1.body, m2.kind, m2.body, end) == (1, {"a": [1, b"x", "y"]}, 2, None, None)
    assert SPEC.id == "/swarmd/test/1.0.0"


async def test_oversized_frame_is_rejected_before_the_body_is_read():
    # only the header arrives, no EOF: if the reader tried to read the body it would hang (and the timeout fail)
    r = reader_with(HEADER.pack(10**9), eof=False)
    with pytest.raises(FrameTooLarge):
        await asyncio.wait_for(read_message(r, SPEC), 1.0)


def test_outgoing_oversized_is_refused():
    with pytest.raises(FrameTooLarge):
        frame(1, b"x" * 2000, SPEC)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"kind": 1}),  # not [kind, body]
        msgpack.packb([1, 2, 3]),
        msgpack.packb(["1", None]),  # kind not int
        msgpack.packb([True, None]),  # bool is not an int kind
        msgpack.packb([7, None]),  # unknown kind
        msgpack.packb([1, {1: 2}]),  # non-string map key
        msgpack.packb([1, msgpack.ExtType(5, b"xx")]),  # ext types are refused
        encode(1, None) + b"\x00",  # trailing bytes
        b"\x92\x01\xa5ab",  # truncated string
        b"\x92\x01\xc4\xff",  # bin claims 255 bytes, has none
    ],
)
def test_malformed_payloads(payload):
    with pytest.raises(MalformedMessage):
        decode(payload, SPEC)


async def test_truncated_streams():
    with pytest.raises(StreamClosed):
        await read_message(reader_with(b"\x00\x00"), SPEC)
    with pytest.raises(StreamClosed):
        await read_message(reader_with(struct.pack(">I", 10) + b"abc"), SPEC)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_never_raise_anything_but_malformed(data):
    try:
        decode(data, SPEC)
    except MalformedMessage:
        pass


def test_protocol_spec_validation():
    with pytest.raises(ValueError):
        ProtocolSpec("a/b", "1.0.0", 10)
    with pytest.raises(ValueError):
        ProtocolSpec("a", "1.0.0", 0)


BIG = ProtocolSpec("big", "1.0.0", max_frame=8 << 20, kinds=frozenset({1}))


def _peak_bytes(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    except MalformedMessage:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_a_frame_of_empty_maps_is_refused_within_its_budget():
    # issue 14 item 4: one 8 MiB frame of empty maps cost +586 MB while decoded; now the container budget stops it
    for body in ([{}] * ((8 << 20) - 16), [[{}] * 1000] * 8000):  # one long array; many short ones
        payload = encode(1, body)
        assert len(payload) <= BIG.max_frame
        with pytest.raises(MalformedMessage) as e:
            decode(payload, BIG)
        assert e.value.kind == "oversized"
        assert _peak_bytes(lambda: decode(payload, BIG)) < 5 * len(payload)


def test_scalars_count_against_the_budget_too():
    # a bare unpackb lets a list of two-letter strings cost 20x its bytes, and of 16-bit ints 13x
    for item in ("ab", 257):
        long = encode(1, [item] * (2 << 20))
        with pytest.raises(MalformedMessage) as e:  # one long list: refused before it is allocated
            decode(long, BIG)
        assert e.value.kind == "oversized" and _peak_bytes(lambda: decode(long, BIG)) < 1 << 16
        chunks = encode(1, [[item] * 1000] * 2000)  # many short lists: the total is counted as they complete
        with pytest.raises(MalformedMessage):
            decode(chunks, BIG)
        assert _peak_bytes(lambda: decode(chunks, BIG)) < 5 * len(chunks)
    # the most objects a payload may carry, padded out with bytes: still a small multiple of its size
    worst = encode(1, [["ab"] * 20_000, bytes(900_000)])  # ~22,000 objects: what 900 KB may carry
    assert decode(worst, BIG).body[0][0] == "ab"
    assert _peak_bytes(lambda: decode(worst, BIG)) < 5 * len(worst)


def test_the_kind_is_checked_before_the_body_is_decoded():
    payload = encode(9, [[1, 2, 3]] * 500_000)
    assert _peak_bytes(lambda: decode(payload, BIG)) < 1 << 16
    with pytest.raises(MalformedMessage, match="unknown message kind 9"):
        decode(payload, BIG)
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb([1000, None]), BIG)  # kinds are 0..127
    with pytest.raises(ValueError):
        frame(200, None, BIG)


def test_honest_shapes_fit_the_budget():
    # what our protocols send: maps of byte strings (ops, messages), version vectors, short lists of numbers
    ops = {"ops": [{"b": bytes(150), "s": bytes(64)} for _ in range(1000)], "more": False, "vv": {"x" * 52: 3}}
    assert decode(encode(1, ops), BIG).body == ops
    vv = {f"12D3KooW{i:044d}": i for i in range(2048)}  # a version-vector page
    assert decode(encode(1, {"b": list(range(256)), "vv": vv, "next": None}), BIG).body["vv"] == vv
    digests = {"d": [[b, bytes(16)] for b in range(256)], "after": None}
    assert decode(encode(1, digests), BIG).body == digests
    ihave = {"topic": "diloco/run", "ids": [bytes(16)] * 5000}
    assert decode(encode(1, ihave), BIG).body == ihave
    seeds = {"b": [1, 2, 3], "w": 7, "t": {"l": "ab", "c": "cd"}}
    assert decode(encode(1, seeds), BIG).body == seeds
    assert decode(encode(1, []), BIG).body == [] and decode(encode(1, {}), BIG).body == {}


def test_a_protocol_whose_large_frames_are_many_small_objects_says_so():
    """An SPSA log is many small signed batches (5 objects per >= 220 B: a batch's body is >= 150 B, even for a
    window of 1 step): past 64 KiB that is denser than the default allowance (one object per 64 B), so a long
    honest log was refused; its protocol allows one per 32 B."""
    log = [[w, [{"b": bytes(150), "s": bytes(64)} for _ in range(4)]] for w in range(3000)]
    payload = encode(2, log)
    dense = ProtocolSpec("dense", "1.0.0", max_frame=32 << 20, kinds=frozenset({2}), item_bytes=32)
    plain = ProtocolSpec("plain", "1.0.0", max_frame=32 << 20, kinds=frozenset({2}))
    assert decode(payload, dense).body == log
    with pytest.raises(MalformedMessage, match="more objects"):
        decode(payload, plain)
    # the allowance is bounded: never denser than small frames' (one per 16 B), so memory stays ~4x a frame's size
    with pytest.raises(ValueError):
        ProtocolSpec("denser", "1.0.0", max_frame=1 << 20, item_bytes=8)
    empties = encode(2, [[] for _ in range(200_000)])  # 1 B per object: refused under any allowance
    with pytest.raises(MalformedMessage):
        decode(empties, dense)


async def test_the_inbound_budget_holds_frames_back_and_a_cancelled_reader_gives_its_share_back():
    import asyncio

    from swarmd.transport.base import InboundBudget

    budget = InboundBudget(capacity=100)
    assert await budget.acquire(60) == 60
    second = asyncio.create_task(budget.acquire(60))  # does not fit beside the first: waits
    third = asyncio.create_task(budget.acquire(30))  # would fit, but queues behind the second (first come first)
    await asyncio.sleep(0)
    assert not second.done() and not third.done() and budget.used == 60
    second.cancel()  # a reader whose stream went away while it waited: the one behind it goes
    await asyncio.gather(second, return_exceptions=True)
    await asyncio.sleep(0)
    assert third.done() and budget.used == 90
    budget.release(60)
    budget.release(30)
    assert budget.used == 0 and budget.waits == 2
    assert await budget.acquire(500) == 100  # larger than the whole budget: runs alone
    budget.release(100)
    assert budget.used == 0


async def test_a_large_frame_is_not_starved_by_small_ones_that_keep_fitting():
    import asyncio

    from swarmd.transport.base import InboundBudget

    budget = InboundBudget(capacity=100)
    await budget.acquire(40)
    big = asyncio.create_task(budget.acquire(100))  # needs everything: waits for the 40 to go
    smalls = [asyncio.create_task(budget.acquire(40)) for _ in range(3)]  # each would fit beside the 40 held
    await asyncio.sleep(0)
    assert not big.done() and not any(t.done() for t in smalls)  # queued behind the big one, not served past it
    budget.release(40)
    await asyncio.sleep(0)
    assert big.done() and budget.used == 100 and not any(t.done() for t in smalls)
    budget.release(100)
    await asyncio.sleep(0)
    assert [t.done() for t in smalls] == [True, True, False] and budget.used == 80  # in order, as they fit
    budget.release(40)
    await asyncio.sleep(0)
    assert all(t.done() for t in smalls) and budget.used == 80 and not budget._waiters
