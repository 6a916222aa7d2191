"""Imports flow one way: protocols -> node services -> dht -> transport; crdt imports nothing of ours.

Checked statically over every module, so a wrong import fails the suite before it becomes a cycle."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"node", "dht", "crdt", "transport", "protocols", "configs", "swarmd"}
FOLDERS = PACKAGES - {"swarmd"}  # the repository's folders; ``swarmd/`` itself holds the library's front door

# package -> packages of ours it may import
ALLOWED = {
    "transport": {"transport"},
    "crdt": {"crdt"},
    "dht": {"dht", "transport"},
    "node": {"node", "dht", "transport", "crdt", "configs"},
    "protocols": {"protocols", "node", "dht", "transport", "crdt"},
    # the Python API (swarmd.Node, swarmd.DiLoCo): a composition root like the CLI, above every layer
    "swarmd": PACKAGES,
}
# may import protocols to plug loops in: the CLI (its commands that run nodes and export weights) and the simulator
COMPOSITION_ROOTS = {"node/cli.py", "node/cli_run.py", "node/cli_export.py", "node/__main__.py", "node/sim.py",
                     "node/sim_node.py", "node/sim_loops.py"}
PROTOCOLS_MAY_USE_FROM_NODE = {"node.services", "node"}
TORCH_ALLOWED = {"protocols", "swarmd"}


def imports_of(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _ours(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield _ours(node.module)


def _ours(name: str) -> str:
    """``swarmd.node.core`` -> ``node.core``: the installed package maps the repository's folders under ``swarmd``."""
    return name if name == "swarmd" else name.removeprefix("swarmd.")


def test_import_directions():
    problems = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name in imports_of(path):
                top = name.split(".")[0]
                if top == "torch" and package not in TORCH_ALLOWED:
                    problems.append(f"{rel} imports torch (only protocols/ may)")
                if top not in PACKAGES or top in allowed:
                    if package == "protocols" and top == "node" and name not in PROTOCOLS_MAY_USE_FROM_NODE:
                        problems.append(f"{rel} imports {name}: protocols use node.services only")
                    continue
                if top == "protocols" and rel in COMPOSITION_ROOTS:
                    continue
                problems.append(f"{rel} imports {name}")
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_import_linter_contracts_hold(tmp_path):
    """The same layering, checked by import-linter from the contracts in pyproject.toml (transitive imports
    included, which the check above does not follow). import-linter reads a package from one folder, while the
    repository keeps ``swarmd``'s subpackages in folders of their own: the check runs on a copy laid out as
    installed."""
    tree = tmp_path / "swarmd"
    shutil.copytree(ROOT / "swarmd", tree, ignore=shutil.ignore_patterns("__pycache__"))
    for package in sorted(FOLDERS):
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    result = subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "4 kept, 0 broken" in result.stdout, result.stdout[-4000:]
