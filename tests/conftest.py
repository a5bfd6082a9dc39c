"""Shared test fixtures: deterministic seeds, the optional GSM8K data folder, a tiny warm start."""

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


@pytest.fixture(scope="session")
def sft_dir(tmp_path_factory):
    """A one-layer warm-start policy for the arithmetic task (seconds to train), made once per session."""
    from nanokl.harness.config.load import load_config
    from nanokl.supervised.sft import train_sft
    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("sft")
    cfg = load_config(root / "configs" / "arith_tiny.yaml",
                      ["sft.steps=40", "sft.num_examples=512", "data.num_val=16", "sft.hidden_size=32",
                       "sft.intermediate_size=64", "sft.num_hidden_layers=1", f"sft.output_dir={out}"])
    train_sft(cfg, progress=False)
    return out
