"""Weights that outlive the node: each loop's canonical weights in the data dir, as safetensors (never pickle).

One file per loop and run, ``<data dir>/checkpoints/<loop>-<run>.safetensors``, replaced atomically (written to a
temporary file, fsync'd, renamed, the directory fsync'd): a crash leaves the old file or the new one, never half of
one. Tensors named ``model.<parameter name>`` are the model's weights (what ``swarmd export`` writes out); others
(``outer.<n>``, ``state.<name>``, DiLoCo's ``feedback.<n>``) are the loop's own state. The metadata (strings) says
which loop, run, round and step, the weights' hash, the run's fingerprint, and how to rebuild the task (spec and
options), so a file can be checked before it is used. The task named there is only a label: nothing imports it
(`swarmd export --pretrained` rebuilds the model from the user's config or --task, never from a file).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from swarmd.transport.files import replace_durably, write_durably

MODEL_PREFIX = "model."
DIR = "checkpoints"


class CheckpointError(Exception):
    """A checkpoint that cannot be read or does not belong to this run."""


def path_for(data_dir: Path, loop: str, run: str) -> Path:
    return Path(data_dir) / DIR / f"{loop}-{run}.safetensors"


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write ``tensors`` and ``meta`` (JSON-able values) atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    flat = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    metadata = {k: json.dumps(v) for k, v in {**meta, "saved_at": time.time()}.items()}
    save_file(flat, str(tmp), metadata=metadata)
    replace_durably(tmp, path)


def save_marker(path: Path, value: dict) -> None:
    """A small JSON record of the loop's own (what it did since its last checkpoint), atomically: a crash leaves the
    old record or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_durably(path, json.dumps(value).encode())


def load_marker(path: Path) -> dict | None:
    """The record ``save_marker`` wrote (None: none, or unreadable)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_meta(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
        return {k: json.loads(v) for k, v in raw.items()}
    except (OSError, SafetensorError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e})") from None


def load(path: Path, progress=None) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and meta of a checkpoint; ``progress(bytes)`` is called after each tensor read, if given."""
    try:
        if progress is None:
            tensors = load_file(str(path))
        else:
            from safetensors import safe_open

            tensors = {}
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
                    progress(tensors[key].numel() * tensors[key].element_size())
    except (OSError, SafetensorError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e})") from None
    return tensors, read_meta(path)


def model_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(MODEL_PREFIX):]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}


def latest(data_dir: Path, loop: str | None = None) -> Path | None:
    """The most recently written checkpoint in a data dir (of ``loop`` if given)."""
    folder = Path(data_dir) / DIR
    files = [p for p in folder.glob("*.safetensors") if loop is None or p.name.startswith(f"{loop}-")]
    return max(files, key=lambda p: p.stat().st_mtime, default=None)


OPT_PREFIX = "optimizer."  # an optimizer's per-parameter state: optimizer.<param index>.<name>


def optimizer_entries(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's state as tensors (``optimizer.<i>.<name>``, on the CPU) and JSON-able meta (its class, the
    param groups' settings, non-tensor state), for :func:`save`; :func:`restore_optimizer` takes them back."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{OPT_PREFIX}{idx}.{name}"] = value.detach().to("cpu").clone()
            else:
                scalars[f"{idx}.{name}"] = value
    groups = [{k: (float(v) if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in sd["param_groups"]]
    return tensors, {"class": type(opt).__name__, "param_groups": groups, "scalars": scalars}


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Load what :func:`optimizer_entries` saved into ``opt`` (an optimizer of the same class over the same
    parameters, grouped the same way): its per-parameter state (moments, step counts) comes back; its settings (lr,
    betas, weight decay: the param groups' values) stay ``opt``'s, those of the config or task it was built from
    now, so a restart with a changed setting takes it. Raises ValueError when it does not fit; ``opt`` is then
    unchanged."""
    if not isinstance(meta, dict) or meta.get("class") != type(opt).__name__:
        raise ValueError(f"saved for {meta.get('class') if isinstance(meta, dict) else '?'}, "
                         f"not {type(opt).__name__}")
    current = opt.state_dict()["param_groups"]
    saved_groups = meta.get("param_groups")
    if (not isinstance(saved_groups, list) or len(saved_groups) != len(current)
            or any(not isinstance(g, dict) or len(g.get("params") or ()) != len(c["params"])
                   for g, c in zip(saved_groups, current))):
        raise ValueError("saved for other parameter groups")
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith(OPT_PREFIX):
            idx, _, name = key[len(OPT_PREFIX):].partition(".")
            state.setdefault(int(idx), {})[name] = value
    for key, value in (meta.get("scalars") or {}).items():
        idx, _, name = key.partition(".")
        state.setdefault(int(idx), {})[name] = value
    for idx, entries in state.items():
        if not 0 <= idx < len(params):
            raise ValueError(f"state for parameter {idx}, the optimizer has {len(params)}")
        for name, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != params[idx].shape:
                raise ValueError(f"parameter {idx}'s {name} has shape {tuple(value.shape)}, the parameter "
                                 f"{tuple(params[idx].shape)}")
    try:
        opt.load_state_dict({"state": state, "param_groups": current})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
