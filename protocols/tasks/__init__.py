"""Built-in tasks, each an implementation of the task seam (``protocols.task``): ``tinygpt`` (DiLoCo, SPSA),
``arith`` (SAPO), ``digits`` (DiLoCo, SPSA: images), ``hf-text`` (DiLoCo, SPSA: a transformers causal LM on real
text) and ``reasoning-gym`` (SAPO). A user's own task file follows the same contract."""

import hashlib


def batch_seed(seed: int, shard: int, step: int) -> int:
    """A generator seed for one (seed, shard, step): a task's ``batch_at`` draws the batch from it, so any peer can
    draw another's batch (an SPSA auditor re-probing a step)."""
    digest = hashlib.blake2b(f"{seed}/{shard}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
