"""verl's console line, the metrics verl logs that nanokl added, and profiling chosen steps:

- the console line against verl's own `concat_dict_to_str` (verl/utils/logger/aggregate_logger.py,
  copied below as the reference) on a metrics dict of every kind of value; which line a logger
  list asks for, and the Tracker printing it (verl's on stdout, nanokl's short one on stderr);
- prompt_length/clip_ratio, response/aborted_ratio, timing_per_token_ms/* against hand counts on a
  tiny batch, logged after the step's older keys;
- a 2-step tiny run with global_profiler.steps=[1] writes one chrome trace (JSON) under
  <default_local_dir>/profile and prints its summary; a run without it writes none; the start-up
  notes of the profiler keys nanokl does otherwise.
"""

import json
import math
import numbers
import pprint
from pathlib import Path

import pytest
import torch

import train_ppo
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.config.load import load_config
from nanokl.harness.config.notes import startup_notes
from nanokl.harness.metrics import timing_per_token, verl_data_metrics
from nanokl.harness.config.notes import chosen_steps
from nanokl.harness.tracking import Tracker, console_style, read_metrics, verl_console_line

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false",
        "trainer.total_training_steps=2"]


def verl_concat_dict_to_str(dict: dict, step):  # verl b178a3c, verl/utils/logger/aggregate_logger.py, verbatim
    output = [f"step:{step}"]
    for k, v in dict.items():
        if isinstance(v, numbers.Number):
            output.append(f"{k}:{pprint.pformat(v)}")
    output_str = " - ".join(output)
    return output_str


def test_console_line_is_verls():
    metrics = {"training/global_step": 3, "actor/pg_loss": -0.012345678901234, "critic/score/mean": 0.5,
               "perf/total_num_tokens": 1234, "actor/nan_skipped": 0, "rollout/bypass": 1.0, "flag": True,
               "monitor/health": "ok", "val/bad": float("nan"), "big": 1.5e-9}
    line = verl_console_line(3, metrics)
    assert line == verl_concat_dict_to_str(metrics, 3)
    assert line == ("step:3 - training/global_step:3 - actor/pg_loss:-0.012345678901234 - critic/score/mean:0.5 - "
                    "perf/total_num_tokens:1234 - actor/nan_skipped:0 - rollout/bypass:1.0 - flag:True - "
                    "val/bad:nan - big:1.5e-09")  # strings left out, full precision, verl's order


@pytest.mark.parametrize("logger,style", [(["console"], "verl"), (["console", "wandb"], "verl"),
                                          (["console", "jsonl"], "short"), (["jsonl"], None), (["wandb"], None)])
def test_which_console_line(logger, style):
    assert console_style(logger) == style


def test_tracker_prints_one_line_per_step(tmp_path, capsys):
    m = {"critic/score/mean": torch.tensor(0.25), "timing_s/step": 1.5, "monitor/health": "ok"}
    t = Tracker(tmp_path / "a", ["console"])
    t.log(m, step=2)
    t.close()
    out, err = capsys.readouterr()
    assert out == "step:2 - training/global_step:2 - critic/score/mean:0.25 - timing_s/step:1.5\n" and err == ""
    t = Tracker(tmp_path / "b", ["console", "jsonl"])  # the CPU demo's: nanokl's short line, on stderr
    t.log(m, step=2)
    t.close()
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("step    2 | score 0.250") and err.count("\n") == 1


def batch():
    """3 responses; prompt width 4 (= data.max_prompt_length, left-padded), response width 5."""
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0, 0],    # prompt 4 (clipped), response 3
                         [0, 0, 1, 1, 0, 0, 0, 0, 0],    # prompt 2, response 0 (aborted)
                         [1, 1, 1, 1, 1, 1, 1, 1, 1]])   # prompt 4 (clipped), response 5
    return attn, attn[:, 4:].float()


def test_new_data_metrics_by_hand():
    attn, rmask = batch()
    m = verl_data_metrics(attn, rmask, 4, max_prompt_length=4)
    assert m == {"prompt_length/clip_ratio": pytest.approx(2 / 3), "response/aborted_ratio": pytest.approx(1 / 3)}
    assert verl_data_metrics(attn, rmask, 4, max_prompt_length=6)["prompt_length/clip_ratio"] == 0
    tokens = {"gen": rmask.sum().item(), "all": attn.sum().item()}  # what step_metrics divides by
    assert tokens == {"gen": 8, "all": 18}  # responses 3 + 0 + 5; prompts 4 + 2 + 4 on top
    timings = {"timing_s/gen": 0.4, "timing_s/reward": 0.1, "timing_s/ref": 0.09, "timing_s/adv": 0.018,
               "timing_s/update_actor": 0.9, "timing_s/step": 2.0}
    assert timing_per_token(timings, tokens) == {  # gen per response token, the rest per prompt + response token
        "timing_per_token_ms/gen": pytest.approx(50.0), "timing_per_token_ms/ref": pytest.approx(5.0),
        "timing_per_token_ms/adv": pytest.approx(1.0), "timing_per_token_ms/update_actor": pytest.approx(50.0)}


def run(sft_dir, run_dir, *extra):
    train_ppo.main(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY,
                    f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}",
                    f"trainer.default_local_dir={run_dir}", *extra])
    return read_metrics(run_dir)


def test_profiled_step_writes_one_trace_and_a_summary(sft_dir, tmp_path, capsys):
    rows = run(sft_dir, tmp_path, "trainer.logger=[jsonl]", "global_profiler.steps=[1]")
    traces = list(tmp_path.rglob("*prof*.json"))
    assert traces == [tmp_path / "profile" / "step1_prof_rank-0.json"]
    trace = json.loads(traces[0].read_text())
    assert trace["traceEvents"] and any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    err = capsys.readouterr().err
    assert f"profile: global step 1 (rank 0, global_profiler.steps): trace {traces[0]}" in err
    assert "phases (s): gen " in err and "update_actor" in err and "top ops by self CPU time" in err
    assert err.count("profile: global step") == 1
    for r in rows:  # the new keys, after every key the step logged before them
        keys = list(r)
        new = [k for k in keys if k in ("prompt_length/clip_ratio", "response/aborted_ratio", "perf/time_per_step")
               or k.startswith("timing_per_token_ms/")]
        assert len(new) >= 5 and keys.index(new[0]) > keys.index("training/epoch"), keys
        assert keys[keys.index(new[0]):keys.index(new[0]) + len(new)] == new, keys
        assert r["perf/time_per_step"] == r["timing_s/step"] and r["response/aborted_ratio"] == 0
        assert 0 <= r["prompt_length/clip_ratio"] <= 1 and all(math.isfinite(r[k]) for k in new)
        assert r["timing_per_token_ms/gen"] == pytest.approx(
            r["timing_s/gen"] * 1000 / (r["response_length/mean"] * 8), rel=1e-5)  # 8 prompts, n=1


def test_unprofiled_run_writes_no_trace_and_prints_verls_line(sft_dir, tmp_path, capsys):
    rows = run(sft_dir, tmp_path, "trainer.logger=console")
    assert not list(tmp_path.rglob("*prof*")) and not (tmp_path / "profile").exists()
    out, err = capsys.readouterr()
    lines = [x for x in out.splitlines() if x.startswith("step:")]
    assert [x.split(" - ")[0] for x in lines] == ["step:1", "step:2"] and "profile:" not in err
    row = {k: v for k, v in rows[-1].items()}
    assert lines[-1] == verl_concat_dict_to_str(row, 2)  # every number of the logged row, in its order


def test_profiler_keys_and_notes():
    cfg = load_config(None, ["global_profiler.steps=[2,1]", "global_profiler.tool=torch",
                             "global_profiler.save_path=/tmp/p"])
    assert chosen_steps(cfg) == ([1, 2], "global_profiler.steps")
    assert not [x for x in startup_notes(cfg) if "profil" in x]  # honoured: no note
    assert chosen_steps(load_config(None, ["trainer.profile_steps=[3]"])) == ([3], "trainer.profile_steps")
    notes = startup_notes(load_config(None, ["global_profiler.steps=[1]", "global_profiler.tool=nsys"]))
    assert [x for x in notes if "global_profiler" in x] == [
        "note: global_profiler.tool='nsys': nanokl records the chosen steps with torch.profiler (a chrome trace "
        "per step, nanokl/harness/profile.py), not nsys"]
    notes = startup_notes(load_config(None, ["actor_rollout_ref.actor.profiler.enable=true"]))
    assert [x for x in notes if "profil" in x] == [  # the role's own note (notes.VERL_NOTES), once
        "note: actor_rollout_ref.actor.profiler={'enable': True}: nanokl's roles share one process: "
        "global_profiler.steps (or trainer.profile_steps) traces whole steps, every role in them, with torch.profiler "
        "(none without them, as in verl); of a role's profiler only ranks, all_ranks and tool_config.torch.contents "
        "count (nanokl/harness/profile.py)"]
    with pytest.raises(UserError, match=r"global_profiler.steps=\[0\]: expected a list of global steps"):
        chosen_steps(load_config(None, ["global_profiler.steps=[0]"]))
