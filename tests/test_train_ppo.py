"""train_ppo.py end to end, on a tiny warm start made once for the module:

- a few-step smoke run for each of KL-in-reward, KL-loss and GRPO, and for the exact `full` KL
  in the reward and as the loss: every metric finite, verl's metric names present;
- the per-token `full` KL that a run puts in the reward equals torch's kl_div recomputed on a
  micro-batch of the same step, from plain full forwards of copies of the two models;
- exact resume: 4 steps straight and 2 + resume + 2 give bit-identical weights and beta;
- a crash while a checkpoint is written leaves the previous checkpoint loadable;
- a bad config key, a missing model directory and a malformed data line each exit with status 2
  and a one-line message naming the culprit;
- a NaN loss skips that update and is counted; three in a row stop the run with a checkpoint.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from nanokl.harness.checkpoint import latest_checkpoint, load_state
from nanokl.harness.tracking import read_metrics
from nanokl.harness.run_state import TrainingStopped

ROOT = Path(__file__).resolve().parents[1]

TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=2", "trainer.save_freq=2", "trainer.total_training_steps=2"]
GAE = "algorithm.adv_estimator=gae"  # the step with a critic (arith_tiny.yaml's REINFORCE++ has none)
# not compared between two runs of the same command: the machine's clock and memory readings
QUIET = ("timing", "perf/throughput", "perf/time_per_step", "perf/cpu_memory", "perf/max_memory")


def run(sft_dir, run_dir, *extra):
    train_ppo.main(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY,
                    f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}",
                    f"trainer.default_local_dir={run_dir}", *extra])
    return read_metrics(run_dir)


COMMON_KEYS = ["actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm",
               "critic/score/mean", "response_length/mean", "timing_s/gen", "timing_s/step", "perf/throughput",
               "rollout/bypass", "training/global_step", "val-core/arith/acc/mean@1"]


@pytest.mark.parametrize("name,extra,keys", [
    ("kl_in_reward", [GAE, "actor_rollout_ref.actor.use_kl_loss=false"],
     ["actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "critic/vf_explained_var", "critic/vf_loss"]),
    ("kl_loss", [GAE, "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
                 "algorithm.rollout_correction.bypass_mode=false"],  # the recomputing forward
     ["actor/kl_loss", "actor/kl_coef", "critic/vf_loss", "rollout/log_prob_max_diff", "timing_s/old_log_prob"]),
    ("grpo", ["--config", str(ROOT / "configs" / "grpo_arith.yaml"), "actor_rollout_ref.rollout.n=4",
              "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.save_freq=-1"],
     ["actor/kl_loss", "critic/advantages/mean"]),
    ("full_in_reward", [GAE, "algorithm.kl_penalty=full"],
     ["actor/reward_kl_penalty", "actor/reward_kl_k1", "actor/reward_kl_k3", "critic/vf_loss"]),
    ("full_loss", ["algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
                   "actor_rollout_ref.actor.kl_loss_type=full"],
     ["actor/kl_loss", "actor/kl_loss_k1", "actor/kl_loss_k3", "actor/kl_coef"]),
])
def test_smoke_runs(sft_dir, tmp_path, name, extra, keys):
    rows = run(sft_dir, tmp_path, *extra)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2]
    last = rows[-1]
    for k in COMMON_KEYS + keys:
        assert k in last or k in rows[0], f"{name}: metric {k} missing"
    for r in rows:
        for k, v in r.items():
            if k == "monitor/health":  # the KL monitor's word for the console line
                assert v in ("ok", "warn", "rollback", "stop")
                continue
            assert isinstance(v, (int, float)) and math.isfinite(v), f"{name}: {k}={v}"
    # save_freq 2 writes the last step's checkpoint; save_freq -1 (the grpo case) none at all, as in verl
    assert (latest_checkpoint(tmp_path) is None) == (name == "grpo")
    if name == "grpo":
        assert "critic/vf_loss" not in last  # no critic
        assert not any(tmp_path.glob("global_step_*")) and not (tmp_path / "latest_checkpointed_iteration.txt").exists()
    if name == "kl_loss":  # rollout log-probs and the recomputed ones agree to float error (same weights, same formula)
        assert last["rollout/log_prob_max_diff"] < 1e-4 and last["rollout/bypass"] == 0.0
    else:  # CPU, the fp32 actor samples: bypass_mode=auto takes the old log-probs from the rollout
        assert last["rollout/bypass"] == 1.0 and "timing_s/old_log_prob" not in last


GRPO = ["--config", str(ROOT / "configs" / "grpo_arith.yaml"), "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.save_freq=-1"]
RC = "algorithm.rollout_correction."


@pytest.mark.parametrize("name,extra,keys", [
    ("gspo", [*GRPO, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
              "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], ["actor/kl_loss", "critic/advantages/mean"]),
    ("cispo", [GAE, "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"], ["critic/vf_loss", "actor/reward_kl_penalty"]),
    ("reinforce_plus_plus", ["algorithm.adv_estimator=reinforce_plus_plus"], ["critic/advantages/mean"]),
    ("reinforce_plus_plus_baseline", [*GRPO, "algorithm.adv_estimator=reinforce_plus_plus_baseline"],
     ["critic/advantages/mean"]),
    ("grpo_passk", [*GRPO, "algorithm.adv_estimator=grpo_passk"], ["critic/advantages/mean"]),
    ("remax", ["algorithm.adv_estimator=remax"], ["timing_s/gen_max", "critic/advantages/mean"]),
    ("dapo", ["--config", str(ROOT / "configs" / "dapo_arith.yaml"), "data.train_batch_size=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.save_freq=-1"],
     ["train/num_gen_batches", "train/num_dropped_groups", "critic/overlong_penalty/mean", "critic/overlong_fraction"]),
    ("rollout_is_sequence", [f"{RC}rollout_is=sequence", f"{RC}bypass_mode=false"],
     ["rollout_corr/is_mean", "rollout_corr/is_ess", "rollout_corr/is_clipfrac"]),
    ("rollout_rs", [f"{RC}rollout_rs=token_k1,seq_max_k2", f"{RC}rollout_rs_threshold='0.5_2.0,0.1'",
                    f"{RC}bypass_mode=false"],
     ["rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction"]),
    ("val_at_k", ["actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                  "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"],
     ["val-core/arith/acc/mean@4", "val-core/arith/acc/best@4/mean", "val-core/arith/acc/maj@4/mean",
      "val-aux/arith/acc/worst@4/mean", "val-aux/arith/acc/best@2/mean", "val-aux/arith/acc/std@4"]),
])
def test_policy_losses_estimators_dapo_and_corrections_run(sft_dir, tmp_path, name, extra, keys):
    """Two steps of each: finite metrics, the part's own keys (and no critic without one)."""
    if name == "dapo":  # the tiny warm start answers every problem wrong: a rule with spread, so that groups disagree
        (tmp_path / "checksum.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                              "    return float(sum(map(ord, solution_str)) % 3 == 0)\n")
        extra = [*extra, f"custom_reward_function.path={tmp_path / 'checksum.py'}"]
    rows = run(sft_dir, tmp_path, *extra)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2]
    common = [k for k in COMMON_KEYS if name != "val_at_k" or k != "val-core/arith/acc/mean@1"]
    for k in common + keys:
        assert k in rows[-1] or k in rows[0], f"{name}: metric {k} missing"
    for r in rows:
        for k, v in r.items():
            assert k == "monitor/health" or (isinstance(v, (int, float)) and math.isfinite(v)), f"{name}: {k}={v}"
    if GAE not in extra:  # a critic exactly with GAE
        assert "critic/vf_loss" not in rows[-1]
    if name == "dapo":
        assert all(r["train/num_gen_batches"] >= 1 and "actor/kl_loss" not in r for r in rows[1:])
        assert "actor/reward_kl_penalty" not in rows[-1]  # DAPO: no KL in the reward nor in the loss


@pytest.mark.parametrize("packed", [False, True])
def test_bypass_step_equals_the_recomputing_step(sft_dir, tmp_path, packed):
    """The same first step (same seed: the same rollout) with the old log-probs taken from the
    rollout and recomputed by a forward: one mini-batch, so pi_old is the policy of the whole
    update and every number agrees to float error (losses, KL, grad norm, entropy: 1e-4 relative;
    the rollout and a training forward differ by ~1e-6 in log-prob), and so do the weights after it."""
    rows, weights_after = {}, {}
    for mode in ("true", "false"):
        d = tmp_path / mode
        rows[mode] = run(sft_dir, d, "--config", str(ROOT / "configs" / "grpo_arith.yaml"),
                         "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
                         "trainer.test_freq=-1", "trainer.save_freq=1", f"actor_rollout_ref.model.use_remove_padding={packed}",
                         f"algorithm.rollout_correction.bypass_mode={mode}")[-1]
        weights_after[mode] = weights(latest_checkpoint(d) / "actor")
    by, re_ = rows["true"], rows["false"]
    assert by["rollout/bypass"] == 1.0 and re_["rollout/bypass"] == 0.0
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
        assert abs(by[k] - re_[k]) <= 1e-4 * max(1.0, abs(re_[k])), k
    for name, w in weights_after["false"].items():
        assert torch.allclose(weights_after["true"][name], w, atol=1e-6), name


def test_full_kl_in_the_reward_equals_kl_div_recomputed(sft_dir, tmp_path, monkeypatch):
    """Catch what the run hands compute_full_kl (the models and the step's batch), recompute the
    exact KL of a micro-batch with plain forwards and torch's kl_div, and check it against what the
    run computed and logged (actor/reward_kl_penalty: per-response token means, averaged)."""
    import copy

    import torch.nn.functional as F

    from nanokl import forwards
    from nanokl.engine import shard
    seen = []
    original = forwards.compute_full_kl

    def spy(actor, ref, batch, temperature, spec):
        out = original(actor, ref, batch, temperature, spec)
        models = copy.deepcopy(shard.unwrap(actor)).double(), copy.deepcopy(shard.unwrap(ref)).double()
        seen.append((models, {k: v.clone() for k, v in batch.items() if v is not None}, temperature, out))
        return out
    monkeypatch.setattr(forwards, "compute_full_kl", spy)
    rows = run(sft_dir, tmp_path, "algorithm.kl_penalty=full", "trainer.test_freq=-1")
    assert len(seen) == 2  # one per step
    for step, ((policy, ref), batch, temperature, out) in enumerate(seen, start=1):
        mask = batch["response_mask"]
        for i in range(3):  # a micro-batch of three responses, each forwarded on its own, unpadded
            real = batch["attention_mask"][i].bool()
            seq = batch["sequences"][i][real][None]
            n_resp = int(mask[i].sum())
            logits = [m(seq)[0, -n_resp - 1:-1] / temperature for m in (policy, ref)]
            logp, ref_logp = (F.log_softmax(z, dim=-1) for z in logits)
            want = F.kl_div(ref_logp, logp, log_target=True, reduction="none").sum(-1)
            torch.testing.assert_close(out[i][:n_resp].double(), want, rtol=1e-4, atol=1e-6)
            assert torch.all(out[i][n_resp:] == 0)  # right padding carries no KL
        per_response = (out * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        logged = rows[step]["actor/reward_kl_penalty"]
        assert logged == pytest.approx(per_response.mean().item(), rel=1e-5)
        # the estimators on the same tokens, beside it: k1 and k3 are estimates of the same KL
        assert math.isfinite(rows[step]["actor/reward_kl_k1"]) and rows[step]["actor/reward_kl_k3"] >= 0


def weights(path):
    return load_file(Path(path) / "model.safetensors")


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "gae"])
def test_exact_resume(sft_dir, tmp_path, estimator):
    """The default (REINFORCE++: an actor only) and GAE (actor and critic) resume bit for bit."""
    steps4 = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1",
              f"algorithm.adv_estimator={estimator}"]
    run(sft_dir, tmp_path / "a", *steps4)
    # 2 steps, stop, then resume (auto) and run to 4
    run(sft_dir, tmp_path / "b", "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
        f"algorithm.adv_estimator={estimator}")
    run(sft_dir, tmp_path / "b", *steps4)
    a, b = latest_checkpoint(tmp_path / "a"), latest_checkpoint(tmp_path / "b")
    assert a.name == b.name == "global_step_4"
    parts = ("actor", "critic") if estimator == "gae" else ("actor",)
    assert (a / "critic").exists() == (estimator == "gae")
    for part in parts:
        wa, wb = weights(a / part), weights(b / part)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{part}/{k} differs after resume"
    assert load_state(a)[1]["kl_ctrl"] == load_state(b)[1]["kl_ctrl"]
    ma, mb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert ma[-1]["actor/reward_kl_penalty_coeff"] == mb[-1]["actor/reward_kl_penalty_coeff"]


def raw_rows(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl") if line.strip()]


def test_resume_logs_each_step_once(sft_dir, tmp_path):
    """A run resumed from an earlier checkpoint than its last logged step (a crash between checkpoints)
    redoes those steps: metrics.jsonl must then hold each step once, each row as an uninterrupted run
    logged it (timing aside)."""
    steps4 = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1"]
    run(sft_dir, tmp_path / "a", *steps4)
    run(sft_dir, tmp_path / "b", "trainer.total_training_steps=3", "trainer.save_freq=2", "trainer.test_freq=-1")
    assert [r["training/global_step"] for r in raw_rows(tmp_path / "b")] == [0, 1, 2, 3]
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write('{"training/global_step": 4, "actor/pg_l')  # a row cut by the crash
    run(sft_dir, tmp_path / "b", *steps4, "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path / 'b' / 'global_step_2'}")  # verl's layout
    a, b = raw_rows(tmp_path / "a"), raw_rows(tmp_path / "b")
    assert [r["training/global_step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        assert {k: v for k, v in ra.items() if not k.startswith(QUIET)} == \
            {k: v for k, v in rb.items() if not k.startswith(QUIET)}


def test_auto_resume_skips_truncated_weights(sft_dir, tmp_path, capfd):
    """The fault as a user met it: the newest checkpoint's actor weights truncated. resume_mode=auto
    names the file, resumes from the one before, and ends where an uninterrupted run ends."""
    steps4 = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1"]
    run(sft_dir, tmp_path / "a", *steps4)
    run(sft_dir, tmp_path / "b", *steps4)
    bad = tmp_path / "b" / "global_step_4" / "actor" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:1000])
    capfd.readouterr()
    run(sft_dir, tmp_path / "b", *steps4)
    err = capfd.readouterr().err
    assert f"checkpoint global_step_4 skipped: {bad}" in err and "at step 2" in err
    wa, wb = weights(tmp_path / "a" / "global_step_4" / "actor"), weights(bad.parent)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["training/global_step"] for r in raw_rows(tmp_path / "b")] == [0, 1, 2, 3, 4]


def test_drop_rows_after_matches_a_filter(tmp_path):
    """drop_rows_after keeps exactly the whole rows of steps <= k, in order, and touches nothing when
    nothing is to go."""
    from nanokl.harness.tracking import drop_rows_after
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"training/global_step": s, "x": s * 0.5}) + "\n" for s in (0, 1, 2, 2, 3, 4, 5)]
    path.write_text("".join(lines) + '{"training/global_step": 6, "x"')
    assert drop_rows_after(path, 3) == 3  # steps 4, 5 and the cut line
    assert path.read_text() == "".join(ln for ln in lines if json.loads(ln)["training/global_step"] <= 3)
    before = path.stat().st_mtime_ns
    assert drop_rows_after(path, 3) == 0 and path.stat().st_mtime_ns == before
    assert drop_rows_after(tmp_path / "missing.jsonl", 3) == 0


def test_crash_during_checkpoint_write_keeps_previous(sft_dir, tmp_path):
    run(sft_dir, tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1", GAE)
    before = latest_checkpoint(tmp_path)
    # a second process dies (os._exit, no cleanup) in the middle of writing step 4's weights
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import nanokl.harness.hf_format as hf
real = hf.save_tensors
def dying(sd, path, dtype=None):
    real(sd, path, dtype)
    if "global_step_4" in str(path) and path.name == "critic":
        os._exit(9)
hf.save_tensors = dying
import train_ppo
train_ppo.main(["--config", {str(ROOT / 'configs' / 'arith_tiny.yaml')!r}, *{TINY!r},
    "actor_rollout_ref.model.path={sft_dir}", "trainer.default_local_dir={tmp_path}",
    "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1", {GAE!r}])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert (tmp_path / "global_step_4.tmp").exists()  # the half-written one
    assert latest_checkpoint(tmp_path) == before  # still the tracker's target
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"  # it never names a .tmp
    load_state(before)
    from nanokl.harness.hf_format import from_pretrained, load_value_model
    from_pretrained(before / "actor")
    load_value_model(before / "critic")


def cli(*argv):
    return subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), *argv], capture_output=True, text=True,
                          cwd=ROOT)


def test_user_errors_exit_2_with_one_line(sft_dir, tmp_path):
    bad_key = cli("algorithm.kl_ctrl.target_kll=0.1")
    assert bad_key.returncode == 2
    lines = bad_key.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.kl_ctrl.target_kll" in lines[0] and "target_kl" in lines[0]

    missing = cli(f"actor_rollout_ref.model.path={tmp_path / 'nope'}", f"trainer.default_local_dir={tmp_path / 'r'}",
                  "data.task=gsm8k", "data.train_files=x.jsonl")
    assert missing.returncode == 2
    lines = [line for line in missing.stderr.strip().splitlines() if not line.startswith("note: ")]  # start-up notes
    assert len(lines) == 1 and str(tmp_path / "nope") in lines[0], missing.stderr

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n{not json\n")
    malformed = cli(f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={tmp_path / 'r2'}",
                    "data.task=gsm8k", f"data.train_files={data}", f"data.val_files={data}")
    assert malformed.returncode == 2
    lines = [line for line in malformed.stderr.strip().splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and f"{data}:2" in lines[0], malformed.stderr


def test_nan_loss_is_skipped_then_stops_the_run(sft_dir, tmp_path, monkeypatch):
    from nanokl import workers
    real = workers.compute_policy_loss
    calls = {"n": 0}

    def poisoned(*args, **kw):
        loss, m = real(*args, **kw)
        calls["n"] += 1
        return loss * float("nan"), m

    monkeypatch.setattr(workers, "compute_policy_loss", poisoned)  # update_actor looks the loss up at each call
    with pytest.raises(TrainingStopped, match="3 steps in a row"):
        run(sft_dir, tmp_path, "trainer.total_training_steps=10", "trainer.save_freq=-1", "trainer.test_freq=-1")
    rows = read_metrics(tmp_path)
    assert [r["actor/nan_skipped"] for r in rows if r["training/global_step"] > 0] == [2, 2, 2]  # 2 mini-batches
    assert latest_checkpoint(tmp_path).name == "global_step_3"
    # the skipped updates left the actor exactly at the warm start
    w0, w3 = weights(sft_dir), weights(latest_checkpoint(tmp_path) / "actor")
    assert all(torch.equal(w0[k], w3[k]) for k in w0)


def test_fresh_heads_and_warm_start_draw_from_their_own_seeded_generators(sft_dir, tmp_path):
    """The value head and the RM head are normal(0, initializer_range) rows from a CPU generator of
    their own seed (the reference: that generator drawn here), whatever torch's global generator
    went through before; the warm start neither depends on nor moves the global generator."""
    from nanokl.harness.config.load import load_config
    from nanokl.harness.hf_format import load_value_model, read_config
    from nanokl.harness.hf_format import load_reward_model
    from nanokl.supervised.sft import train_sft
    H, std = read_config(sft_dir)[0]["hidden_size"], read_config(sft_dir)[0]["initializer_range"]
    want = torch.randn(1, H, generator=torch.Generator().manual_seed(7), dtype=torch.float32) * std
    for noise in (0, 1000):
        torch.randn(noise)  # another history of the global generator
        assert torch.equal(load_value_model(sft_dir, seed=7).score.weight.detach(), want)
        assert torch.equal(load_reward_model(sft_dir, seed=7).score.weight.detach(), want)
    assert not torch.equal(load_value_model(sft_dir, seed=8).score.weight.detach(), want)

    tiny = ["sft.steps=3", "sft.num_examples=128", "data.num_val=8", "sft.hidden_size=32", "sft.intermediate_size=48",
            "sft.num_hidden_layers=1"]
    made = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        out = tmp_path / f"sft{global_seed}"
        train_sft(load_config(ROOT / "configs" / "arith_tiny.yaml", [*tiny, f"sft.output_dir={out}"]), progress=False)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is untouched
        made.append(weights(out))
    assert made[0].keys() == made[1].keys() and all(torch.equal(made[0][k], made[1][k]) for k in made[0])


def test_same_run_whether_the_warm_start_was_trained_in_process_or_loaded(tmp_path):
    """The fault as a user met it: the first run trains the warm start in its own process, the second
    finds it on disk. Same command, same run: every logged number equal (timing aside)."""
    sft = tmp_path / "sft"
    tiny = ["sft.steps=20", "sft.num_examples=256", "sft.hidden_size=32", "sft.intermediate_size=48",
            "sft.num_hidden_layers=1", "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1",
            GAE]  # the critic too is built from the warm start
    run(sft, tmp_path / "a", *tiny)  # trains the warm start first (sft.output_dir = model path)
    run(sft, tmp_path / "b", *tiny)  # loads it
    a, b = raw_rows(tmp_path / "a"), raw_rows(tmp_path / "b")
    assert len(a) == len(b) == 3 and "critic/values/mean" in a[1]

    def strip(r):
        return {k: v for k, v in r.items() if not k.startswith(QUIET)}
    assert [strip(r) for r in a] == [strip(r) for r in b]
