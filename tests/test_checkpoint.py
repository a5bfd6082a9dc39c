"""Verified checkpoints: a manifest of every file's size and SHA-256, checked before a resume.

A truncated or altered file, or garbage trainer / optimizer state, is found and named: `resume_mode=auto`
skips that checkpoint with a one-line warning and resumes from the newest one that verifies, an explicit
`resume_from_path` stops with one line and exit status 2, and retention never deletes the last good one.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanokl.harness.checkpoint import MANIFEST, latest_checkpoint, load_state, save_checkpoint, verify_checkpoint
from nanokl.harness.config.yaml_io import UserError

ROOT = Path(__file__).resolve().parents[1]


def save(run_dir, step, keep=None):
    """A checkpoint of optimizer and trainer state only (the weights' files are checked the same way)."""
    return save_checkpoint(run_dir, step, {}, {"actor": {"w": torch.full((4,), float(step))}},
                           {"kl_ctrl": {"value": 0.1}, "rng": {"torch": torch.get_rng_state()}}, keep=keep)


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    ckpt = save(tmp_path, 2)
    entries = json.loads((ckpt / MANIFEST).read_text())["files"]
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(entries) == files == ["optim.pt", "trainer_state.pt"]
    for name, e in entries.items():
        data = (ckpt / name).read_bytes()
        assert e == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(ckpt) is None


def test_a_checkpoint_from_before_manifests_is_still_resumed(tmp_path, capsys):
    """No lost work on upgrade: a run whose checkpoints predate manifests resumes from its newest, with
    a warning; one that verifies always wins over it."""
    old = save(tmp_path, 2)
    (old / MANIFEST).unlink()
    assert latest_checkpoint(tmp_path) == old and "no manifest" in capsys.readouterr().err
    new = save(tmp_path, 4)
    assert latest_checkpoint(tmp_path) == new and capsys.readouterr().err == ""
    (new / MANIFEST).unlink()
    assert latest_checkpoint(tmp_path, warn=False) == new  # the newest of the unverified ones


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_auto_resume_skips_a_damaged_checkpoint_and_names_the_file(tmp_path, capsys, damage):
    save(tmp_path, 2)
    new = save(tmp_path, 4)
    target = new / "optim.pt"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[:len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "delete":
        target.unlink()
    else:
        (new / MANIFEST).write_text("{not json")
        target = new / MANIFEST
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_2"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("checkpoint global_step_4 skipped: ") and str(target) in err[0]
    assert verify_checkpoint(new) is not None


def test_no_good_checkpoint_means_a_fresh_start(tmp_path):
    ckpt = save(tmp_path, 2)
    (ckpt / "trainer_state.pt").write_bytes(b"garbage")
    assert latest_checkpoint(tmp_path, warn=False) is None


def test_garbage_state_is_a_user_error_not_a_traceback(tmp_path):
    ckpt = save(tmp_path, 2)
    (ckpt / "trainer_state.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(UserError, match="trainer_state.pt: unreadable"):
        load_state(ckpt)
    torch.save([1, 2, 3], ckpt / "trainer_state.pt")
    with pytest.raises(UserError, match="not a nanokl trainer state"):
        load_state(ckpt)


def test_retention_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import nanokl.harness.checkpoint as ck
    save(tmp_path, 2, keep=1)
    save(tmp_path, 4, keep=1)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_4"]
    monkeypatch.setattr(ck, "write_manifest", lambda path: None)  # step 6 is written without one: it cannot verify
    save(tmp_path, 6, keep=1)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_4", "global_step_6"]
    assert latest_checkpoint(tmp_path, warn=False) == tmp_path / "global_step_4"


def test_explicit_resume_of_a_bad_checkpoint_exits_2_with_one_line(tmp_path):
    """Refused before any work (with no warm start on disk, none is trained first)."""
    ckpt = save(tmp_path, 2)
    weights = ckpt / "optim.pt"
    weights.write_bytes(weights.read_bytes()[:-10])
    proc = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={ckpt}", f"trainer.default_local_dir={tmp_path / 'run'}",
                           f"actor_rollout_ref.model.path={tmp_path / 'no_sft'}", f"sft.output_dir={tmp_path / 'no_sft'}"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not verify" in lines[0] and str(weights) in lines[0]
