"""The distribution installs one import name, ``swarmd``, with every folder of the repository that holds code: a
subpackage missing from pyproject.toml's list works in an editable install and is absent from the wheel."""

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.beside  # reads files only

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("node", "dht", "crdt", "transport", "protocols", "configs")


def test_every_code_folder_is_a_listed_subpackage_of_swarmd():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(setup["packages"]), setup["package-dir"]
    found = {"swarmd"}
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add("swarmd." + ".".join(init.parent.relative_to(ROOT).parts))
    assert listed == found, f"pyproject lists {sorted(listed - found)}; misses {sorted(found - listed)}"
    for package in listed:
        folder = "swarmd" if package == "swarmd" else package.removeprefix("swarmd.").replace(".", "/")
        assert dirs.get(package) == folder, package
    stray = [p.parent.name for p in (ROOT / "swarmd").glob("*/__init__.py")]
    assert not stray, f"swarmd/ holds the front door only, not subpackages: {stray}"
