"""A SAPO run's settings (``[loops.sapo]``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarmd.protocols.sapo.items import MAX_COMPLETIONS, MAX_ITEMS
from swarmd.protocols.standing import check_peer_ids


class SapoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    run: str = Field("sapo-demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    task: str = "arith"  # "path/to/file.py:factory", "package.module:factory" or a built-in name
    task_options: dict = {}  # keyword arguments of the task's factory (the built-ins': the policy's size, lr, ...)
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    threads: int = Field(0, ge=0, le=4096)  # torch's CPU threads for the loop's compute (0: auto, protocols.task)
    checkpoint_every: int = Field(50, ge=0)  # rounds between checkpoints of the policy (0: only at the end)
    seed: int = Field(1, ge=0)
    rounds: int = Field(300, ge=0, le=10_000_000)  # 0: until stopped
    questions: int = Field(8, ge=1, le=MAX_ITEMS)  # sampled per round
    completions: int = Field(8, ge=2, le=MAX_COMPLETIONS)  # G, per question
    local: int = Field(4, ge=0)  # I: own groups per update
    external: int = Field(4, ge=0)  # J: groups from other peers per update (0: the no-sharing baseline)
    max_per_source: int = Field(2, ge=1)  # external groups from any one peer per update
    min_peers: int = Field(1, ge=1)  # wait for this many peers (us included) before round 0
    deadline: float = Field(5.0, gt=0)  # seconds to wait for a round's items from the last round's peers
    report_every: int = Field(5, ge=1)  # rounds between writes to the replicated progress register
    policy_seed: int | None = Field(None, ge=0)  # default: derived from seed and our peer id
    peers: list[str] = Field([], max_length=10_000)  # a closed run: only these peer ids take part (empty: open)

    _peers = field_validator("peers")(check_peer_ids)

    @model_validator(mode="after")
    def _consistent(self):
        if self.local > self.questions:
            raise ValueError(f"local ({self.local}) cannot exceed questions per round ({self.questions})")
        if self.local + self.external < 1:
            raise ValueError("local + external must be at least 1")
        return self

    def options(self) -> dict:
        return dict(self.task_options)

    def shared(self) -> dict:
        """The settings every peer of a run must share (part of the run's fingerprint); the policy is each
        peer's own."""
        return self.model_dump(include={"run", "seed", "rounds", "questions", "completions", "peers"})
