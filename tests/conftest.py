"""Shared test fixtures: deterministic seeds and the optional GSM8K data folder."""

from pathlib import Path

import pytest
import torch

# Tests read the real GSM8K files from the shared folder beside the checkout when present.
GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def gsm8k_dir():
    if not (GSM8K_DIR / "test.jsonl").exists():
        pytest.skip(f"GSM8K data not found at {GSM8K_DIR}")
    return GSM8K_DIR
