"""SAPO (Swarm sAmpling Policy Optimization): RL post-training where peers share rollouts, not weights.

Each round r, every peer (``docs/loops/sapo.md``; the SAPO paper's loop, with its reference implementation's
weaknesses fixed):

1. samples ``questions`` tasks from its generator, at a seed that is a function of (run, seed, its peer id, r), so
   anyone can tell whether a spec really is that peer's for that round;
2. samples ``completions`` (G) answers per question from its own policy and scores them with its own verifier;
3. publishes ``{"r": r, "items": [{"spec": [gen, ver, seed, idx], "comps": [str] * G}, ...]}``, a signed pubsub
   message: task specs instead of questions and answers, so no peer is trusted with ground truth;
4. waits (at most ``deadline`` seconds) for new items from the peers of its last round whose word counts
   (``protocols.standing``: a fresh key is never waited for);
5. builds its training set: ``local`` (I) of its own groups (the informative ones first: ``rounds.pick_local``),
   and ``external`` (J) groups drawn uniformly from the newest items each peer shared since we last drew from it,
   after regenerating each question from its spec and re-scoring every completion with its own verifier; groups
   whose completions all scored the same carry no advantage and are dropped, and at most ``max_per_source`` groups
   come from any one peer;
6. takes one GRPO step (``protocols.grpo``: clipped ratio, no KL).

Rounds are each peer's own: r in a message is its author's round (its seeds), and no peer's message moves
another's round; a peer that arrives late starts at its own round 0. Validation runs before anything is forwarded:
malformed, oversized (message, item count, completion count and length, alphabet), forged (a spec that is not the
author's for that round), equivocating (two item sets for one round) and out-of-run items are rejected, which penalises
the peer that sent them; an author's older rounds are ignored, and messages faster than 2 per second ignored and
penalised (a flood). Completions are text (at most ``max_completion`` characters, so 4 bytes each in UTF-8, in the
task's alphabet: printable text for a language model's), re-tokenized by each receiver, so peers may run policies of
any size or tokenizer; completions and their bytes received are counted. Rewards (own and external), items shared and
used, and bytes go to ``/status`` and, every ``report_every`` rounds, into the replicated progress register.

The package's modules, one concept each: ``config`` (SapoConfig), ``items`` (the messages, their limits, a
peer's question seeds, and how a receiver checks an item set and re-scores its completions with its own verifier),
``validate`` (the pubsub validator: what is kept of whose items) and ``loop`` (SapoLoop: a round's rollouts,
sharing, close, draw and GRPO step, checkpoints and the views).
"""

from swarmd.protocols.sapo.config import SapoConfig  # noqa: F401
from swarmd.protocols.sapo.items import (  # noqa: F401
    CARRIER,
    ITEM_BURST,
    ITEM_RATE,
    MAX_AUTHORS,
    MAX_COMPLETION_CHARS,
    MAX_COMPLETIONS,
    MAX_ITEMS,
    READY,
    ROLLOUTS,
    Rules,
    parse_items,
    question,
    question_seed,
    reward,
    score,
)
from swarmd.protocols.sapo.loop import HISTORY, SapoLoop, policy_seed  # noqa: F401
