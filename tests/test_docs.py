"""The documentation stays true: the site builds in strict mode (a broken link, a missing page, a name mkdocstrings
cannot find fails it), the README stays a short front door whose links lead somewhere, every config key, loop
setting, CLI command and /status field has its reference entry, and the changelog agrees with the wire registry
and the version number."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import swarmd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))

import reference  # noqa: E402  (docs/hooks/reference.py: the generator of the reference pages)

pytestmark = [pytest.mark.beside, pytest.mark.timeout(170)]

README_MAX_LINES = 300


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=160,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_the_docs_build_in_strict_mode_with_every_reference_page(site):
    for page in ("reference/config", "reference/loop-config", "reference/cli", "reference/wire", "reference/status",
                 "reference/metrics", "reference/python-api", "changelog"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "reference" / "python-api" / "index.html").read_text()
    assert "__version__" in api or "swarmd" in api
    # the changelog page is the CHANGELOG file itself, not a copy that could drift
    assert "0.2.0" in (site / "changelog" / "index.html").read_text()


def test_the_python_api_reference_has_every_public_name(site):
    names = reference.api_names()
    assert set(names) == set(swarmd.__all__) - {"__version__"}
    page = (site / "reference" / "python-api" / "index.html").read_text()
    for name, module in names.items():
        assert f"::: {module}.{name}" in reference.python_api_page()
        assert f'id="{module}.{name}"' in page, f"mkdocstrings rendered no entry for swarmd.{name}"


def test_readme_is_a_short_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    # the two commands at the top, exactly (.ci/run runs the second)
    assert "pip install -e . && swarmd demo" in text
    assert "pip install -e '.[test]' && python -m pytest" in text
    assert "pip install -e '.[test]' && python -m pytest" in (ROOT / ".ci" / "run").read_text()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "the README carries no dates: they belong in CHANGELOG.md"


def test_guides_design_and_reference_pages_carry_no_dates():
    """Dates belong to the changelog and the benchmark pages (each table with the date it was measured)."""
    for page in (ROOT / "docs").rglob("*.md"):
        if "benchmarks" in page.parts:
            continue
        found = re.findall(r"\b20\d\d-\d\d-\d\d\b", page.read_text())
        assert not found, f"{page.relative_to(ROOT)} carries dates {found}: history goes to CHANGELOG.md"


def _links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", path.read_text())


def test_every_relative_link_of_the_readme_leads_to_a_file_and_its_heading():
    for link in _links(ROOT / "README.md"):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+\s+(.*)$", path.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"README.md links to {link}: no such heading in {target}"


def test_every_config_key_has_a_reference_entry_with_a_meaning():
    rows = {r["key"]: r for r in reference.config_rows()}
    defaults = tomllib.loads((ROOT / "configs" / "default.toml").read_text())

    def leaves(table, prefix=""):
        for key, value in table.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    for key in leaves(defaults):
        assert key in rows, f"configs/default.toml's {key} has no entry in the configuration reference"
    from swarmd.node import config

    for section, field in config.Config.model_fields.items():
        if section != "loops":
            for name in field.annotation.model_fields:
                assert any(k == f"{section}.{name}" or k.startswith(f"{section}.{name}.") for k in rows), name
    unexplained = [k for k, r in rows.items() if not r["meaning"]]
    assert not unexplained, f"config keys with no comment in configs/default.toml or node/config.py: {unexplained}"


def test_every_loop_setting_has_a_reference_entry_with_a_meaning():
    page = reference.loop_config_page()
    extra = tomllib.loads(reference.LOOP_MEANINGS.read_text())
    for loop, path, cls, _, _ in reference.LOOP_MODELS:
        rows = reference.loop_rows(path, cls)
        fields = list(reference.loop_model(path, cls).model_fields)
        assert [r["key"] for r in rows] == fields
        for r in rows:
            assert f"`{r['key']}`" in page
            assert r["meaning"], f"[loops.{loop}] {r['key']}: no comment in {path} nor docs/reference/loop-fields.toml"
        stale = [k for k in extra.get(loop, {}) if k not in fields]
        assert not stale, f"docs/reference/loop-fields.toml explains [loops.{loop}] settings that are gone: {stale}"


def test_every_cli_command_and_its_flags_are_in_the_reference():
    import click

    from swarmd.node.cli import cli

    page = reference.cli_page()
    with click.Context(cli) as ctx:
        for name in cli.list_commands(ctx):
            assert f"## `swarmd {name}`" in page
            for param in cli.get_command(ctx, name).params:
                for opt in getattr(param, "opts", []):
                    if opt.startswith("--"):
                        assert opt in page, f"swarmd {name} {opt} is not in the CLI reference"


def test_every_status_field_has_a_reference_entry():
    fields = reference.status_fields()
    assert {"peer_id", "services", "crdt", "peers"} <= set(fields)  # the parse found Node.status's dict
    meanings = reference.status_meanings()
    missing = [f for f in fields if f not in meanings]
    assert not missing, f"/status fields with no meaning in docs/reference/status-fields.toml: {missing}"
    stale = [f for f in meanings if f not in fields]
    assert not stale, f"docs/reference/status-fields.toml explains fields /status no longer has: {stale}"


def test_every_field_a_loop_shows_in_status_is_explained_on_its_page():
    for loop in ("diloco", "spsa", "sapo"):
        fields = reference.loop_status_fields(loop)
        assert {"state", "round", "task", "offenders"} <= set(fields)  # the parse found the status dict
        page = (ROOT / "docs" / "loops" / f"{loop}.md").read_text()
        section = page[page.index("## What `/status` shows"):]
        missing = [f for f in fields if f"`{f}`" not in section]
        assert not missing, f"docs/loops/{loop}.md does not explain /status -> services.{loop} fields {missing}"


def test_every_metric_is_in_the_reference():
    names = {r["name"] for r in reference.metric_rows()}
    source = (ROOT / "node" / "metrics.py").read_text()
    for name in set(re.findall(r'"(swarmd_[a-z_]+)"', source)):
        assert name in names or f"{name}_total" in names, name


def _release(version: str) -> str:
    text = (ROOT / "CHANGELOG.md").read_text()
    match = re.search(rf"^## \[{re.escape(version)}\].*?(?=^## \[|\Z)", text, re.M | re.S)
    assert match, f"CHANGELOG.md has no section for {version}"
    return match.group(0)


def test_one_version_number_and_the_changelog_has_its_release():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    from swarmd.node import __version__ as node_version

    assert pyproject == swarmd.__version__ == node_version
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", text, re.M)
    assert releases[0] == swarmd.__version__, "the newest release in CHANGELOG.md is not the package's version"
    for section in re.findall(r"^### (\w+)", text, re.M):
        assert section in {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, section


def test_the_latest_release_names_exactly_the_wire_the_registry_declares():
    rows = reference.wire_rows()
    protocols = {r["carrier"] for r in rows if r["carrier"].startswith("/swarmd/")}
    kinds = {f"`{r['name']}` v{r['version']}" for r in rows if r["version"] > 1}
    wire = re.search(r"^Wire[^:]*:(.*?)(?=^###|\Z)", _release(swarmd.__version__), re.M | re.S).group(1)
    assert set(re.findall(r"`(/swarmd/[^`]+)`", wire)) == protocols
    assert set(re.findall(r"`[a-z-]+\.[a-z-]+` v\d+", wire)) == kinds


def test_every_bench_has_a_benchmark_page_with_command_machine_and_date():
    pages = {p: p.read_text() for p in (ROOT / "docs" / "benchmarks").glob("*.md")}
    for bench in sorted((ROOT / "bench").glob("bench_*.py")):
        page = next((p for p, text in pages.items() if f"`bench/{bench.name}`" in text.splitlines()[0]), None)
        assert page is not None, f"{bench.name} has no page in docs/benchmarks/ (its title names the script)"
        text = pages[page]
        for what in ("**Command:**", "**Machine:**", "**Date:**"):
            assert what in text, f"{page.name} does not say its {what.strip('*:')}"
