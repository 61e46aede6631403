import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()
logging.disable_progress_bar()

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
FIXTURE_MODEL = SHARED / "minilm-movie-sentiment"
FIXTURE_DATA = SHARED / "movie-snippets"


@pytest.fixture(scope="session")
def fixture_model_path() -> Path:
    if not FIXTURE_MODEL.exists():
        pytest.fail(f"the shared fixture is missing at {FIXTURE_MODEL}; clone the repo beside ../shared")
    return FIXTURE_MODEL


@pytest.fixture(scope="session")
def fixture_data_path() -> Path:
    if not FIXTURE_DATA.exists():
        pytest.fail(f"the shared fixture data is missing at {FIXTURE_DATA}")
    return FIXTURE_DATA


FAST = [
    "--set",
    "data.eval_examples=300",
    "--set",
    "evaluation.speed.repeats=2",
    "--set",
    "evaluation.speed.batch_size=8",
    "--set",
    "evaluation.speed.seq_len=64",
    "--set",
    "recovery.epochs=1",  # tuning's epochs are tested in test_recovery.py; four here were half the run's time
]


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
