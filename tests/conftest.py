import os
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
