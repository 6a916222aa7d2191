"""Every code block of README.md, CHANGELOG.md and docs/ runs as it is or is checked against the code, unless it says
why it cannot be (an HTML comment ``<!-- illustrative: <reason> -->`` on the line before its fence):

- ```toml: parses as a config through swarmd.node.config's loader, each ``[loops.<name>]`` table validates against
  that loop's settings model, and a task file it names exists;
- ```python: runs in a fresh interpreter from the repository root (snippet includes, ``--8<-- "path"``, are
  expanded first, as the docs build expands them);
- a shell block (```, ```bash, ```sh, ```shell): every command exists with the flags it is given: ``swarmd <command>``
  parsed by click's own parser for that command (its options, their types, choices and ranges; a ``<placeholder>``
  counts as one word), ``python <script>`` against the script, ``pip install`` against
  pyproject's extras; files of the repository it names exist;
- ```text holds output or a table, not code, and is not run.

A block in any other language must be marked illustrative."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.beside, pytest.mark.timeout(170)]

SHELL = {"", "bash", "sh", "shell"}
NOT_CODE = {"text"}
ILLUSTRATIVE = re.compile(r"<!--\s*illustrative:\s*(.*?)\s*-->")
PLACEHOLDER = re.compile(r"<[^<>]*>")
SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$', re.M)
# tools a shell block may call that are not part of this repository; what they are given is not checked here
OTHER_TOOLS = {"pip", "mkdocs", "docker", "curl"}
REPO_DIRS = ("configs/", "examples/", "docker/", "bench/", "tests/", "docs/")
LOOPS = {"diloco": ("swarmd.protocols.diloco", "DilocoConfig"), "spsa": ("swarmd.protocols.spsa", "SpsaConfig"),
         "sapo": ("swarmd.protocols.sapo", "SapoConfig")}


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    illustrative: str | None  # the reason, where the block is marked so

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(`{3,})([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != fence:
            body.append(lines[i])
            i += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = ILLUSTRATIVE.search(prev)
        out.append(Block(path, start + 1, lang, "\n".join(body), mark.group(1) if mark else None))
        i += 1
    return out


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md",
            *sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)]


def expand_snippets(code: str) -> str:
    return SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(), code)


# ---------------------------------------------------------------------------------------------------- checks

def check_toml(block: Block) -> list[str]:
    import importlib

    from swarmd.node.config import ConfigError, load_config

    try:
        tomllib.loads(block.code)
    except tomllib.TOMLDecodeError as e:
        return [f"not TOML: {e}"]
    problems = []
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(block.code)
        f.flush()
        try:
            config = load_config(f.name)
        except ConfigError as e:
            return [f"not a config: {e}"]
    for name, table in config.loops.items():
        if name not in LOOPS:
            problems.append(f"[loops.{name}]: no such loop (one of {sorted(LOOPS)})")
            continue
        module, cls = LOOPS[name]
        try:
            getattr(importlib.import_module(module), cls).model_validate(table)
        except Exception as e:  # pydantic's ValidationError: the message says which setting
            problems.append(f"[loops.{name}]: {e}")
        task = table.get("task", "")
        if ".py:" in task and not (ROOT / task.split(":")[0]).is_file():
            problems.append(f"[loops.{name}] task {task!r}: no such file in the repository")
    return problems


def check_python(block: Block) -> list[str]:
    done = subprocess.run([sys.executable, "-c", expand_snippets(block.code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    return [] if done.returncode == 0 else [f"python block failed: {done.stderr.strip()[-1500:]}"]


def _swarmd_options() -> dict[str, set[str]]:
    import click

    from swarmd.node.cli import cli

    out = {}
    with click.Context(cli) as ctx:
        for name in cli.list_commands(ctx):
            cmd = cli.get_command(ctx, name)
            out[name] = {o for p in cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
            out[name] |= {"-h", "--help"}
    out[""] = {"--version", "--help", "-h"}
    return out


def _parse_as_click_would(command: str, args: list[str]) -> list[str]:
    """Parse a command's arguments with click's own parser (types, choices, ranges, counts), running nothing."""
    import click

    from swarmd.node.cli import cli

    with click.Context(cli, info_name="swarmd") as ctx:
        try:
            cli.get_command(ctx, command).make_context(command, list(args), parent=ctx)
        except click.exceptions.Exit:
            pass  # --help
        except click.ClickException as e:
            return [f"swarmd {command}: {e.format_message()}"]
    return []


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and len(w) > 1 and not re.match(r"-\d", w)]


def _repo_paths(words: list[str]) -> list[str]:
    return [w for w in words if w.startswith(REPO_DIRS) and "<" not in w]


def check_command(words: list[str], options: dict[str, set[str]]) -> list[str]:
    if not words:
        return []
    problems = [f"{p}: no such file in the repository" for p in _repo_paths(words)
                if not (ROOT / p.split(":")[0]).exists()]
    tool, args = words[0], words[1:]
    if tool == "python" and args[:2] == ["-m", "swarmd"]:
        tool, args = "swarmd", args[2:]
    if tool == "swarmd":
        command = next((a for a in args if not a.startswith("-")), "") if args and not args[0].startswith("-") else ""
        if command not in options:
            return problems + [f"swarmd {command}: no such command"]
        problems += [f"swarmd {command} {flag}: no such option" for flag in _flags(args)
                     if flag not in options[command]]
        if command and not problems:
            problems += _parse_as_click_would(command, args[1:])
    elif tool == "python":
        if args[:2] == ["-m", "pytest"]:
            return problems
        script = ROOT / args[0] if args else None
        if script is None or not script.is_file():
            return problems + [f"python {args[:1]}: no such script"]
        source = script.read_text()
        problems += [f"{args[0]} {flag}: the script defines no such option" for flag in _flags(args[1:])
                     if f'"{flag}"' not in source]
    elif tool == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in args:
            m = re.fullmatch(r"\.\[([\w,-]+)\]", word)
            if m:
                problems += [f"pip install: no extra {e!r} in pyproject.toml" for e in m.group(1).split(",")
                             if e not in extras]
    elif tool.startswith(REPO_DIRS):
        pass  # a script of the repository: its existence is checked above
    elif tool not in OTHER_TOOLS:
        problems.append(f"{tool}: not a command these docs may call (swarmd, python, {', '.join(sorted(OTHER_TOOLS))}"
                        ", or a script of the repository); mark the block illustrative if it is not meant to run")
    return problems


def check_shell(block: Block, options: dict[str, set[str]]) -> list[str]:
    problems = []
    for raw in block.code.splitlines():
        line = raw.split("  #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("$ "):
            problems.append(f"{line!r}: a prompt and its output belong in an illustrative block")
            continue
        line = PLACEHOLDER.sub("PLACEHOLDER", line)  # <an address d0 printed>: one word, as a reader would type it
        try:
            words = shlex.split(line)
        except ValueError as e:
            problems.append(f"{line!r}: {e}")
            continue
        command: list[str] = []
        for word in words + ["&&"]:
            if word in ("&&", "||", ";", "|"):
                problems += [f"{line!r}: {p}" for p in check_command(command, options)]
                command = []
            else:
                command.append(word)
    return problems


def check(block: Block, options: dict[str, set[str]]) -> list[str]:
    if block.illustrative is not None:
        return [] if block.illustrative else ["marked illustrative without a reason"]
    if block.lang in NOT_CODE:
        return []
    if block.lang == "toml":
        return check_toml(block)
    if block.lang == "python":
        return check_python(block)
    if block.lang in SHELL:
        return check_shell(block, options)
    return [f"a ```{block.lang} block can be neither run nor checked: mark it <!-- illustrative: reason -->"]


# ---------------------------------------------------------------------------------------------------- tests

def test_every_code_block_runs_or_says_why_not():
    options = _swarmd_options()
    blocks = [b for path in doc_files() for b in blocks_of(path)]
    assert len(blocks) > 50  # the parse found the docs' blocks
    problems = [f"{b.where()} ({b.lang or 'shell'}): {p}" for b in blocks for p in check(b, options)]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The runner fails a block that does not run or names what does not exist."""
    options = _swarmd_options()

    def block(lang: str, code: str, mark: str | None = None) -> Block:
        return Block(tmp_path / "x.md", 1, lang, code, mark)

    assert check(block("toml", "[node]\nswarrm = 'x'\n"), options)  # a misspelt key
    assert check(block("toml", "[loops.diloco]\ninner_stepz = 3\n"), options)  # a loop setting that does not exist
    assert check(block("toml", '[loops.diloco]\ntask = "examples/nope.py:make"\n'), options)
    assert check(block("python", "raise SystemExit(3)"), options)
    assert check(block("", "swarmd start --no-such-flag"), options)
    assert check(block("", "swarmd launch"), options)
    assert check(block("", "swarmd demo --loop adam"), options)  # not one of the loops
    assert check(block("", "swarmd demo --nodes 30"), options)  # out of its range
    assert check(block("", "pip install -e '.[nope]'"), options)
    assert check(block("", "python bench/bench_sim.py --no-such-flag"), options)
    assert check(block("", "swarmd start --config configs/nope.toml"), options)
    assert check(block("yaml", "a: 1"), options)
    assert check(block("", "rm -rf /tmp/x"), options)
    assert check(block("", "x", mark=""), options)
    # and passes what is right
    assert not check(block("", "swarmd start --config configs/local.toml --data-dir /tmp/a"), options)
    assert not check(block("", "swarmd start --bootstrap <an address a printed>"), options)
    assert not check(block("toml", "[loops.spsa]\nwindow = 8\n"), options)
    assert not check(block("yaml", "a: 1", mark="a Prometheus file"), options)
