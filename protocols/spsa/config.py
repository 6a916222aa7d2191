"""``SpsaConfig``: the ``[loops.spsa]`` table."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from swarmd.protocols.spsa.weights import PERTURBATION
from swarmd.protocols.standing import check_peer_ids

# the built-in task's options when the config names none: the tiny GPT pretrained on generated text, fine-tuned on
# a shifted domain
DEFAULT_TASK_OPTIONS = {"domain": "target", "pretrain_steps": 200, "seed": 1}


class SpsaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    run: str = Field("spsa-demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    task: str = "tinygpt"  # "path/to/file.py:factory", "package.module:factory" or a built-in name
    task_options: dict | None = None  # keyword arguments of the task's factory (default: the built-in's, above)
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    threads: int = Field(0, ge=0, le=4096)  # torch's CPU threads for the loop's compute (0: auto, protocols.task)
    checkpoint_every: int = Field(8, ge=0)  # windows between checkpoints (0: only at the end)
    base_seed: int = 1  # the seed the task's model is built under (every peer builds the same base)
    steps: int = Field(200, ge=0, le=10**12)  # 0: until stopped
    window: int = Field(96, ge=1, le=4096)  # steps per signed message (and the lag of application)
    eps: float = Field(1e-3, gt=0)
    lr: float = Field(1e-3, gt=0)
    clip: float = Field(100.0, gt=0)
    min_peers: int = Field(1, ge=1)  # wait for this many participants (us included) before window 0
    deadline: float = Field(10.0, gt=0)  # seconds to wait for a window's batches after ours is out
    hash_every: int = Field(8, ge=1)  # windows between weight-hash announcements
    eval_every: int = Field(2, ge=1)  # windows between evaluations
    peers: list[str] = Field([], max_length=10_000)  # a closed run: only these peer ids take part (empty: open)
    # audits (tasks with batch_at only): each window, re-probe audit_steps random steps of up to audit_peers random
    # peers, and refuse a peer whose bytes are not what its step gives (0: no audits). Each re-probe costs what one
    # step of ours does; a local choice, not shared
    audit_peers: int = Field(8, ge=0, le=256)
    audit_steps: int = Field(2, ge=1, le=64)

    _peers = field_validator("peers")(check_peer_ids)

    def options(self) -> dict:
        return dict(self.task_options) if self.task_options is not None else (
            dict(DEFAULT_TASK_OPTIONS) if self.task == "tinygpt" else {})

    def shared(self) -> dict:
        """The settings every peer of a run must share (part of the run's fingerprint)."""
        return {**self.model_dump(include={"run", "base_seed", "steps", "window", "eps", "lr", "clip", "peers"}),
                "perturbation": PERTURBATION}
