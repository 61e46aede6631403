import os

# before anything imports huggingface_hub (tiny_models imports transformers), which reads these once: offline,
# a hub lookup fails at once instead of after its retries' back-off
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from tiny_models import FAST  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings("ignore")

from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()
logging.disable_progress_bar()

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
FIXTURE_MODEL = SHARED / "minilm-movie-sentiment"
FIXTURE_DATA = SHARED / "movie-snippets"


MISSING = f"needs the fine-tuned fixtures at {SHARED} (clone the repo beside ../shared)"
# CI has the fixtures: there a missing one fails the run instead of skipping its tests
REQUIRED = os.environ.get("PRUNE_HEADS_REQUIRE_FIXTURES") == "1"
USES_FIXTURES = {"fixture_model_path", "fixture_data_path", "fixture_run"}


def pytest_configure(config):
    if REQUIRED and not SHARED.exists():
        raise pytest.UsageError(f"PRUNE_HEADS_REQUIRE_FIXTURES=1, but the run {MISSING}")


def pytest_collection_modifyitems(config, items):
    """Tests that read ../shared/fixtures are marked `fixtures`; without the folder they skip, saying so."""
    for item in items:
        if USES_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.fixtures)
        if item.get_closest_marker("fixtures") and not SHARED.exists():
            item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def fixture_model_path() -> Path:
    return FIXTURE_MODEL


@pytest.fixture(scope="session")
def fixture_data_path() -> Path:
    return FIXTURE_DATA


@pytest.fixture(scope="session")
def fixture_run(tmp_path_factory, fixture_model_path):
    """`prune-heads run fixture-minilm-sentiment` in a real subprocess, as a user runs it."""
    out = tmp_path_factory.mktemp("run") / "pruned"
    proc = subprocess.run(
        [sys.executable, "-m", "prune_heads.cli", "run", "fixture-minilm-sentiment", "-o", str(out), *FAST],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc
