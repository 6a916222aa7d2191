"""protocols/buffers.py: a buffer is kept for a later round only where nothing else can reach it."""

import pytest
import torch

from swarmd.protocols.buffers import Buffers, unviewed

pytestmark = pytest.mark.beside  # pure computation (tests/conftest.py)


def test_a_buffer_given_back_is_the_one_taken_next_and_the_pool_holds_its_bytes():
    pool = Buffers(1 << 20)
    x = torch.empty(1000)
    x_id = id(x)
    assert pool.give(x)
    assert pool.status()["held_bytes"] == 4000
    del x
    y = pool.take(1000)
    assert id(y) == x_id and y.dtype == torch.float32 and y.shape == (1000,)
    assert pool.status() == {"held_bytes": 0, "taken": 1, "reused": 1, "given": 1, "refused": 0}
    z = pool.take(1000)  # none left of that size: a new one
    assert z.data_ptr() != y.data_ptr() and pool.status()["reused"] == 1
    assert pool.take(7).shape == (7,)  # another size: a new one


def test_a_buffer_that_anything_else_still_holds_or_views_is_not_kept():
    pool = Buffers(1 << 20)
    held = torch.empty(100)
    keep = [held]  # another holder of the object
    viewed = torch.empty(100)
    view = viewed[10:]  # a view of its storage
    mapped = torch.empty(100)
    array = mapped.numpy()  # numpy's view
    part = torch.empty(200)[:100]  # itself a view
    for t in (held, viewed, mapped, part):
        assert not pool.give(t)
    assert pool.status()["refused"] == 4 and pool.status()["held_bytes"] == 0
    del keep, view, array
    assert not unviewed(torch.empty(10, dtype=torch.float64))  # float32 buffers only
    assert not unviewed(torch.nn.Parameter(torch.empty(10)))
    assert not unviewed(torch.empty(4, 5).t())  # not contiguous


def test_the_pool_keeps_no_more_than_its_room_and_nothing_where_it_has_none():
    pool = Buffers(4000)
    a, b = torch.empty(600), torch.empty(600)
    assert pool.give(a) and not pool.give(b)  # 2400 + 2400 bytes over 4000
    assert pool.status()["held_bytes"] == 2400
    none = Buffers(0)
    assert not none.give(torch.empty(10)) and none.status()["held_bytes"] == 0
