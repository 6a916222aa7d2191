"""``swarmd export``: a training run's saved weights written to a safetensors file, and, on request, to a
save_pretrained directory with the model rebuilt from a task the user names (never from one the file names).

This module is a composition root (like ``node/cli.py``): it reads checkpoints and rebuilds models with
``protocols/``."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import click

from swarmd.node import datadir
from swarmd.node.cli_common import EXIT_USAGE, LOOPS, Fail, _load


@click.command()
@click.option("--data-dir", help="Data dir of the node (default: platform user data dir).")
@click.option("--loop", type=click.Choice(sorted(LOOPS)), help="Which loop's weights (default: the newest saved).")
@click.option("--out", "out", type=click.Path(dir_okay=False), help="safetensors file to write "
              "(default: <loop>-<run>-round<N>.safetensors here).")
@click.option("--pretrained", type=click.Path(file_okay=False), help="Also write a save_pretrained directory "
              "(transformers models), with the model rebuilt from --config's task or --task.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The TOML config the node ran with: "
              "--pretrained rebuilds the model from its [loops.<loop>] task and task_options.")
@click.option("--task", "task_spec", help="Task to rebuild the model from for --pretrained (file.py:factory, "
              "module:factory or a built-in name); its task_options come from --config's loop table if given.")
def export(data_dir, loop, out, pretrained, config_path, task_spec) -> None:
    """Write the latest saved weights of a training run to a file (works while the node runs or after it ended)."""
    from swarmd.protocols import checkpoint

    if pretrained and not (config_path or task_spec):
        raise Fail("--pretrained rebuilds the model from a task you name: pass --config (the config the node ran "
                   "with) or --task; the task written inside a weights file is never imported", EXIT_USAGE)
    folder = datadir.resolve(data_dir)
    path = checkpoint.latest(folder, loop)
    if path is None:
        raise Fail(f"no saved weights in {folder / checkpoint.DIR}" + (f" for the {loop} loop" if loop else "")
                   + " (a loop saves them every checkpoint_every rounds and at the end)")
    started = time.monotonic()
    try:
        with click.progressbar(length=path.stat().st_size, label=f"reading {path.name}", file=sys.stderr,
                               show_pos=False, show_percent=True) as bar:
            tensors, meta = checkpoint.load(path, progress=bar.update)
    except checkpoint.CheckpointError as e:
        raise Fail(str(e)) from None
    state = checkpoint.model_state(tensors)
    # names from the file only label things: each is reduced to a safe file-name part before it makes a path
    loop_name = loop or (meta.get("loop") if meta.get("loop") in LOOPS else None)
    if loop_name is None:
        raise Fail(f"{path}: names no known loop (pass --loop)")
    run, rnd = safe_name(meta.get("run")), _safe_int(meta.get("round"))
    target = Path(out) if out else Path(f"{loop_name}-{run}-round{rnd}.safetensors")
    info = {k: meta[k] for k in ("loop", "run", "round", "step", "hash", "task", "task_options") if k in meta}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    click.echo(f"writing {nbytes / 1e6:.1f} MB to {target} ...", err=True)
    checkpoint.save(target.resolve(), state, info)
    click.echo(f"wrote {len(state)} tensors of {loop_name} run {run} (round {rnd}) to {target} "
               f"in {time.monotonic() - started:.1f} s")
    if pretrained:
        spec, options = _export_task(config_path, task_spec, loop_name)
        click.echo(f"rebuilding the model of task {spec} to save it with save_pretrained ...", err=True)
        click.echo(f"wrote a save_pretrained directory to "
                   f"{_export_pretrained(spec, options, loop_name, state, Path(pretrained), config_path)}")


def safe_name(value, fallback: str = "run", limit: int = 64) -> str:
    """A name from a file or a peer as one harmless file-name part: letters, digits, '.', '_' and '-' only (no
    separators, so no '../' and no absolute path), no leading dot, at most ``limit`` characters."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "_", value if isinstance(value, str) else "").lstrip(".")[:limit]
    return text or fallback


def _safe_int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**12 else 0


def _export_task(config_path, task_spec, loop_name: str) -> tuple[str, dict]:
    """The task spec and options to rebuild the model from: --task, else the config's [loops.<loop>] table (the
    same table `swarmd start` validates); options from that table when the config has one."""
    table = {}
    if config_path:
        config = _load(config_path, {})
        table = (config.loops or {}).get(loop_name)
        if table is None and not task_spec:
            raise Fail(f"{config_path} has no [loops.{loop_name}] table to rebuild the {loop_name} model from "
                       "(pass --task)", EXIT_USAGE)
        table = table or {}
    import importlib

    from pydantic import ValidationError

    module_name, config_cls, _ = LOOPS[loop_name]
    try:
        cfg = getattr(importlib.import_module(module_name), config_cls)(**{**table, **({"task": task_spec}
                                                                                      if task_spec else {})})
    except ValidationError as e:
        err = e.errors()[0]
        raise Fail(f"invalid loops.{loop_name}{''.join(f'.{x}' for x in err['loc'])}: {err['msg']}",
                   EXIT_USAGE) from None
    return cfg.task, cfg.options()


def _export_pretrained(spec: str, options: dict, loop_name: str, state: dict, directory: Path,
                       config_path: str | None) -> Path:
    """Rebuild the task's model from the spec and options the user named, load the weights, save_pretrained."""
    from swarmd.protocols.task import TaskError, build_model, load, seeded

    try:
        task = load(spec, options, loop_name, Path(config_path).resolve().parent if config_path else None)
        if loop_name == "sapo":
            with seeded(0):
                model = task.call("policy", 0).model
        else:
            model = build_model(task, 0)
    except TaskError as e:
        raise Fail(f"cannot rebuild the model to export: {e}") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k in dict(model.named_parameters())]:
        raise Fail(f"the saved weights do not fit the task's model (missing {missing[:3]}, unexpected "
                   f"{unexpected[:3]})")
    if not (task.has("export_pretrained") or hasattr(model, "save_pretrained")):
        raise Fail(f"{spec} is not a transformers model: --pretrained needs a model with save_pretrained()")
    directory.mkdir(parents=True, exist_ok=True)
    if task.has("export_pretrained"):
        task.call("export_pretrained", model, str(directory))
    else:
        model.save_pretrained(str(directory))
    return directory
