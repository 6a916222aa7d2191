"""ruff over the whole repository, with the rules pyproject.toml configures (pycodestyle errors and warnings,
line length included, and pyflakes): a lint error fails the suite like any other."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_ruff_passes_on_the_whole_repository():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    result = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
