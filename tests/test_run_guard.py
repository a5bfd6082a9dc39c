"""Nothing silently wrong in a run's folder (issue 39, items 3-5), on real tiny runs of train_ppo.py:

- a resume that does not match the checkpoint refuses, exit 2, one line naming what differs (the model
  path, its tokenizer, its shapes, a key that changes the result), before any step and without
  rewriting config.yaml; trainer.resume_allow_changes accepts a named change, resume_mode=disable
  starts over; speed-only keys resume with a one-line note; a checkpoint from before the record resumes
  with a note;
- one run per folder: a second run in a folder whose run is alive exits 2 naming its pid; the lock of
  a run that died is taken over with a note; verl's default folder checkpoints/{project}/{experiment};
- each step logged once: a run that starts over sets the earlier run's metrics.jsonl (and checkpoints)
  aside, and its summary.json describes it alone; a checkpoint never commits without its step's row
  (the ordinary save, the NaN stop, the KL monitor's stop).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_ppo
from nanokl.harness.checkpoint import latest_checkpoint
from test_faults import run_cli as cli  # (exit status, stderr) of train_ppo's CLI, in this process

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), "data.num_train=64", "data.num_val=16",
        "data.train_batch_size=8", "data.max_response_length=32", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.logger=[jsonl]", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.total_training_steps=2", "trainer.save_freq=2"]


def argv(sft_dir, run_dir, *extra):
    return [*TINY, f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}",
            f"trainer.default_local_dir={run_dir}", *extra]




def steps_logged(run_dir, name="metrics.jsonl"):
    return [json.loads(line)["training/global_step"] for line in open(Path(run_dir) / name) if line.strip()]


def errors(err):
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def other_sft(tmp_path_factory):
    """A second warm start of another width (hidden 48, not 32): another model with its own tokenizer file."""
    from nanokl.harness.config.load import load_config
    from nanokl.supervised.sft import train_sft
    out = tmp_path_factory.mktemp("sft48")
    train_sft(load_config(ROOT / "configs" / "arith_tiny.yaml",
                          ["sft.steps=2", "sft.num_examples=256", "sft.hidden_size=48", "sft.intermediate_size=64",
                           "sft.num_hidden_layers=1", f"sft.output_dir={out}"]), progress=False)
    return out


@pytest.fixture
def two_steps(sft_dir, tmp_path, capfd):
    """A run of 2 steps with its checkpoint at step 2; (run dir, config.yaml's text)."""
    code, err = cli(argv(sft_dir, tmp_path), capfd)
    assert code == 0, err[-2000:]
    assert latest_checkpoint(tmp_path).name == "global_step_2"
    return tmp_path, (tmp_path / "config.yaml").read_text()


# ---------------------------------------------------------------------------------------------
# 3. a resume that does not match refuses
# ---------------------------------------------------------------------------------------------

def test_resume_with_another_model_refuses(sft_dir, other_sft, two_steps, capfd):
    """Today's fault: the actor from the checkpoint, the reference and tokenizer from the new path, exit 0."""
    run_dir, config = two_steps
    code, err = cli(argv(sft_dir, run_dir, f"actor_rollout_ref.model.path={other_sft}",
                         "trainer.total_training_steps=3"), capfd)
    assert code == 2, err[-2000:]
    lines = errors(err)
    assert len(lines) == 1, err[-2000:]
    line = lines[0]
    assert "actor_rollout_ref.model.path" in line and str(other_sft) in line
    assert "model_shapes" in line and "hidden_size 32 -> 48" in line
    assert "resume_mode=disable" in line and "trainer.resume_allow_changes" in line
    assert "ppo:" not in err  # before any step
    assert (run_dir / "config.yaml").read_text() == config  # not overwritten by the refused config
    assert steps_logged(run_dir) == [1, 2]


def test_resume_with_another_tokenizer_refuses(sft_dir, two_steps, tmp_path_factory, capfd):
    """The same weights under another path, the tokenizer file changed: allowing the path still leaves the tokenizer."""
    import shutil
    run_dir, config = two_steps
    copy = tmp_path_factory.mktemp("sft_copy") / "sft"
    shutil.copytree(sft_dir, copy)
    tok = copy / "tokenizer.json"
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=3))
    code, err = cli(argv(sft_dir, run_dir, f"actor_rollout_ref.model.path={copy}",
                         "trainer.resume_allow_changes=[actor_rollout_ref.model.path]"), capfd)
    assert code == 2, err[-2000:]
    [line] = errors(err)
    assert "tokenizer (tokenizer.json sha256 " in line and "model_shapes" not in line
    assert "actor_rollout_ref.model.path" not in line.split("trainer.resume_allow_changes")[0]  # allowed
    assert (run_dir / "config.yaml").read_text() == config


def test_resume_with_a_changed_batch_size_refuses_unless_allowed(sft_dir, two_steps, capfd):
    run_dir, config = two_steps
    changed = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
               "trainer.total_training_steps=3"]
    code, err = cli(argv(sft_dir, run_dir, *changed), capfd)
    assert code == 2, err[-2000:]
    [line] = errors(err)
    assert "data.train_batch_size (8 -> 16)" in line and "actor_rollout_ref.actor.ppo_mini_batch_size (4 -> 8)" in line
    assert "total_training_steps" not in line  # speed-only: allowed
    assert (run_dir / "config.yaml").read_text() == config and steps_logged(run_dir) == [1, 2]
    # accepted by name, as the line says how (the critic's mini-batch follows the actor's): resumes at step 2,
    # says so in one line, and only then writes config.yaml
    allow = line.split("resume with the change: ")[1]
    assert allow == ("trainer.resume_allow_changes=[data.train_batch_size,data.gen_batch_size,actor_rollout_ref.actor.ppo_mini_batch_size,"
                     "critic.ppo_mini_batch_size]")
    code, err = cli(argv(sft_dir, run_dir, *changed, allow), capfd)
    assert code == 0, err[-2000:]
    assert "at step 2" in err
    notes = [ln for ln in err.splitlines() if "resume_allow_changes" in ln]
    assert len(notes) == 1 and notes[0].startswith("note:") and "data.train_batch_size (8 -> 16)" in notes[0]
    assert "train_batch_size: 16" in (run_dir / "config.yaml").read_text()
    assert steps_logged(run_dir) == [1, 2, 3]


def test_resume_mode_disable_starts_over_with_another_config(sft_dir, two_steps, capfd):
    run_dir, _ = two_steps
    code, err = cli(argv(sft_dir, run_dir, "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                         "trainer.resume_mode=disable", "trainer.total_training_steps=1", "trainer.save_freq=1"), capfd)
    assert code == 0, err[-2000:]
    assert steps_logged(run_dir) == [1]
    assert latest_checkpoint(run_dir).name == "global_step_1"


def test_speed_only_changes_resume_with_a_note(sft_dir, two_steps, capfd):
    run_dir, _ = two_steps
    code, err = cli(argv(sft_dir, run_dir, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                         "trainer.logger=[console,jsonl]", "trainer.total_training_steps=3"), capfd)
    assert code == 0, err[-2000:]
    notes = [ln for ln in err.splitlines() if ln.startswith("note: resuming with changed speed-only keys")]
    assert len(notes) == 1, err[-3000:]
    for part in ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (4 -> 2)", "trainer.logger",
                 "trainer.total_training_steps (2 -> 3)"):
        assert part in notes[0]
    assert steps_logged(run_dir) == [1, 2, 3]


def test_a_checkpoint_without_a_record_resumes_with_a_note(sft_dir, two_steps, capfd):
    """A checkpoint written before the record: no settings to compare, so it resumes, and says so."""
    from nanokl.harness.checkpoint import write_manifest
    run_dir, _ = two_steps
    ckpt = latest_checkpoint(run_dir)
    for f in ckpt.iterdir():
        if f.is_file() and f.name not in ("optim.pt", "trainer_state.pt"):
            f.unlink()  # the manifest and the record: as an older nanokl wrote it
    write_manifest(ckpt)
    code, err = cli(argv(sft_dir, run_dir, "trainer.total_training_steps=3"), capfd)
    assert code == 0, err[-2000:]
    notes = [ln for ln in err.splitlines() if ln.startswith("note:") and str(ckpt) in ln]
    assert len(notes) == 1 and "record" in notes[0], err[-3000:]
    assert steps_logged(run_dir) == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# 4. one run per folder
# ---------------------------------------------------------------------------------------------

def test_default_folder_is_verls(tmp_path):
    from nanokl.harness.config.load import load_config, parse_cli
    verl = parse_cli(["data.train_files=x.parquet", "actor_rollout_ref.model.path=m"])
    assert verl.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"  # verl's project/experiment
    named = parse_cli(["data.train_files=x.parquet", "actor_rollout_ref.model.path=m", "trainer.project_name=p",
                       "trainer.experiment_name=e"])
    assert named.trainer.default_local_dir == "checkpoints/p/e"
    own = parse_cli(["data.train_files=x.parquet", "actor_rollout_ref.model.path=m",
                     f"trainer.default_local_dir={tmp_path}"])
    assert own.trainer.default_local_dir == str(tmp_path)
    for f in sorted((ROOT / "configs").glob("*.yaml")):  # every config that names its folder keeps it
        if "default_local_dir:" in f.read_text():
            assert load_config(f).trainer.default_local_dir.startswith("runs/"), f


def test_a_second_run_in_the_same_folder_exits_2_naming_the_first(sft_dir, tmp_path, capfd):
    first = subprocess.Popen([sys.executable, str(ROOT / "train_ppo.py"),
                              *argv(sft_dir, tmp_path, "trainer.total_training_steps=1000", "trainer.save_freq=-1")],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while not (tmp_path / "metrics.jsonl").is_file() or not steps_logged(tmp_path):  # a step done: set up
            assert first.poll() is None and time.time() < deadline, "the first run did not start"
            time.sleep(0.2)
        code, err = cli(argv(sft_dir, tmp_path, "trainer.total_training_steps=1"), capfd)
        assert code == 2, err[-2000:]
        [line] = errors(err)
        assert f"pid {first.pid}" in line and str(tmp_path) in line
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()  # SIGKILL: it leaves its lock file behind, as a crashed run does
        first.wait()
    rows = (tmp_path / "metrics.jsonl").read_text()
    code, err = cli(argv(sft_dir, tmp_path, "trainer.total_training_steps=1"), capfd)  # the dead run's lock: taken over
    assert code == 0, err[-2000:]
    notes = [ln for ln in err.splitlines() if ln.startswith("note:") and f"pid {first.pid}" in ln]
    assert len(notes) == 1, err[-3000:]
    assert not (tmp_path / ".lock").exists()  # released at the end
    assert steps_logged(tmp_path) == [1] and (tmp_path / "metrics.1.jsonl").read_text() == rows


# ---------------------------------------------------------------------------------------------
# 5. each step logged once
# ---------------------------------------------------------------------------------------------

def test_a_run_that_starts_over_sets_the_old_metrics_aside(sft_dir, tmp_path, capfd):
    code, err = cli(argv(sft_dir, tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=-1"), capfd)
    assert code == 0 and steps_logged(tmp_path) == [1, 2, 3]
    first = (tmp_path / "metrics.jsonl").read_text()
    # no checkpoint: the same folder starts over
    code, err = cli(argv(sft_dir, tmp_path, "trainer.total_training_steps=1", "trainer.save_freq=1"), capfd)
    assert code == 0, err[-2000:]
    assert steps_logged(tmp_path) == [1]
    assert (tmp_path / "metrics.1.jsonl").read_text() == first
    notes = [ln for ln in err.splitlines() if "metrics.1.jsonl" in ln]
    assert len(notes) == 1 and notes[0].startswith("note:")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["last_step"] == 1 and summary["planned_steps"] == 1  # this run's rows only
    # resume_mode=disable, a checkpoint there: its checkpoints go aside too
    code, err = cli(argv(sft_dir, tmp_path, "trainer.total_training_steps=2", "trainer.resume_mode=disable"), capfd)
    assert code == 0, err[-2000:]
    assert steps_logged(tmp_path) == [1, 2] and steps_logged(tmp_path, "metrics.2.jsonl") == [1]
    assert (tmp_path / "checkpoints.2" / "global_step_1").is_dir()  # verl's layout set aside into checkpoints.N/
    assert (tmp_path / "checkpoints.2" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(p.name for p in tmp_path.glob("global_step_*") if p.is_dir()) == ["global_step_2"]
    assert json.loads((tmp_path / "summary.json").read_text())["last_step"] == 2


class Crash(BaseException):
    """The process dying at that instant (a BaseException: nothing on the way catches it)."""


@pytest.mark.parametrize("path", ["save_freq", "nan_stop", "monitor_stop"])
def test_a_checkpoint_never_commits_without_its_row(sft_dir, tmp_path, monkeypatch, path):
    """The process dies as it logs the row of a step whose checkpoint is being written. Every checkpoint
    that was committed has its step's row in metrics.jsonl (today: saved, then logged)."""
    from nanokl.harness import tracking
    real_log = tracking.Tracker.log

    def log(self, metrics, step):
        ckpts = tmp_path  # verl's layout: <dir>/global_step_N
        if (ckpts / f"global_step_{step}").exists() or (ckpts / f"global_step_{step}.tmp").exists():
            raise Crash(step)
        return real_log(self, metrics, step)
    monkeypatch.setattr(tracking.Tracker, "log", log)
    extra = ["trainer.total_training_steps=4"]
    if path == "nan_stop":
        from nanokl import workers
        real = workers.compute_policy_loss
        monkeypatch.setattr(workers, "compute_policy_loss", lambda *a, **kw: (lambda lm: (lm[0] * float("nan"), lm[1]))(
            real(*a, **kw)))
        extra = ["trainer.total_training_steps=10", "trainer.save_freq=-1"]
    elif path == "monitor_stop":  # any KL above 1e-9 for one step stops the run
        extra = ["trainer.total_training_steps=10", "trainer.save_freq=-1", "trainer.kl_monitor.enable=true",
                 "trainer.kl_monitor.kl_stop=1e-9", "trainer.kl_monitor.kl_stop_patience=1",
                 "trainer.kl_monitor.kl_stop_action=stop", "trainer.kl_monitor.warmup_steps=0"]
    with pytest.raises(Crash):
        train_ppo.main(argv(sft_dir, tmp_path, *extra))
    logged = set(steps_logged(tmp_path))
    committed = [int(p.name.rsplit("_", 1)[1]) for p in tmp_path.glob("global_step_*")
                 if p.is_dir() and p.suffix != ".tmp"]
    assert all(s in logged for s in committed), (committed, sorted(logged))
    ckpt = latest_checkpoint(tmp_path, warn=False)
    assert ckpt is None or int(ckpt.name.rsplit("_", 1)[1]) in logged


def test_a_record_with_the_old_spellings_resumes_as_the_same_settings(sft_dir, two_steps, capfd):
    """A checkpoint from before actor.loss_mode became actor.objective and the monitor's knob kl_coef became
    kl_weight: the same settings in old words are no change (a real change is still refused, above)."""
    from nanokl.harness.checkpoint import RECORD, write_manifest
    run_dir, _ = two_steps
    ckpt = latest_checkpoint(run_dir)
    record = json.loads((ckpt / RECORD).read_text())
    cfg = record["config"]
    knobs = [k for k in cfg if k.startswith("trainer.kl_monitor.") and k.endswith(".knob") and cfg[k] == "kl_weight"]
    assert knobs and "actor_rollout_ref.actor.objective" in cfg
    record["config"] = {("actor_rollout_ref.actor.loss_mode" if k == "actor_rollout_ref.actor.objective" else k):
                        ("kl_coef" if k in knobs else v) for k, v in cfg.items()}
    (ckpt / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    write_manifest(ckpt)
    code, err = cli(argv(sft_dir, run_dir, "trainer.total_training_steps=3"), capfd)
    assert code == 0, err[-2000:]
    assert not [ln for ln in err.splitlines() if "resume_allow_changes" in ln or ln.startswith("error:")]
    assert steps_logged(run_dir) == [1, 2, 3]
