"""verl habits that broke nanokl (issue 48, items 1, 2, 3, 7, 8), each driven through train_ppo.py as a verl
user types it: verl's logger names (mlflow, swanlab, clearml, file), TensorBoard's directory, the metrics
verl's dashboards plot (actor/lr, perf/max_memory_*, response_length_non_aborted/*), a resume with
trainer.del_local_ckpt_after_load, the batch reward manager with reward_kwargs, critic_warmup counted as
verl counts it, max_critic_ckpt_to_keep.
"""

import pytest
import json
import os
import sys
import textwrap
from pathlib import Path

from test_cluster import ROOT, TINY, args, steps_logged

import subprocess


def launch(argv, env_extra=None, script=None, cwd=ROOT):
    """train_ppo.py (or `script`, which runs it) in a new process, with extra environment variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("NANOKL_FAULT", "TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT"):
        env.pop(k, None)
    env.update(env_extra or {})
    program = [str(script)] if script else [str(ROOT / "train_ppo.py")]
    return subprocess.run([sys.executable, *program, *map(str, argv)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def two_steps(sft_dir, run_dir, *extra):
    return args(sft_dir, run_dir, "trainer.total_training_steps=2", *extra)


def rows(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


# item 1 ---------------------------------------------------------------------------------------------------------

def test_verl_logger_names_start_and_file_writes_verls_json_lines(sft_dir, tmp_path):
    path = tmp_path / "file_logger" / "metrics.jsonl"
    r = launch(two_steps(sft_dir, tmp_path / "run", "trainer.logger=['console','mlflow','swanlab','clearml','file']"),
               {"VERL_FILE_LOGGER_PATH": str(path)})
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("mlflow", "swanlab", "clearml"):  # none installed here: one line each, the run goes on
        assert sum(f"tracking: {name} is not installed; skipping it" in line for line in r.stderr.splitlines()) == 1
    assert f"tracking: file logger writes to {path}" in r.stderr
    got = [json.loads(line) for line in open(path)]
    assert [g["step"] for g in got] == [1, 2]
    assert got[0]["data"]["critic/score/mean"] == rows(tmp_path / "run")[0]["critic/score/mean"]
    assert "step:1 - training/global_step:1 - " in r.stdout  # verl's console line still


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_file_logger_default_path_is_project_and_experiment(sft_dir, tmp_path):
    r = launch(two_steps(sft_dir, tmp_path / "run", "trainer.logger=file", "trainer.project_name=proj",
                         "trainer.experiment_name=exp"), {"VERL_FILE_LOGGER_ROOT": str(tmp_path / "root")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(line)["step"] for line in open(tmp_path / "root" / "proj" / "exp.jsonl")] == [1, 2]


# item 2 ---------------------------------------------------------------------------------------------------------

STUB = """\
import runpy, sys, types
from pathlib import Path
calls = []
class SummaryWriter:  # torch.utils.tensorboard needs the tensorboard package, absent here
    def __init__(self, log_dir):
        self.dir = Path(log_dir); self.dir.mkdir(parents=True, exist_ok=True)
    def add_scalar(self, k, v, step):
        calls.append((k, step))
    def add_text(self, *a):
        pass
    def close(self):
        (self.dir / "stub_events.txt").write_text(repr(calls))
sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=SummaryWriter)
sys.argv = [{train!r}] + sys.argv[1:]
sys.path[0] = str(Path({train!r}).parent)  # as `python train_ppo.py` would have it
runpy.run_path({train!r}, run_name="__main__")
"""


def tensorboard_run(sft_dir, tmp_path, env):
    script = tmp_path / "with_stub_tensorboard.py"
    script.write_text(STUB.format(train=str(ROOT / "train_ppo.py")))
    work = tmp_path / "cwd"
    work.mkdir()
    r = launch(two_steps(sft_dir, tmp_path / "run", "trainer.logger=[console,tensorboard]",
                         "trainer.project_name=proj", "trainer.experiment_name=exp"), env, script=script, cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, work


def test_tensorboard_goes_to_TENSORBOARD_DIR_and_says_so(sft_dir, tmp_path):
    r, _ = tensorboard_run(sft_dir, tmp_path, {"TENSORBOARD_DIR": str(tmp_path / "tb")})
    assert f"tracking: tensorboard events go to {tmp_path / 'tb'}" in r.stderr
    assert ("critic/score/mean", 2) in eval((tmp_path / "tb" / "stub_events.txt").read_text())
    assert not (tmp_path / "run" / "tensorboard").exists()


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_tensorboard_default_is_verls_tensorboard_log_project_experiment(sft_dir, tmp_path):
    r, work = tensorboard_run(sft_dir, tmp_path, {})
    assert "tracking: tensorboard events go to tensorboard_log/proj/exp" in r.stderr
    assert (work / "tensorboard_log" / "proj" / "exp" / "stub_events.txt").is_file()


# item 3 ---------------------------------------------------------------------------------------------------------

def test_verl_dashboard_metrics_are_logged(sft_dir, tmp_path):
    r = launch(two_steps(sft_dir, tmp_path / "run", "algorithm.adv_estimator=gae", "critic.optim.lr_warmup_steps=3"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "run")
    # the critic's LR after the step's scheduler step, as verl logs it (get_last_lr): the rate of the next step,
    # 1/3, 2/3, 3/3 of its 3-step warm-up for steps 1, 2, 3 (nanokl/harness/optim.py)
    assert [g["critic/lr"] for g in got] == [3e-4 * 2 / 3, 3e-4]
    assert [g["actor/lr"] for g in got] == [2e-5, 2e-5]
    for g in got:
        assert g["perf/max_memory_allocated_gb"] == g["perf/max_memory_reserved_gb"] == 0.0  # CPU: 0, as verl
        assert 0 < g["perf/cpu_memory_used_gb"] < 1e4
        for k in ("mean", "max", "min", "clip_ratio"):  # no response is aborted: verl's equal response_length's
            assert g[f"response_length_non_aborted/{k}"] == g[f"response_length/{k}"]


# item 7 ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_del_local_ckpt_after_load_resumes(sft_dir, tmp_path):
    """verl's habit: the key on the resume command (or dropped from it); it changes no number of the run."""
    key = "trainer.del_local_ckpt_after_load=True"
    r = launch(args(sft_dir, tmp_path, "trainer.save_freq=2", "trainer.total_training_steps=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(args(sft_dir, tmp_path, key, "trainer.save_freq=2", "trainer.total_training_steps=3"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: trainer.del_local_ckpt_after_load" in r.stderr  # nanokl keeps the checkpoint, and says so
    assert steps_logged(tmp_path) == [1, 2, 3] and (tmp_path / "global_step_2").is_dir()
    r = launch(args(sft_dir, tmp_path, key, "trainer.save_freq=2"))  # with the key both times
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(args(sft_dir, tmp_path, "trainer.save_freq=2", "trainer.total_training_steps=6"))  # and without
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps_logged(tmp_path) == [1, 2, 3, 4, 5, 6]


# item 8 ---------------------------------------------------------------------------------------------------------

BATCH_FN = """\
import json
def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0, log=None, short=False):
    with open(log, "a") as f:
        f.write(json.dumps([type(solution_strs).__name__, len(solution_strs), len(data_sources), len(ground_truths),
                            len(extra_infos), bonus]) + "\\n")
    scores = [{"score": float(s.strip().endswith(str(g))) + bonus, "acc": s.strip().endswith(str(g))}
              for s, g in zip(solution_strs, ground_truths)]
    return scores[:-1] if short else scores
"""


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_batch_reward_manager_calls_once_a_batch_with_reward_kwargs(sft_dir, tmp_path):
    fn, log = tmp_path / "fn.py", tmp_path / "calls.jsonl"
    fn.write_text(BATCH_FN)
    verl = [f"custom_reward_function.path={fn}", "reward_model.reward_manager=batch",
            "+custom_reward_function.reward_kwargs.bonus=0.5", f"+custom_reward_function.reward_kwargs.log={log}"]
    r = launch(two_steps(sft_dir, tmp_path / "run", *verl, "trainer.val_before_train=true"))
    assert r.returncode == 0, r.stderr[-3000:]
    calls = [json.loads(line) for line in open(log)]
    # validation: a call per chunk of val_batch_size (= train_batch_size, 8) of its 16 prompts; then a call a
    # step, its 8 responses; lists each time, reward_kwargs passed
    assert calls == [["list", 8, 8, 8, 8, 0.5]] * 4
    for g in rows(tmp_path / "run")[1:]:
        assert 0.5 <= g["critic/score/min"] <= g["critic/score/max"] <= 1.5
    # a list of the wrong length: one line naming the function, a checkpoint, exit 1
    r = launch(args(sft_dir, tmp_path / "short", *verl, "+custom_reward_function.reward_kwargs.short=true"))
    assert r.returncode == 1
    assert f"custom_reward_function compute_score ({fn}) returned [" in r.stderr
    assert "it returns a list of 8 scores" in r.stderr


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_critic_warmup_counts_as_verls_global_steps(sft_dir, tmp_path):
    """verl updates the actor when critic_warmup <= global_steps, counted from 1: critic_warmup=1 trains the actor
    from step 1, critic_warmup=2 from step 2."""
    for warmup, first in ((1, 1), (2, 2)):
        run_dir = tmp_path / str(warmup)
        r = launch(two_steps(sft_dir, run_dir, "algorithm.adv_estimator=gae", f"trainer.critic_warmup={warmup}"))
        assert r.returncode == 0, r.stderr[-3000:]
        got = rows(run_dir)
        assert [g["training/global_step"] for g in got if "timing_s/update_actor" in g] == list(range(first, 3))
        assert all("timing_s/update_critic" in g for g in got)


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_max_critic_ckpt_to_keep_rotates_the_folders_with_a_critic(sft_dir, tmp_path):
    """A folder holds actor and critic: the larger limit of those set keeps it, with the start-up note saying so."""
    def kept(run_dir, *extra):
        r = launch(args(sft_dir, run_dir, "algorithm.adv_estimator=gae", "trainer.save_freq=1", *extra))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "note: trainer.max_critic_ckpt_to_keep" in r.stderr and "the larger" in r.stderr
        return sorted(p.name for p in Path(run_dir).glob("global_step_*"))
    assert kept(tmp_path / "a", "trainer.max_critic_ckpt_to_keep=2") == ["global_step_3", "global_step_4"]
    assert kept(tmp_path / "b", "trainer.max_critic_ckpt_to_keep=3", "trainer.max_actor_ckpt_to_keep=1") == \
        ["global_step_2", "global_step_3", "global_step_4"]
