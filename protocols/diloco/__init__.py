"""DiLoCo and Streaming DiLoCo outer steps, peer to peer (``docs/loops/diloco.md``).

Each peer runs inner AdamW steps on its own data shard. The model is split into ``fragments`` (1 = plain DiLoCo);
fragment p is synced every ``inner_steps`` steps, staggered by p * inner_steps / fragments:

1. at its sync point the peer computes the pseudo-gradient Delta_p = global_p - local_p, encodes it (e3m0 by
   default), stores it in the bulk store and announces it on ``diloco/<run>`` with the round, the fragment and the
   hash of the global fragment it was computed from;
2. it keeps training for ``overlap`` more inner steps (Streaming DiLoCo's tau; 0 = wait at once) while the
   updates travel: other peers' announcements arrive through pubsub, their bytes are pulled (and hash-verified)
   in the background;
3. it closes the round: the participants are the peers whose update for (round, fragment) arrived by an adaptive
   deadline (median + k MAD of observed arrival offsets); updates with another base hash, a wrong shape or
   non-finite values are rejected; the rest are combined robustly (norm-clipped mean) in canonical order and applied
   with outer Nesterov (lr 0.7, momentum 0.9), so every peer holds bit-identical global weights;
4. the local fragment becomes alpha * local + (1 - alpha) * global (alpha = 0 without overlap).

Every round's new global hash is published; a peer whose global weights differ from the majority, or that joins
late, pulls a hash-verified checkpoint (global weights, outer momentum, round counters) from a peer through the
bulk path and continues from the next round.


The package's modules, one concept each: ``config`` (DilocoConfig), ``wire`` (the messages and their limits),
``fragment`` (a fragment's state from round to round), ``replica`` (our model and its optimizers), ``pending``
(what a round of one fragment gathers), ``update`` (our update), ``round`` (closing one round of one fragment),
``alltoall`` and ``scatter`` (the round's exchange, one interface and its two implementations), ``conform`` (taking
the coordinator's parts), ``redo`` (judging and redoing the last close), ``links`` (rates, parts, a round's time),
``pulls`` (pulling bytes), ``barrier`` (the start), ``checkpoints`` (ours, serving, joining), ``validate`` (the
pubsub validator) and ``loop`` (DilocoLoop, which schedules and composes them).
"""

from swarmd.node import allocator  # noqa: F401  (tests set the memory mode through it)
from swarmd.protocols.diloco.book import RoundBook  # noqa: F401
from swarmd.protocols.diloco.config import DilocoConfig  # noqa: F401
from swarmd.protocols.diloco.loop import DilocoLoop  # noqa: F401
from swarmd.protocols.diloco.pending import Announced, Pending, Received, Redo, StepEnd, _decode_part  # noqa: F401
from swarmd.protocols.diloco.wire import (  # noqa: F401
    _ADDRS,
    _BITS,
    _HASH,
    _P,
    _R,
    _TAG,
    ANN_END,
    ANN_REPLY,
    ANN_REQUEST,
    ANN_SPEC,
    AUDIT,
    CARRIER,
    CHECKPOINT,
    CKPT_REPLY,
    CKPT_REQUEST,
    CKPT_SPEC,
    CLIP,
    FEEDBACK_CODECS,
    FETCH_AFTER,
    FETCH_WAIT,
    HISTORY,
    INITIAL_TOLERANCE,
    JOIN,
    MAX_AHEAD,
    MAX_FETCH,
    MAX_LATE_PULLS,
    MAX_MESSAGE,
    MAX_NEWCOMER_PULLS,
    MAX_PART_BYTES,
    MAX_PARTS,
    MAX_PARTS_LISTS,
    MAX_PEER_ENTRIES,
    MAX_REDUCED_ENTRIES,
    MAX_REMEMBERED_UPDATES,
    MAX_VIEW,
    MEMBERS,
    PART_SLACK,
    PARTS,
    RATE_MIN_BYTES,
    RATE_ROUNDS,
    READY,
    READY_UNLISTED,
    REDUCED,
    REDUCED_AUTO,
    REDUCING,
    ROUND_HASH,
    RULES,
    SERVING_POLL,
    UPDATE,
    _probe_hash,
)
