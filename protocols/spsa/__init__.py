"""Seed-based SPSA (MeZO-style zeroth-order fine-tuning) at about one byte per step per peer.

The algorithm (``docs/loops/spsa.md``), per step t and peer i:

- seed(t, i) = BLAKE2b-64(run id || t || peer id) >> 1; seeds are derived, never sent;
- z ~ N(0, I) in the fixed parameter order (the model's), from a CPU generator seeded with it: 16-bit integer
  draws looked up in a table of normal quantiles, the same bits on every CPU (``PERTURBATION``);
- probe from the canonical weights, restoring them by copy (bit-exact; the in-place +-eps trick drifts in fp32):
  L+ at theta + eps*z, L- at theta - eps*z, g = (L+ - L-) / (2 eps), clipped to +-clip;
- one byte: bit 7 the sign, bits 0-6 q = round(4 log2(|g| / 1e-4)) clamped to 0..127 (quarter-octave steps,
  |g| from 1e-4 to ~3.6e5); decoded as sign * 1e-4 * 2^(q/4);
- every peer applies every peer's byte for a step, in canonical order (sorted peer ids):
  theta <- theta - (lr / M) * sum_i dec(b_i) * z(seed(t, i)), M = number of peers in the step.

On the wire, a peer signs one pubsub message per *window* of ``window`` steps (``{"w": window, "b": bytes}``), so the
header and signature are amortised. Updates apply with a one-window lag: the bytes of window w are applied during
window w+1 (step t uses the bytes of step t - window), so a window can be computed while the previous one travels.
A window's participants are the peers whose batch for it arrived before its deadline; every ``hash_every``
windows peers publish a hash of their weights, and a peer that disagrees with the majority counts it and resyncs by
replaying the log. The log (every applied, signed batch) lets a late joiner rebuild the base model, verify each
batch's signature and replay to the same weights bit for bit; where its CPU builds the base with other low bits
(another CPU's kernels draw and pretrain a seed's model otherwise), it replays onto the base of the peer it replays
from (``spsa-base``: ``Base.take_from``), and founders whose bases differ by rounding start from the one most of them
hold (``_start_choice``).


The package's modules, one concept each: ``config`` (SpsaConfig), ``wire`` (the messages and the limits on what is
kept of them), ``codes`` (a step's byte: seeds, its code, a window's screening), ``weights`` (the perturbation and the
canonical weights), ``windows`` (publishing, closing a window, the bytes a step applies, the hash check), ``audits``
(re-probing the others' steps), ``log`` (serving, reading and replaying the log of signed batches), ``base`` (the
base model as peers serve it), ``start`` (the start barrier and the late path), ``checkpoints`` (ours),
``validate`` (the pubsub validator), ``model`` (the model we probe and its batches), ``book`` (the window we
compute, what arrives for the open ones, what is kept per window and for how long) and ``state`` (the loop's other
long-lived state, by concern); ``loop`` (SPSALoop) schedules the windows and composes them.
"""

from swarmd.protocols.gossip import Verdict  # noqa: F401  (tests read verdicts through the package)
from swarmd.protocols.spsa.audits import (  # noqa: F401
    AUDIT_REL,
    AUDIT_TOL_Q,
    OFF_WEIGHTS_LIMIT,
    Auditor,
    audit_agrees,
)
from swarmd.protocols.spsa.base import (  # noqa: F401
    BASE_PREFIX,
    Base,
    BaseReceiver,
    base_arrays,
    base_layout,
    base_parts,
    base_size,
)
from swarmd.protocols.spsa.book import Arrivals, Window, WindowBook  # noqa: F401
from swarmd.protocols.spsa.codes import (  # noqa: F401
    CAP_Q,
    EXTREME_Q,
    G0,
    capped,
    decode_grad,
    encode_grad,
    screen_window,
    step_seed,
)
from swarmd.protocols.spsa.config import (  # noqa: F401
    DEFAULT_TASK_OPTIONS,
    SpsaConfig,
)
from swarmd.protocols.spsa.log import (  # noqa: F401
    _window_bytes,
    log_contributors,
    log_parts,
    read_log,
    read_log_parts,
)
from swarmd.protocols.spsa.loop import (  # noqa: F401
    SPSALoop,
)
from swarmd.protocols.spsa.start import (  # noqa: F401
    MISMATCH_SAID_AFTER,
)
from swarmd.protocols.spsa.state import Resyncs, Start  # noqa: F401
from swarmd.protocols.spsa.weights import (  # noqa: F401
    DRAW_CHUNK,
    NORMAL_TABLE,
    PERTURBATION,
    Z_BITS,
    Weights,
    _bytes_of,
    _normal_quantiles,
    _perturbation_flat,
    base_digest,
    exact_fp32,
    perturbation,
    tensors_hash,
)
from swarmd.protocols.spsa.wire import (  # noqa: F401
    _ENTRY,
    _HASH,
    _TAG,
    _W,
    BASE_HEAD,
    BASE_PART,
    BASE_PART_BYTES,
    BASE_REQUEST,
    BASE_SERVE_EVERY,
    BASE_SERVE_RATE,
    BASE_SERVES,
    BASE_SPEC,
    BATCH,
    CARRIER,
    HASH,
    HISTORY,
    JOIN,
    KEEP_APPLIED,
    LOG_PART,
    LOG_PART_BYTES,
    LOG_REQUEST,
    LOG_SPEC,
    MAX_LOG_BYTES,
    MAX_PEER_ENTRIES,
    NEWCOMER_GRACE,
    READY,
    READY_UNLISTED,
    _batch_bytes,
    _batch_hash,
)
from swarmd.transport.errors import MalformedMessage  # noqa: F401
