"""A DiLoCo run's settings (the ``[diloco]`` table of a node's config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from swarmd.protocols import codecs, exchange, outer
from swarmd.protocols.diloco.wire import (
    MAX_PARTS,
    REDUCED_AUTO,
)
from swarmd.protocols.standing import check_peer_ids


class DilocoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    run: str = Field("diloco-demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    task: str = "tinygpt"  # "path/to/file.py:factory", "package.module:factory" or a built-in name
    task_options: dict = {}  # keyword arguments of the task's factory
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    threads: int = Field(0, ge=0, le=4096)  # torch's CPU threads for the loop's compute (0: auto, protocols.task)
    checkpoint_every: int = Field(1, ge=0)  # rounds between checkpoints (0: only at the end)
    seed: int = 1  # the initial weights (every peer builds the same) and the data order
    rounds: int = Field(8, ge=0)  # outer rounds per fragment (0: until stopped)
    inner_steps: int = Field(50, ge=1)  # H
    fragments: int = Field(1, ge=1)  # P (1 = plain DiLoCo)
    overlap: int = Field(0, ge=0)  # tau: inner steps run while a fragment's update travels
    alpha: float = Field(0.0, ge=0, le=1)  # local weight when merging an overlapped fragment
    codec: str = "e3m0"
    # the codec's settings (part of the run's fingerprint), e.g. {density = 0.015625, chunk = 4096, bits = 2} for
    # "topk2" (protocols/sparse.py), {block = 64} for "sign"
    codec_options: dict = {}
    # error feedback: each peer adds what the codec dropped of its last update to its next one (Deep Gradient
    # Compression, 1-bit Adam), so the swarm gets, over rounds, what a peer's steps moved. "auto": on for the codecs
    # that drop magnitudes ("sign", "topk"), off for the others (with e3m0 it gained nothing: bench_diloco_sim.py).
    # Each peer's own state (one fp32 copy of the weights), not part of the run's fingerprint
    error_feedback: str = Field("auto", pattern=r"^(auto|on|off)$")
    # the residual carried as decay x itself (SparseLoCo's 0.95: an old residual fades); 1: all of it
    feedback_decay: float = Field(1.0, gt=0, le=1)
    # how the peers' updates are averaged, coordinate by coordinate: "all" divides each sum by the number of
    # updates, "senders" by the number of updates not zero there (SparseLoCo's sparse aggregation, templar's scatter
    # mean: a value one peer's top-k sent is applied whole, not 1/N of it while its error feedback forgets all of
    # it; -7% validation loss at the same bytes in bench_diloco_sim.py's h30-topk2 rows). "auto": "senders" for
    # "topk2", "all" for the others (dense codecs: the same either way but for exact zeros)
    outer_average: str = Field("auto", pattern=r"^(auto|all|senders)$")
    # the codec of a scatter round's combined parts (what each reducer sends everyone): "auto" is the run's codec,
    # except e3m0 for "sign" (the sign of the peers' mean loses what they agree on: +2.8% validation loss in
    # bench_diloco_sim's h4-sign-ef-rc; e3m0 keeps it at 3.7x a sign part's bytes in the all-gather)
    reduced_codec: str = Field("auto", pattern=r"^(auto|none|fp16|bf16|int8|e3m0|sign)$")
    # the inner optimizer when the task brings none: "swarm-adamw" (AdamW with its step sized for the round's
    # peers' batches, protocols/inner.py) or plain "adamw"; inner_betas and weight_decay either way. Each peer's
    # own choice, not part of the run's fingerprint. A longer second-moment average (beta2 0.99) steadies
    # swarm-adamw's estimate of the swarm's gradient variance from one peer's batches: bench_diloco_sim.py's
    # h4-sign-ef-b2.99 rows (docs/benchmarks/diloco-sim.md)
    inner_optimizer: str = Field("swarm-adamw", pattern=r"^(adamw|swarm-adamw|muon)$")  # muon: protocols/inner.py
    inner_lr: float = Field(4e-4, gt=0)
    inner_betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.1, ge=0)
    # the inner learning rate over the run (any inner optimizer's, the task's too: its groups' lr are the base):
    # a linear warm-up over warmup_steps, then "constant", or "cosine" down to lr_final x the base at the run's
    # last inner step (rounds x inner_steps; an open-ended run, rounds = 0, stays at the base after the warm-up).
    # By the run's inner step, so a late joiner or a restarted peer takes the swarm's lr (protocols/inner.py)
    lr_schedule: str = Field("constant", pattern=r"^(constant|cosine)$")
    warmup_steps: int = Field(0, ge=0)
    lr_final: float = Field(0.1, ge=0, le=1)
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    min_peers: int = Field(1, ge=1)
    deadline_low: float = Field(2.0, gt=0)
    deadline_high: float = Field(60.0, gt=0)
    eval_every: int = Field(1, ge=1)  # rounds between validation evaluations
    peers: list[str] = Field([], max_length=10_000)  # a closed run: only these peer ids take part (empty: open)
    # the update exchange: "all-to-all" (every peer pulls every update), "scatter" (reduce-scatter + all-gather:
    # each peer moves about 2x its update whatever the number of peers), or "auto": scatter from
    # scatter_min_peers participants and scatter_min_bytes per encoded update (measured by bench/bench_exchange.py)
    exchange: str = Field("auto", pattern=r"^(auto|all-to-all|scatter)$")
    # parts an update is cut into (fewer for small fragments): a number, or "auto", which follows the last round's
    # participants so that a scatter round's busiest peer moves at most 2.2 x its update, audits included
    # (``exchange.auto_parts``: 16 up to 8 peers, 64 at 16, 128 at 32)
    parts: int | str = "auto"
    scatter_min_peers: int = Field(4, ge=2)
    scatter_min_bytes: int = Field(1 << 20, ge=0)
    audit: float = Field(0.25, ge=0, le=1)  # fraction of reduced parts re-computed by a second peer
    min_bandwidth: float = Field(10e6, gt=0)  # bytes/s assumed at worst when a round's transfers are given time
    # memory a peer may keep (all-to-all: the last close's updates, global weights and momentum, one round) to redo
    # that close without a contested update when the majority's next updates say they combined without it (0: never;
    # such a peer then always takes a checkpoint)
    redo_bytes: int = Field(1 << 30, ge=0)
    # agree on each round's members: every peer combines the members its round's coordinator (a counted peer drawn
    # from the round) saw, not its own (peers that saw different members end with different weights and resync)
    agree: bool = True

    _peers = field_validator("peers")(check_peer_ids)

    @field_validator("parts")
    @classmethod
    def _parts(cls, v: int | str) -> int | str:
        if v != "auto" and not (isinstance(v, int) and 1 <= v <= MAX_PARTS):
            raise ValueError(f'parts: "auto" or a number from 1 to {MAX_PARTS}')
        return v

    @field_validator("inner_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("inner_betas: two numbers in [0, 1), e.g. [0.9, 0.95]")
        return v

    @model_validator(mode="after")
    def _codec(self) -> "DilocoConfig":
        codecs.configured(self.codec, self.codec_options)  # an unknown codec or option is refused here
        return self

    def options(self) -> dict:
        return dict(self.task_options)

    def shared(self) -> dict:
        """The settings every peer of a run must share (part of the run's fingerprint), and the scatter's reduction
        rule (peers compare reduced parts by hash: two versions of the rule must not meet in one run)."""
        reduced = self.reduced()
        return {**self.model_dump(include={"run", "seed", "rounds", "inner_steps", "fragments", "overlap", "alpha",
                                           "codec", "outer_lr", "outer_momentum", "peers", "exchange", "parts",
                                           "scatter_min_peers", "scatter_min_bytes", "audit", "agree"}),
                "reduce_rule": exchange.REDUCE_RULE,
                "weights_hash": outer.WEIGHTS_HASH,
                "outer_step": outer.OUTER_STEP,
                # (only where it is not the run's codec: runs that never set it keep their fingerprint)
                **({"reduced_codec": reduced} if reduced != self.codec else {}),
                **({"codec_options": self.codec_options} if self.codec_options else {}),
                **({"outer_average": "senders"} if self.senders() else {}),
                # the reduced parts' bytes depend on how e3m0 picks its codes (codecs.E3M0_ENCODER)
                **({"e3m0_encoder": codecs.E3M0_ENCODER} if reduced == "e3m0" else {})}

    def senders(self) -> bool:
        """Whether updates are averaged over their senders per coordinate (``outer_average`` resolved)."""
        return self.outer_average == "senders" or (self.outer_average == "auto" and self.codec == "topk2")

    def reduced(self) -> str:
        """The codec of a scatter round's combined parts (``reduced_codec`` resolved)."""
        if self.reduced_codec != "auto":
            return self.reduced_codec
        return REDUCED_AUTO.get(self.codec, self.codec)


