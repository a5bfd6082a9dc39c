"""verl's checkpoint layout and tracker file (issue 41, item 5).

verl (b178a3c, verl/trainer/ppo/ray_trainer.py `_save_checkpoint` / `_load_checkpoint`,
verl/utils/checkpoint/checkpoint_manager.py `find_latest_ckpt_path`) writes checkpoint N to
`<default_local_dir>/global_step_N/` (actor/, critic/ beside it) and, once it is complete,
`<default_local_dir>/latest_checkpointed_iteration.txt` holding str(N); resume_mode=auto reads that file,
resume_mode=resume_path takes `resume_from_path=<dir>/global_step_N`. Here:

- a run writes that layout and the tracker, which verl's own reader (re-stated below) follows;
- verl's `resume_from_path=<dir>/global_step_N` resumes bit-identically;
- a checkpoint written before the change (`<dir>/checkpoints/global_step_N/`, its tracker beside it)
  still resumes, by auto and by resume_path, bit-identically; the next checkpoint goes to verl's
  layout, and rotation (max_actor_ckpt_to_keep) counts both layouts;
- the tracker never names a .tmp, nor a checkpoint whose write failed;
- a fresh start sets both layouts aside into checkpoints.N/.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from nanokl.harness.checkpoint import (LEGACY_ROOT, POINTER, CheckpointWriteError, checkpoint_dir, latest_checkpoint,
                                       load_state, save_checkpoint)
from nanokl.harness.run_state import set_aside
from nanokl.harness.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=-1", "trainer.save_freq=2", "algorithm.adv_estimator=gae"]


def run(sft_dir, run_dir, *extra):
    train_ppo.main(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY,
                    f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}",
                    f"trainer.default_local_dir={run_dir}", *extra])
    return read_metrics(run_dir)


def verl_find_latest_ckpt_path(path):
    """verl's find_latest_ckpt_path (checkpoint_manager.py), as it reads the tracker."""
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if not os.path.exists(tracker):
        return None
    with open(tracker, "rb") as f:
        iteration = int(f.read().decode())
    ckpt = os.path.join(path, f"global_step_{iteration}")
    return ckpt if os.path.exists(ckpt) else None


def steps(rows):
    return [r["training/global_step"] for r in rows]


def same_weights(a, b):
    for part in ("actor", "critic"):
        wa, wb = load_file(Path(a) / part / "model.safetensors"), load_file(Path(b) / part / "model.safetensors")
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{part}/{k} differs"
    assert load_state(a)[1]["kl_ctrl"] == load_state(b)[1]["kl_ctrl"]


@pytest.fixture(scope="module")
def straight(sft_dir, tmp_path_factory):
    """4 steps, checkpoints at 2 and 4, with a critic."""
    out = tmp_path_factory.mktemp("straight")
    run(sft_dir, out, "trainer.total_training_steps=4")
    return out


@pytest.fixture(scope="module")
def two_steps(sft_dir, tmp_path_factory):
    """The same run stopped after 2 steps (its checkpoint at 2)."""
    out = tmp_path_factory.mktemp("two")
    run(sft_dir, out, "trainer.total_training_steps=2")
    return out


def copy_of(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def to_old_layout(run_dir):
    """What nanokl wrote before verl's layout: <dir>/checkpoints/global_step_N/, the tracker in checkpoints/."""
    old = run_dir / LEGACY_ROOT
    old.mkdir()
    for p in [*run_dir.glob("global_step_*"), run_dir / POINTER]:
        os.replace(p, old / p.name)
    return old


def test_a_run_writes_verls_layout_and_tracker(straight):
    assert sorted(p.name for p in straight.iterdir() if p.name.startswith("global_step_")) == \
        ["global_step_2", "global_step_4"]
    for step in (2, 4):
        ckpt = straight / f"global_step_{step}"
        for part in ("actor", "critic"):  # verl's global_step_N/actor, critic beside it
            assert (ckpt / part / "model.safetensors").is_file() and (ckpt / part / "config.json").is_file()
    assert (straight / POINTER).read_text() == "4"  # str(N), as verl writes it and int() reads it
    assert verl_find_latest_ckpt_path(str(straight)) == str(straight / "global_step_4")
    assert latest_checkpoint(straight) == straight / "global_step_4"
    assert not (straight / LEGACY_ROOT).exists() and not list(straight.glob("*.tmp"))


def test_verls_resume_from_path_resumes_bit_identically(sft_dir, straight, two_steps, tmp_path, capfd):
    b = copy_of(two_steps, tmp_path / "b")
    capfd.readouterr()
    rows = run(sft_dir, b, "trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
               f"trainer.resume_from_path={b / 'global_step_2'}")
    assert f"resumed from {b / 'global_step_2'} at step 2" in capfd.readouterr().err
    assert steps(rows) == steps(read_metrics(straight))
    same_weights(straight / "global_step_4", b / "global_step_4")
    assert (b / POINTER).read_text() == "4"


def test_an_old_layout_checkpoint_resumes_by_auto_and_rotates_out(sft_dir, straight, two_steps, tmp_path, capfd):
    """Written before the change: auto finds <dir>/checkpoints/global_step_2 (the old tracker beside it), the
    run continues bit-identically, step 4 lands in verl's layout, and keep=1 rotates the old one out with its
    folder."""
    d = copy_of(two_steps, tmp_path / "d")
    old = to_old_layout(d)
    assert latest_checkpoint(d) == old / "global_step_2" and checkpoint_dir(d, 2) == old / "global_step_2"
    capfd.readouterr()
    rows = run(sft_dir, d, "trainer.total_training_steps=4", "trainer.max_actor_ckpt_to_keep=1")
    assert f"resumed from {old / 'global_step_2'} at step 2" in capfd.readouterr().err
    assert steps(rows) == steps(read_metrics(straight))
    same_weights(straight / "global_step_4", d / "global_step_4")
    assert (d / POINTER).read_text() == "4" and latest_checkpoint(d) == d / "global_step_4"
    assert not old.exists()  # its only checkpoint rotated out (max_actor_ckpt_to_keep=1), the folder with it
    assert sorted(p.name for p in d.glob("global_step_*")) == ["global_step_4"]


def test_an_old_layout_checkpoint_resumes_by_path(sft_dir, straight, two_steps, tmp_path, capfd):
    e = copy_of(two_steps, tmp_path / "e")
    old = to_old_layout(e)
    capfd.readouterr()
    rows = run(sft_dir, e, "trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
               f"trainer.resume_from_path={old / 'global_step_2'}")
    assert f"resumed from {old / 'global_step_2'} at step 2" in capfd.readouterr().err
    assert steps(rows) == steps(read_metrics(straight))
    same_weights(straight / "global_step_4", e / "global_step_4")
    assert (old / "global_step_2").is_dir()  # no retention asked: the old one stays, found after the new
    assert latest_checkpoint(e) == e / "global_step_4"


# ---------------------------------------------------------------------------------------------
# unit level: the tracker, auto's order over both layouts, set aside
# ---------------------------------------------------------------------------------------------

def save(run_dir, step, keep=None, before_commit=None):
    return save_checkpoint(run_dir, step, {}, {"actor": {"w": torch.full((4,), float(step))}},
                           {"kl_ctrl": {"value": 0.1}, "rng": {"torch": torch.get_rng_state()}}, keep=keep,
                           before_commit=before_commit)


def test_the_tracker_never_names_a_tmp(tmp_path, monkeypatch):
    save(tmp_path, 2)
    seen = []

    def before_commit():  # everything written, not yet renamed: the tracker still names step 2
        seen.append(((tmp_path / "global_step_4.tmp").is_dir(), (tmp_path / POINTER).read_text()))
    save(tmp_path, 4, before_commit=before_commit)
    assert seen == [(True, "2")] and (tmp_path / POINTER).read_text() == "4"

    def dies():  # the process dies at that instant (SIGKILL): the .tmp stays, the tracker is untouched
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 6, before_commit=dies)
    assert (tmp_path / "global_step_6.tmp").is_dir() and (tmp_path / POINTER).read_text() == "4"
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_4"
    import nanokl.harness.checkpoint as ck

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(CheckpointWriteError):  # a failed write: its .tmp removed, the tracker untouched
        save(tmp_path, 8)
    monkeypatch.undo()
    assert not (tmp_path / "global_step_8.tmp").exists() and (tmp_path / POINTER).read_text() == "4"
    save(tmp_path, 10)  # the next save cleans the dead one's debris
    assert not list(tmp_path.glob("*.tmp")) and (tmp_path / POINTER).read_text() == "10"
    assert all(p.name != POINTER + ".tmp" for p in tmp_path.iterdir())


def test_auto_order_over_both_layouts(tmp_path, capsys):
    save(tmp_path, 2)
    save(tmp_path, 6)
    to_old_layout(tmp_path)  # old: 2, 6 (its tracker says 6)
    old = tmp_path / LEGACY_ROOT
    assert latest_checkpoint(tmp_path) == old / "global_step_6"
    (old / POINTER).write_text("2")  # the old tracker's target first, as before, while verl's has none
    assert latest_checkpoint(tmp_path) == old / "global_step_2"
    save(tmp_path, 4)  # verl's tracker, once written, wins over the old one and the higher old step
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step_4"
    (tmp_path / "global_step_4" / "optim.pt").write_bytes(b"broken")  # then the newest that verifies, either layout
    assert latest_checkpoint(tmp_path) == old / "global_step_6"
    assert "checkpoint global_step_4 skipped" in capsys.readouterr().err
    save(tmp_path, 6)  # the same step in verl's layout supersedes the old one's
    assert not (old / "global_step_6").exists() and latest_checkpoint(tmp_path) == tmp_path / "global_step_6"
    save(tmp_path, 8, keep=2)  # rotation counts both layouts: old 2 and the broken 4 go
    assert not (old / "global_step_2").exists() and not old.exists()
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_6", "global_step_8"]


def test_a_fresh_start_sets_both_layouts_aside(tmp_path):
    save(tmp_path, 2)
    to_old_layout(tmp_path)
    save(tmp_path, 4)
    (tmp_path / "global_step_9.tmp").mkdir()  # a dead run's debris goes with them
    (tmp_path / "metrics.jsonl").write_text('{"training/global_step": 4}\n')
    note = set_aside(tmp_path, "trainer.resume_mode=disable")
    assert note.startswith("note:") and "checkpoints.1" in note and "metrics.1.jsonl" in note
    aside = tmp_path / "checkpoints.1"
    assert sorted(p.name for p in aside.iterdir()) == ["global_step_2", "global_step_4", "global_step_9.tmp", POINTER,
                                                       POINTER + ".legacy"]
    assert (aside / POINTER).read_text() == "4" and (aside / (POINTER + ".legacy")).read_text() == "2"
    assert not any(tmp_path.glob("global_step_*")) and not (tmp_path / POINTER).exists()
    assert not (tmp_path / LEGACY_ROOT).exists() and latest_checkpoint(tmp_path) is None
    save(tmp_path, 1)  # the new run's, in verl's layout; the next set aside takes checkpoints.2
    assert "checkpoints.2" in set_aside(tmp_path, "no checkpoint to resume from")
    assert (tmp_path / "checkpoints.2" / "global_step_1").is_dir()


def test_a_checkpoints_folder_of_other_runs_is_not_set_aside(tmp_path):
    """verl's default trainer.default_local_dir is checkpoints/{project}/{experiment}: a run in the folder above
    (default_local_dir=.) sets aside its own checkpoints, never that checkpoints/ folder of other runs."""
    other = tmp_path / LEGACY_ROOT / "nanokl" / "default"
    save(other, 3)
    save(tmp_path, 2)
    note = set_aside(tmp_path, "trainer.resume_mode=disable")
    assert "checkpoints.1" in note and (tmp_path / "checkpoints.1" / "global_step_2").is_dir()
    assert (other / "global_step_3").is_dir() and latest_checkpoint(other) == other / "global_step_3"
    assert set_aside(tmp_path, "trainer.resume_mode=disable") is None
