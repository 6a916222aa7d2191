"""MkDocs hook: the reference pages, generated from the code at every build, so they cannot drift from it.

Each page is made from the thing it documents:

- ``reference/config.md``: every key of the node's config models (``swarmd.node.config``), with the type and the
  default pydantic holds and the meaning from ``configs/default.toml``'s comments (or the model's own comments);
- ``reference/loop-config.md``: the loops' config models (``DilocoConfig``, ``SpsaConfig``, ``SapoConfig``), their
  fields' types, defaults, bounds and the comments written beside them;
- ``reference/cli.md``: every command's help as click prints it;
- ``reference/wire.md``: the wire registry, as ``swarmd wire --json`` prints it;
- ``reference/status.md``: the top-level fields of ``/status`` as ``Node.status`` returns them, with their meanings
  from ``docs/reference/status-fields.toml`` (a field without one fails the build and tests/test_docs.py);
- ``reference/metrics.md``: the Prometheus series ``node/metrics.py`` exports, with their help text;
- ``reference/python-api.md``: every name of ``swarmd.__all__``, from its docstrings (mkdocstrings).

The functions are importable (tests/test_docs.py checks every key, command and field has its entry).
"""

from __future__ import annotations

import ast
import functools
import json
import sys
import tokenize
import tomllib
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATUS_MEANINGS = ROOT / "docs" / "reference" / "status-fields.toml"
LOOP_MEANINGS = ROOT / "docs" / "reference" / "loop-fields.toml"
LOOP_MODELS = (("diloco", "protocols/diloco/config.py", "DilocoConfig", "DiLoCo and Streaming DiLoCo",
                "../loops/diloco.md"),
               ("spsa", "protocols/spsa/config.py", "SpsaConfig", "SPSA", "../loops/spsa.md"),
               ("sapo", "protocols/sapo/config.py", "SapoConfig", "SAPO", "../loops/sapo.md"))


# ---------------------------------------------------------------------------------------------------- comments

def _comments(path: Path) -> dict[int, str]:
    """Line number -> the text of the comment on that line (without '#')."""
    out = {}
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def class_field_comments(path: Path, class_name: str) -> dict[str, str]:
    """Field name -> the comments written for it in the class body: the block of comment lines right above the
    field, then the comment at the end of its line(s)."""
    source = path.read_text()
    comments = _comments(path)
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        trailing = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments
                    and not lines[n - 1].strip().startswith("#")]
        text = " ".join(t for t in above + trailing if t)
        out[stmt.target.id] = text
    return out


def toml_comments(path: Path) -> dict[str, str]:
    """'section.key' -> the comments written for it in a commented TOML file: the block above it and the comment
    at the end of its line, with the indented comment lines that continue that one."""
    out: dict[str, str] = {}
    section, block, last = "", [], None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line:
            block, last = [], None
            continue
        if line.startswith("#"):
            if last is not None and raw.startswith(" "):  # continues the comment of the key above
                out[last] = f"{out[last]} {line.lstrip('#').strip()}".strip()
            else:
                block.append(line.lstrip("#").strip())
                last = None
            continue
        code, _, comment = line.partition("#")
        if code.startswith("["):
            section = code.strip().strip("[]").strip()
            block, last = [], None
            continue
        key = code.split("=", 1)[0].strip()
        name = f"{section}.{key}" if section else key
        out[name] = " ".join(block + [comment.strip()]).strip()
        block, last = [], name
    return out


# ---------------------------------------------------------------------------------------------------- models

def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "min length"),
                           ("max_length", "max length"), ("pattern", "matches")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} `{value}`")
    return ", ".join(parts)


def _default(field):
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        return field.default_factory()
    return None if field.default is PydanticUndefined else field.default


def _show(value) -> str:
    if value is None:
        return "(required)"
    if hasattr(value, "model_dump"):
        return "(table)"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def model_rows(model, comments: dict[str, str], prefix: str = "", toml: dict[str, str] | None = None) -> list[dict]:
    """One row per leaf setting of a pydantic model: key, type, default, bounds, meaning (sub-models expanded)."""
    from pydantic import BaseModel

    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, str):  # a forward reference: resolved on the model
            annotation = typing.get_type_hints(model)[name]
        meaning = (toml or {}).get(key) or comments.get(name, "")
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sub = class_field_comments(Path(sys.modules[annotation.__module__].__file__), annotation.__name__)
            rows.extend(model_rows(annotation, sub, f"{key}.", toml))
            continue
        rows.append({"key": key, "type": _type_name(annotation), "default": _show(_default(field)),
                     "bounds": _bounds(field), "meaning": meaning})
    return rows


def config_rows() -> list[dict]:
    """Every key of the node's configuration (``[node]``, ``[network]``, ...), loops excluded."""
    from swarmd.node import config

    toml = toml_comments(ROOT / "configs" / "default.toml")
    defaults = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    rows = []
    for section, field in config.Config.model_fields.items():
        if section == "loops":
            continue
        model = field.annotation
        comments = class_field_comments(ROOT / "node" / "config.py", model.__name__)
        rows.extend(model_rows(model, comments, f"{section}.", toml))
    for row in rows:  # a default the embedded file sets wins over the model's (network.listen has none there)
        node = defaults
        for part in row["key"].split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            row["default"] = _show(node)
    return rows


def loop_model(module_path: str, class_name: str):
    import importlib

    return getattr(importlib.import_module("swarmd." + module_path.removesuffix(".py").replace("/", ".")), class_name)


def loop_rows(module_path: str, class_name: str) -> list[dict]:
    """A loop's settings; the meaning from the comment beside the field, else from docs/reference/loop-fields.toml.
    ``shared`` marks the settings every peer of a run must share (its fingerprint: ``shared()``)."""
    model = loop_model(module_path, class_name)
    loop = next(name for name, path, cls, *_ in LOOP_MODELS if cls == class_name)
    extra = tomllib.loads(LOOP_MEANINGS.read_text())
    comments = {k: v for k, v in class_field_comments(ROOT / module_path, class_name).items() if v}
    comments = {**extra["common"], **extra.get(loop, {}), **comments}
    rows = model_rows(model, comments)
    shared = set(model().shared())
    for r in rows:
        r["shared"] = r["key"] in shared
    return rows


def _table(rows: list[dict], anchor_prefix: str) -> str:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for r in rows:
        bounds = f" ({r['bounds']})" if r["bounds"] else ""  # a pipe inside a code span does not split a cell
        meaning = (r["meaning"] or "").replace("|", "\\|")
        if r.get("shared"):
            meaning += " *Shared: every peer of the run must use the same value (part of its fingerprint).*"
        out.append(f"| <span id=\"{anchor_prefix}{r['key']}\"></span>`{r['key']}` | {r['type']}{bounds} | "
                   f"{r['default']} | {meaning} |")
    return "\n".join(out)


def config_page() -> str:
    rows = config_rows()
    sections: dict[str, list[dict]] = {}
    for r in rows:
        sections.setdefault(r["key"].rsplit(".", 1)[0], []).append(r)
    parts = ["# Configuration reference", "",
             "Generated at build time from `swarmd.node.config` (types, defaults, bounds) and the comments of "
             "`configs/default.toml`. Settings are read in layers: the embedded `configs/default.toml`, then "
             "`--config FILE`, then CLI flags, then `--set KEY=VALUE`. Unknown keys are errors.", "",
             "The training loops' tables (`[loops.diloco]`, `[loops.spsa]`, `[loops.sapo]`) are in "
             "[Loop settings](loop-config.md).", ""]
    for section, srows in sections.items():
        parts += [f"## `[{section}]`", "", _table(srows, "config-"), ""]
    return "\n".join(parts)


def loop_config_page() -> str:
    parts = ["# Loop settings reference", "",
             "Generated at build time from the loops' pydantic models: each `[loops.<name>]` table of a config "
             "file is validated by its loop when the node starts (unknown keys are errors).", ""]
    for name, path, cls, title, guide in LOOP_MODELS:
        parts += [f"## `[loops.{name}]`: {title}", "",
                  f"`{cls}` in `{path}`; what the loop does with them: [{title}]({guide}).", "",
                  _table(loop_rows(path, cls), f"{name}-"), ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- CLI

def cli_commands() -> dict[str, str]:
    """Command name -> its help text as click renders it (``swarmd <command> --help``)."""
    import click

    from swarmd.node.cli import cli

    out = {}
    with click.Context(cli, info_name="swarmd", terminal_width=110, max_content_width=110) as ctx:
        out[""] = cli.get_help(ctx)
        for name in cli.list_commands(ctx):
            cmd = cli.get_command(ctx, name)
            with click.Context(cmd, info_name=name, parent=ctx, terminal_width=110, max_content_width=110) as sub:
                out[name] = cmd.get_help(sub)
    return out


def cli_page() -> str:
    commands = cli_commands()
    parts = ["# Command line reference", "",
             "Generated at build time from the commands' own help (`swarmd <command> --help`).", "",
             "```text", commands.pop(""), "```", ""]
    for name, text in commands.items():
        parts += [f"## `swarmd {name}`", "", "```text", text, "```", ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- wire

@functools.cache
def wire_rows() -> list[dict]:
    """The registry's table, as ``swarmd wire --json`` prints it: the CLI's own list of the modules that declare
    messages is imported, then the registry read."""
    import importlib

    from swarmd.node.cli import WIRE_MODULES
    from swarmd.transport.wire import WIRE

    for module in WIRE_MODULES:
        importlib.import_module(module)
    return WIRE.table()


def wire_page() -> str:
    rows = wire_rows()
    parts = ["# Wire messages reference", "",
             f"Generated at build time from the registry (`swarmd wire --json`, `transport/wire.py`): "
             f"{len(rows)} kinds. Each message is declared once: its carrier (a stream protocol and its kind byte, "
             "a pubsub topic, or another carrier), its version, its size limit, its signing domain and its schema. "
             "A kind or version a node does not know is ignored and counted (`unknown_kind`); a known kind that "
             "breaks its schema is refused and penalises its sender.", "",
             "| carrier | kind | version | name | max bytes | signed |", "|---|---|---|---|---|---|"]
    for r in rows:
        parts.append(f"| `{r['carrier']}` | {r['kind']} | v{r['version']} | [`{r['name']}`](#{_slug(r['name'])}) | "
                     f"{r['max_bytes']:,} | {('`' + r['signed'] + '`') if r['signed'] else ''} |")
    parts.append("")
    for r in rows:
        parts += [f"## {r['name']}", "", f"`{r['carrier']}`, kind {r['kind']}, version {r['version']}, at most "
                  f"{r['max_bytes']:,} bytes{', signed in domain `' + r['signed'] + '`' if r['signed'] else ''}.",
                  "", r["doc"] or "", "", "```text", r["schema"], "```", ""]
    return "\n".join(parts)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "" for c in name.lower())


def protocol_ids() -> set[str]:
    """The versioned stream protocols in the registry, e.g. ``/swarmd/crdt/2.0.0``."""
    return {r["carrier"] for r in wire_rows() if r["carrier"].startswith("/")}


# ---------------------------------------------------------------------------------------------------- /status

def status_fields() -> list[str]:
    """The top-level keys of ``/status``: the dict literal ``Node.status`` returns (``NodeViews.status``,
    node/status.py)."""
    tree = ast.parse((ROOT / "node" / "status.py").read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "status":
                ret = next(n for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
                return [k.value for k in ret.value.keys if isinstance(k, ast.Constant)]
    raise LookupError("NodeViews.status not found in node/status.py")


LOOP_SOURCES = {"diloco": "protocols/diloco", "spsa": "protocols/spsa", "sapo": "protocols/sapo"}


def _loop_sources(loop: str) -> list[Path]:
    """A loop's source files: its module, or every module of its package."""
    path = ROOT / LOOP_SOURCES[loop]
    return sorted(path.glob("*.py")) if path.is_dir() else [path]


def _returned_keys(paths: Path | list[Path], method: str) -> list[str]:
    """The constant keys of the dict literal a method returns (the first class in the files that defines it)."""
    for path in [paths] if isinstance(paths, Path) else paths:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name == method:
                ret = next(n for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
                return [k.value for k in ret.value.keys if isinstance(k, ast.Constant)]
    raise LookupError(f"{method} not found in {paths}")


def loop_status_fields(loop: str) -> list[str]:
    """``/status`` → ``services.<loop>``: the fields the loop's ``status()`` names, and those every loop adds
    (``TaskLoop._task_status``)."""
    own = _returned_keys(_loop_sources(loop), "status")
    return own + [k for k in _returned_keys(ROOT / "protocols" / "taskloop.py", "_task_status") if k not in own]


def loop_counters(loop: str) -> list[str]:
    """The counters a loop's ``status()`` lists beside its fields (``self.counters["..."]`` in its module)."""
    import re

    text = "".join(p.read_text() for p in _loop_sources(loop))
    return sorted(set(re.findall(r'self\.counters\["(\w+)"\]', text)))


def status_meanings() -> dict[str, str]:
    return tomllib.loads(STATUS_MEANINGS.read_text())["fields"]


def status_page() -> str:
    fields, meanings = status_fields(), status_meanings()
    missing = [f for f in fields if f not in meanings]
    if missing:
        raise ValueError(f"/status fields without a meaning in {STATUS_MEANINGS.relative_to(ROOT)}: {missing}")
    parts = ["# /status fields reference", "",
             "`GET /status` on the node's HTTP endpoint (`http.listen`, default `127.0.0.1:8470`) answers one JSON "
             "object. Its top-level fields, generated at build time from `Node.status` (`node/status.py`), with "
             "their meanings from `docs/reference/status-fields.toml`. Each training loop's own fields are under "
             "`services.<loop>`: see its guide ([DiLoCo](../loops/diloco.md), [SPSA](../loops/spsa.md), "
             "[SAPO](../loops/sapo.md)).", "", "| field | meaning |", "|---|---|"]
    for f in fields:
        parts.append(f"| <span id=\"status-{f}\"></span>`{f}` | {meanings[f]} |")
    for loop, title in (("diloco", "DiLoCo"), ("spsa", "SPSA"), ("sapo", "SAPO")):
        parts += ["", f"## `services.{loop}`", "",
                  f"Fields (their meanings: [{title}](../loops/{loop}.md#what-status-shows)): "
                  + ", ".join(f"`{k}`" for k in loop_status_fields(loop)) + ".", "",
                  "Counters beside them: " + ", ".join(f"`{k}`" for k in loop_counters(loop)) + "."]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------- /metrics

def metric_rows() -> list[dict]:
    """Every series node/metrics.py exports: name, kind, help (counters get Prometheus' ``_total`` suffix)."""
    tree = ast.parse((ROOT / "node" / "metrics.py").read_text())
    rows = []
    for node in ast.walk(tree):
        kind = getattr(getattr(node, "func", None), "id", "")
        if isinstance(node, ast.Call) and kind in ("GaugeMetricFamily", "CounterMetricFamily", "InfoMetricFamily"):
            name, doc = (ast.literal_eval(a) for a in node.args[:2])
            suffix, kind = {"CounterMetricFamily": ("_total", "counter"), "InfoMetricFamily": ("_info", "info"),
                            "GaugeMetricFamily": ("", "gauge")}[kind]
            labels = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "labels"), [])
            value = next((k.value for k in node.keywords if k.arg == "value"), None)
            if suffix == "_info" and isinstance(value, ast.Dict):
                labels = [k.value for k in value.keys if isinstance(k, ast.Constant)]
            rows.append({"name": name + suffix, "kind": kind, "labels": labels, "help": doc})
        elif isinstance(node, ast.Tuple) and len(node.elts) == 4 and all(isinstance(e, ast.Constant)
                                                                          for e in node.elts):
            key, name, doc, counter = (e.value for e in node.elts)
            if isinstance(name, str) and name.startswith("swarmd_loop_"):
                rows.append({"name": name + ("_total" if counter else ""), "kind": "counter" if counter else "gauge",
                             "labels": ["loop", "run"], "help": f"{doc} (`/status` → `services.<loop>.{key}`)"})
    return rows


def metrics_page() -> str:
    parts = ["# /metrics series reference", "",
             "`GET /metrics` answers Prometheus text. Generated at build time from `node/metrics.py`. "
             "`docker/grafana/swarmd.json` is a Grafana dashboard on these series.", "",
             "| series | type | labels | meaning |", "|---|---|---|---|"]
    for r in metric_rows():
        labels = ", ".join(f"`{label}`" for label in r["labels"])
        parts.append(f"| `{r['name']}` | {r['kind']} | {labels} | {r['help']} |")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------- Python API

def api_names() -> dict[str, str]:
    """The public API: each name of ``swarmd.__all__`` and the module that defines it (``swarmd._EXPORTS``)."""
    import swarmd

    return {name: swarmd._EXPORTS[name] for name in swarmd.__all__ if name in swarmd._EXPORTS}


def python_api_page() -> str:
    parts = ["# Python API reference", "",
             "Generated at build time from the docstrings by mkdocstrings, one entry for each name of "
             "`swarmd.__all__`. The names load on first use, so `import swarmd` does not import torch. How to use "
             "them in a training script: [Train inside your own script](../guides/python-api.md).", "",
             "::: swarmd", "    options:", "      show_root_heading: false", "      members: false", ""]
    for name, module in sorted(api_names().items()):
        parts += [f"::: {module}.{name}", "    options:", "      show_root_heading: true",
                  "      show_root_full_path: false", "      heading_level: 2", ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------- the hook

PAGES = {
    "reference/config.md": config_page,
    "reference/loop-config.md": loop_config_page,
    "reference/cli.md": cli_page,
    "reference/wire.md": wire_page,
    "reference/status.md": status_page,
    "reference/metrics.md": metrics_page,
    "reference/python-api.md": python_api_page,
}


def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    return files
