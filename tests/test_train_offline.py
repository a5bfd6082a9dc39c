"""The offline step (train_ppo.py with data.offline_files): logged responses instead of a rollout.

- An offline PPO run never calls the rollout in a training step (it is replaced by one that
  raises), logs the importance weights, the weighted and unweighted KL and the on-policy KL
  measured at validation; at the first step pi_old = pi_ref = mu (no log-probs logged: mu is the
  reference), so every weight is 1 and the logged KL 0, to float rounding.
- DPO in the same step: at the first step pi = pi_ref, so every pair's loss is log 2; and the
  micro-batched DPO update (one pair per micro-batch) equals the one-batch update.
- `torchrun --nproc_per_node=2` offline equals one process: the draw of logged responses does not
  depend on the ranks, so the same responses train, and metrics and weights agree.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from nanokl.harness import variants
from nanokl.harness.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=3",
        "trainer.save_freq=3", "trainer.total_training_steps=3", "trainer.val_kl_prompts=8",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.adv_estimator=gae"]  # the step with a critic: its weights, optimizer and resume too


@pytest.fixture(scope="module")
def logged_file(tmp_path_factory):
    """Ranked logged responses to 16 training problems of the arithmetic task (no log-probs: mu = pi_ref)."""
    from nanokl.harness.config.load import load_config
    from nanokl.tasks import get_task
    cfg = load_config(ROOT / "configs" / "arith_tiny.yaml", ["data.num_train=16", "data.num_val=0"])
    train, _ = get_task("arith").examples(cfg.data, seed=0)
    path = tmp_path_factory.mktemp("logged") / "logged.jsonl"
    with open(path, "w") as f:
        for ex in train:
            t = ex["ground_truth"]
            f.write(json.dumps({"prompt": ex["prompt"], "responses": [f" #### {t}", f" Answer: {t}", " #### 0"],
                                "ranking": [0, 1, 2], "ground_truth": t, "data_source": ex["data_source"]}) + "\n")
    return path


def run(sft_dir, run_dir, logged_file, *extra):
    train_ppo.main(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY,
                    f"actor_rollout_ref.model.path={sft_dir}", f"data.offline_files={logged_file}",
                    f"trainer.default_local_dir={run_dir}", *extra])
    return read_metrics(run_dir)


def never(*args, **kwargs):
    raise AssertionError("an offline training step called the rollout")


def test_offline_ppo_never_samples_and_logs_its_kl(sft_dir, tmp_path, logged_file, monkeypatch):
    monkeypatch.setattr(variants, "sample", never)  # the training step's sampler; validation's (harness/scoring.py) stays
    rows = run(sft_dir, tmp_path, logged_file, "actor_rollout_ref.rollout.n=2")
    assert [r["training/global_step"] for r in rows] == [0, 1, 2, 3]
    first = rows[1]
    # step 0: pi_old = pi_ref = mu (same weights; the two forwards differ only by float rounding: the
    # policy and the reference batch their forwards differently), so every weight is 1 and the KL 0
    assert first["rollout_corr/is_mean"] == pytest.approx(1.0, abs=1e-6) and first["rollout_corr/is_clipfrac"] == 0.0
    assert first["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert first["rollout_corr/kl_unweighted"] == pytest.approx(0.0, abs=1e-6)
    for r in rows[1:]:
        for k in ("actor/pg_loss", "actor/reward_kl_penalty", "rollout_corr/kl_unweighted", "rollout_corr/is_ess",
                  "critic/score/mean", "critic/vf_loss"):
            assert math.isfinite(r[k]), k
        assert "rollout/log_prob_max_diff" not in r and r["rollout/bypass"] == 0.0
    assert rows[2]["rollout_corr/is_mean"] != 1.0  # the policy moved: the weights are no longer trivial
    assert math.isfinite(rows[-1]["val-aux/kl_on_policy"]) and rows[-1]["val-aux/kl_on_policy_se"] >= 0
    assert rows[0]["val-aux/kl_on_policy"] == pytest.approx(0.0, abs=1e-6)  # before training pi = pi_ref


def test_offline_sequence_weights_and_rejection(sft_dir, tmp_path, logged_file):
    """rollout_is=sequence and rollout_rs offline: at the first step pi_old = mu = pi_ref, nothing is
    rejected and every weight is 1; once the policy has moved, a tight band rejects tokens."""
    rc = "algorithm.rollout_correction."
    rows = run(sft_dir, tmp_path, logged_file, "actor_rollout_ref.rollout.n=2", f"{rc}rollout_is=sequence",
               f"{rc}rollout_rs=token_k1", f"{rc}rollout_rs_threshold='0.999_1.001'")
    first, last = rows[1], rows[-1]
    assert first["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and first["rollout_corr/is_mean"] == pytest.approx(1.0)
    assert 0 < last["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert last["rollout_corr/rollout_rs_masked_fraction"] <= last["rollout_corr/rollout_rs_seq_masked_fraction"]
    for r in rows[1:]:
        for k in ("actor/pg_loss", "actor/reward_kl_penalty", "rollout_corr/is_ess", "critic/vf_loss"):
            assert math.isfinite(r[k]), k
        assert r["actor/nan_skipped"] == 0


def test_a_mini_batch_whose_tokens_were_all_rejected_adds_a_loss_of_0(sft_dir, tmp_path, logged_file):
    """A band nothing fits once the policy moved: every token leaves the mask, and the update is a
    finite no-op loss (0 / 0 would skip it as non-finite and stop the run)."""
    rc = "algorithm.rollout_correction."
    rows = run(sft_dir, tmp_path, logged_file, "actor_rollout_ref.rollout.n=2", f"{rc}rollout_rs=token_k1",
               f"{rc}rollout_rs_threshold='0.9999999_1.0000001'")
    assert rows[-1]["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert all(r["actor/pg_loss"] == 0.0 and r["critic/vf_loss"] == 0.0 and r["actor/nan_skipped"] == 0
               for r in rows[2:])


def test_dpo_in_the_offline_step(sft_dir, tmp_path, logged_file, monkeypatch):
    monkeypatch.setattr(variants, "sample", never)
    rows = run(sft_dir, tmp_path, logged_file, "actor_rollout_ref.actor.objective=dpo", "actor_rollout_ref.rollout.n=2",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
               "critic.ppo_mini_batch_size=8")  # one mini-batch a step: its loss is all at pi = pi_ref
    assert not (tmp_path / "global_step_3" / "critic").exists()  # DPO builds no critic
    assert rows[1]["actor/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # pi = pi_ref: h = 0 for every pair
    assert rows[1]["actor/dpo_reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["actor/dpo_loss"] < math.log(2)  # the chosen responses gained on the rejected ones
    assert all(math.isfinite(r["actor/reward_kl_penalty"]) for r in rows[1:])


def test_dpo_micro_batches_equal_one_batch(sft_dir, logged_file):
    """One pair per micro-batch accumulates exactly the gradient of the whole mini-batch's DPO loss."""
    from types import SimpleNamespace
    from nanokl import dpo, forwards
    from nanokl.engine.batching import Batching
    from nanokl.harness.hf_format import from_pretrained
    from nanokl.harness.logged import draw_responses, logged_batch, read_logged
    from nanokl.harness.tokenizer import load_tokenizer
    tok = load_tokenizer(sft_dir)
    rows = read_logged(logged_file, tok, need_ranking=True)[:4]
    out = logged_batch(rows, [draw_responses(r, 2, 0, 0, i) for i, r in enumerate(rows)], tok)
    batch = {k: getattr(out, k) for k in ("sequences", "attention_mask", "position_ids", "responses", "response_mask")}
    ref = from_pretrained(sft_dir)
    batch["ref_log_probs"], _ = forwards.compute_log_probs(ref, batch, 1.0)
    a = SimpleNamespace(objective="dpo", ppo_epochs=1, grad_clip=1e9)
    params = []
    for micro in (None, 2):
        torch.manual_seed(0)
        actor = from_pretrained(sft_dir)
        with torch.no_grad():  # move off pi_ref so that h != 0 and the pairs weigh differently
            for p in actor.parameters():
                p.add_(0.01 * torch.randn_like(p))
        opt = torch.optim.SGD(actor.parameters(), lr=1.0)
        m = dpo.update_policy(actor, opt, batch, a, 1.0, mini_size=8, spec=Batching(micro), beta=0.1)
        params.append(torch.cat([p.detach().flatten() for p in actor.parameters()]))
    assert (params[0] - params[1]).abs().max().item() < 1e-6
    assert m["actor/dpo_loss"][0] > 0


def test_torchrun_two_processes_equal_one(sft_dir, tmp_path, logged_file):
    from test_dist import torchrun
    args = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY, f"actor_rollout_ref.model.path={sft_dir}",
            f"data.offline_files={logged_file}", "actor_rollout_ref.rollout.n=2", "trainer.val_kl_prompts=0",
            # one mini-batch a step: with two, each process's first half would form the first mini-batch,
            # another split of the prompts than one process makes (true of online runs as well)
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_ppo.main([*args, f"trainer.default_local_dir={one}"])
    torchrun(str(ROOT / "train_ppo.py"), *args, f"trainer.default_local_dir={two}", nproc=2)
    a, b = read_metrics(one), read_metrics(two)
    assert len(a) == len(b) == 4
    for ra, rb in zip(a[1:], b[1:]):
        for k in ("actor/pg_loss", "actor/reward_kl_penalty", "rollout_corr/is_mean", "critic/score/mean",
                  "critic/vf_loss", "actor/reward_kl_penalty_coeff"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), k
    wa = load_file(one / "global_step_3" / "actor" / "model.safetensors")
    wb = load_file(two / "global_step_3" / "actor" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
