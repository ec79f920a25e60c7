import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # tiny_families
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    """Which end of the TRL / transformers window this run is on (scripts/test runs both)."""
    from importlib.metadata import version

    return f"notebooks on trl {version('trl')}, transformers {version('transformers')}"
