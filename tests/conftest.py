import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests are derandomized: every run explores the same examples, so a red CI is reproducible and never a
# matter of luck. (Run with --hypothesis-profile=explore to search with fresh randomness.)
settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=1000)
settings.load_profile("default")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarmproc import Swarm  # noqa: E402


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.close()
