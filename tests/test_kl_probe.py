"""The on-policy KL probe (nanokl/kl_probe.py, algorithm.kl_probe).

- probe_sums equals a naive float64 loop: the same samples (the same generator seed) fed one
  response at a time, unpadded, through float64 copies of the policy and the reference.
- Scripted: the reward's controller and the KL-loss controller move with the corrected KL (logged
  + smoothed gap), not with the logged estimate, by the controller's formula written out.
- An offline run of 3 tiny steps with the probe: finite metrics, step 0's probe reads 0 (π = π_ref),
  the controller and the monitor read the corrected value, the cost adds up.
"""

import copy
import functools
import math
from types import SimpleNamespace

import pytest
import torch

from nanokl.harness import variants
from nanokl.harness.hf_format import from_pretrained
from nanokl.harness.tokenizer import load_tokenizer
from nanokl.harness.data import build_prompts
from nanokl.kl_ctrl import AdaptiveKLController
from nanokl.kl_probe import ProbeState, probe_stats, probe_sums
from nanokl.rollout import generate
from test_train_offline import logged_file, run  # noqa: F401 (a fixture)


@torch.no_grad()
def loop_kl(policy, ref, prompt_ids, prompt_mask, out, temperature, kind):
    """(1/N) Σ_i (1/n_i) Σ_t k_it, each response alone and unpadded, in float64."""
    policy, ref = copy.deepcopy(policy).double(), copy.deepcopy(ref).double()
    per = []
    for i in range(len(prompt_ids)):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        n = int(out.response_mask[i].sum())
        resp = out.responses[i, :n]
        seq = torch.cat([prompt, resp])[None]
        pos = torch.arange(seq.shape[1])[None]
        lp = torch.log_softmax(policy(seq, torch.ones_like(seq), pos)[0] / temperature, -1)
        lr = torch.log_softmax(ref(seq, torch.ones_like(seq), pos)[0] / temperature, -1)
        total = 0.0
        for t in range(n):
            row = len(prompt) - 1 + t  # the logits at this position predict response token t
            if kind == "full":
                total += float((lp[row].exp() * (lp[row] - lr[row])).sum())
            else:
                total += float(lp[row, resp[t]] - lr[row, resp[t]])
        per.append(total / n if n else 0.0)
    return sum(per) / len(per)


@pytest.mark.parametrize("kind", ["kl", "full"])
def test_probe_kl_equals_a_float64_loop(sft_dir, kind):
    ref = from_pretrained(sft_dir).eval()
    policy = copy.deepcopy(ref)
    with torch.no_grad():  # a policy that has moved: the KL is far from 0
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    tok = load_tokenizer(sft_dir)
    examples = [{"prompt": f"Q: {a}+{b}-3=?\nA:"} for a, b in [(1, 2), (17, 4), (9, 9), (20, 11), (5, 0)]]
    ids, mask = build_prompts(examples, tok, "plain", 24)
    ro = SimpleNamespace(response_length=12, temperature=0.7, top_k=-1, top_p=1.0, do_sample=True,
                         use_cuda_graph=False)
    sums = probe_sums(policy, ref, policy, ids, mask, ro, kind, tok.eos_token_ids, tok.pad_token_id,
                      torch.Generator().manual_seed(3))
    out = generate(policy, ids, mask, 12, 0.7, eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                   generator=torch.Generator().manual_seed(3))
    want = loop_kl(policy, ref, ids, mask, out, 0.7, kind)
    p, se = probe_stats(sums)
    assert abs(want) > 1e-3 and p == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert sums[2] == len(examples) and sums[3] == out.response_mask.sum() and se > 0


def test_the_controllers_read_the_corrected_kl(monkeypatch):
    """Four scripted steps, probing every 2nd: the gap is p − l at step 0, then 0.7·gap + 0.3·(p − l)
    at step 2, held in between; β moves by 1 + clip(read/target − 1, ±0.2)·n/H with read = l + gap."""
    logged, probes = [0.01, 0.02, 0.03, 0.04], {0: 0.05, 2: 0.03}
    kp = SimpleNamespace(enable=True, every=2, prompts=4, ema=0.3)
    cfg = SimpleNamespace(algorithm=SimpleNamespace(kl_probe=kp, kl_penalty="kl"), trainer=SimpleNamespace(seed=0),
                          data=SimpleNamespace(train_batch_size=8, seed=0, shuffle=False, prompt_template="plain",
                                               max_prompt_length=24, truncation="error"),
                          actor_rollout_ref=SimpleNamespace(rollout=None))
    ctrl = AdaptiveKLController(0.1, 0.05, horizon=40)
    fake = SimpleNamespace(cfg=cfg, start=0, world=1, rank=0, train=[{}] * 8, tok=SimpleNamespace(eos_token_ids=[0],
                           pad_token_id=0), device=torch.device("cpu"), actor=None, ref=None, rollout_model=None,
                           specs={"old": None}, kl_ctrl=ctrl)
    step = {"i": 0}
    monkeypatch.setattr(variants, "encode_prompts", lambda *a, **k: (None, None))
    monkeypatch.setattr(variants, "probe_sums", lambda *a, **k: torch.tensor(
        [probes[step["i"]] * 4, probes[step["i"]] ** 2 * 4, 4.0, 40.0], dtype=torch.float64))
    read = functools.partial(variants.probed_kl, fake, ProbeState())
    mask = torch.ones(4, 3)
    beta, gap = 0.1, None
    for i, l in enumerate(logged):
        step["i"] = i
        metrics, coeff, kl = {}, ctrl.value, torch.zeros(4, 3)  # ppo_step's step 4, on a logged KL of l
        current = read({"response_mask": mask, "is_weights": None}, kl, l, metrics)
        ctrl.update(current, n_steps=len(mask))
        metrics.update(variants.reward_kl_metrics(fake, kl, mask, current, coeff))
        if i in probes:
            gap = probes[i] - l if gap is None else 0.7 * gap + 0.3 * (probes[i] - l)
        want = l + gap
        beta *= 1 + min(max(want / 0.05 - 1, -0.2), 0.2) * 4 / 40
        assert metrics["actor/reward_kl_penalty"] == pytest.approx(want) == metrics["kl_probe/kl_corrected"]
        assert metrics["rollout_corr/kl_logged"] == l and ("kl_probe/kl" in metrics) == (i in probes)
        assert ctrl.value == pytest.approx(beta)
        assert metrics["kl_probe/responses"] == 4 * (i // 2 + 1) and metrics["kl_probe/tokens"] == 40 * (i // 2 + 1)
    assert ctrl.value != pytest.approx(0.1 * 0.98 ** 4)  # what reading l alone (4 steps under target) would give

    # the KL-loss controller (train_ppo.py's steer_kl_loss) reads the corrected KL when there is one
    from train_ppo import steer_kl_loss
    loss_ctrl = AdaptiveKLController(0.3, 0.05, horizon=640)
    holder = SimpleNamespace(kl_loss_ctrl=loss_ctrl, cfg=SimpleNamespace(data=SimpleNamespace(train_batch_size=64),
                             actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(n=1))))
    steer_kl_loss(holder, {"actor/kl_loss": 0.01, "kl_probe/kl_corrected": 0.06})
    assert loss_ctrl.value == pytest.approx(0.3 * (1 + 0.2 * 64 / 640))  # 0.06 > target: up (0.01 would go down)
    steer_kl_loss(holder, {"actor/kl_loss": math.nan, "kl_probe/kl_corrected": 0.06})  # no update: unmoved
    assert loss_ctrl.value == pytest.approx(0.3 * (1 + 0.2 * 64 / 640))


def test_an_offline_run_with_the_probe(sft_dir, tmp_path, logged_file):  # noqa: F811
    rows = run(sft_dir, tmp_path, logged_file, "algorithm.kl_probe.enable=true", "algorithm.kl_probe.prompts=4",
               "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive",
               "trainer.kl_monitor.enable=true")
    steps = rows[1:]
    assert [r["training/global_step"] for r in steps] == [1, 2, 3]
    assert steps[0]["kl_probe/kl"] == pytest.approx(0.0, abs=1e-6)  # step 0: π = π_ref
    for i, r in enumerate(steps):
        for k in ("kl_probe/kl", "kl_probe/kl_se", "kl_probe/gap", "rollout_corr/kl_logged", "actor/pg_loss"):
            assert math.isfinite(r[k]), k
        assert r["actor/reward_kl_penalty"] == r["kl_probe/kl_corrected"]  # the monitor's KL
        assert r["kl_probe/kl_corrected"] == pytest.approx(r["rollout_corr/kl_logged"] + r["kl_probe/gap"])
        assert r["kl_probe/responses"] == 4 * (i + 1) and r["kl_probe/tokens"] >= r["kl_probe/responses"]
    assert steps[-1]["kl_probe/kl"] != 0.0
