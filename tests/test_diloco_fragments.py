"""A DiLoCo fragment's long-lived state (protocols/diloco/fragment.py): the global weights' hashes are computed once
per change of the weights, and new weights come with their hashes at once; the round counters read as the loop's
lists from outside."""

import pytest
import torch

from swarmd.protocols import outer
from swarmd.protocols.diloco.fragment import Fragments

pytestmark = [pytest.mark.beside, pytest.mark.timeout(30)]


def _built(sizes: list[int]) -> Fragments:
    frags = Fragments(len(sizes))
    at, params, weights = 0, [], []
    for n in sizes:
        params.append([at])
        weights.append(torch.arange(n, dtype=torch.float32) + at)
        at += 1
    frags.build(params, weights)
    return frags


def test_fragments_exist_before_the_model_and_have_no_rounds_until_built():
    frags = Fragments(3)
    assert len(frags) == 3 and not frags.built and frags.rounds_done() == []
    frags[1].closed_by["peer"] = 4  # the others' messages come before our model is built, and are kept
    frags.build([[0], [1], [2]], [torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)])
    assert frags.built and frags.rounds_done() == [0, 0, 0] and frags[1].closed_by == {"peer": 4}
    assert [f.params for f in frags] == [[0], [1], [2]]


def test_the_hashes_follow_every_replacement_of_the_weights():
    frags = _built([4, 6])
    assert frags.global_hash() == outer.params_hash(frags.weights())
    assert frags.base_hash(1) == outer.params_hash([frags[1].weights])
    new = frags[1].weights + 1.0
    before = frags.replace(1, new)
    assert before is not new and frags[1].weights is new
    assert frags.global_hash() == outer.params_hash(frags.weights())  # not the hash cached before
    assert frags.base_hash(1) == outer.params_hash([new])
    frags.replace_all([w * 2 for w in frags.weights()])
    assert frags.global_hash() == outer.params_hash(frags.weights())


def test_new_weights_and_the_hashes_given_with_them_become_visible_together():
    """A close hashes the new weights in a worker thread and hands the hashes over with them: the cache takes them,
    so the event loop never hashes a fragment itself for them."""
    frags = _built([4, 6])
    new = frags[0].weights - 1.0
    h = outer.params_hash([new, frags[1].weights])
    hp = outer.params_hash([new])
    frags.replace(0, new, h, hp)
    assert frags.global_hash() == h and frags.base_hash(0) == hp
    frags.replace(0, new + 1.0, "given", "given-0")  # taken as given: not computed again
    assert frags.global_hash() == "given" and frags.base_hash(0) == "given-0"


def test_one_fragment_names_the_hash_of_all_the_weights_as_its_base():
    frags = _built([5])
    assert frags.base_hash(0) == frags.global_hash() == outer.params_hash([frags[0].weights])
