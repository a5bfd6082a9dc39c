"""The step's parts for DAPO, ReMax and rollout correction (nanokl/harness/variants.py, scoring.py),
each against what it must equal, computed another way:

- sample_kept_groups with a scripted scorer: the rounds draw the next batches of the epoch, the kept
  groups are the first data.train_batch_size that disagree, in generation order, whole, and the
  rounds' prompts and responses (of different widths) join in a rollout's layout; the round cap
  stops the run in one line;
- the overlong buffer in score_batch: each score is the rule's plus DAPO's formula written out, on
  the response's last token, the rule score unshaped, the metric its mean;
- greedy_baselines (remax): each prompt's score equals the score of its greedy response generated
  alone, repeated over its rollout.n rows;
- the correct parts: sequence_is and rejection equal offline.py's weights and mask, with verl's
  metric names;
- validate with val_kwargs.n > 1: best@k / worst@k / maj@k equal test_val_metrics.validation_metrics on
  the very responses validate sampled, scored and voted on by the same functions.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nanokl.harness import scoring, variants
from nanokl.harness.config.load import load_config
from nanokl.harness.data import rank_rows
from nanokl.harness.run_state import TrainingStopped
from nanokl import offline
from nanokl.offline import rejection_mask, rs_sums, sequence_is_weights
from nanokl.rollout import RolloutOutput
from nanokl.tasks import arith
from test_val_metrics import validation_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "arith_tiny.yaml"
PAD = 0


# ---------------------------------------------------------------------------------------------
# sample_kept_groups: DAPO's rounds against a scripted scorer
# ---------------------------------------------------------------------------------------------

def fake_rollout(rows, n, width_p, width_r):
    """n responses per row; prompt k of the round holds token 100 + row id (left-padded to width_p,
    one real token more per row), response j of it 1000 * row + j, then right padding to width_r."""
    N = len(rows) * n
    ids, pmask = torch.full((N, width_p), PAD), torch.zeros(N, width_p, dtype=torch.long)
    resp, rmask = torch.full((N, width_r), PAD), torch.zeros(N, width_r, dtype=torch.long)
    for i in range(N):
        row, j = rows[i // n], i % n
        plen, rlen = 1 + (i // n) % width_p, 1 + j % width_r
        ids[i, width_p - plen:], pmask[i, width_p - plen:] = 100 + row, 1
        resp[i, :rlen], rmask[i, :rlen] = 1000 * row + j, 1
    prompt_pos = (pmask.cumsum(-1) - 1).clamp(min=0)
    resp_pos = pmask.sum(-1, keepdim=True) + torch.arange(width_r)
    return RolloutOutput(sequences=torch.cat([ids, resp], 1), attention_mask=torch.cat([pmask, rmask], 1),
                         position_ids=torch.cat([prompt_pos, resp_pos], 1), responses=resp, response_mask=rmask,
                         log_probs=-rmask.float() * 0.5, prompt_length=width_p)


def kept_run(monkeypatch, accs, max_rounds=0, target=4, n=2):
    """A run whose k-th round scores its responses `accs[k]` (a list per prompt of n values)."""
    cfg = load_config(TINY, ["data.num_train=64", f"data.train_batch_size={target}", f"actor_rollout_ref.rollout.n={n}",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "algorithm.filter_groups.enable=true",
                             "algorithm.filter_groups.metric=acc",
                             f"algorithm.filter_groups.max_num_gen_batches={max_rounds}"])
    train = [{"prompt": f"p{i}", "ground_truth": "0", "data_source": "arith"} for i in range(64)]
    run = SimpleNamespace(cfg=cfg, train=train, rank=0, world=1, tok=SimpleNamespace(pad_token_id=PAD), rm=None)
    seen = []

    def sample(run_, rows, step, generator, metrics):
        seen.append(list(rows))
        k = len(seen) - 1
        return fake_rollout(rows, n, width_p=2 + k % 2, width_r=3 + k), [train[r] for r in rows for _ in range(n)]

    def score(tok, out, examples, cfg_, rm=None, **kw):
        rule = torch.tensor([a for group in accs[len(seen) - 1] for a in group], dtype=torch.float32)
        return torch.zeros(out.response_mask.shape), rule + 5.0, rule  # the filter must read the rule (acc)
    monkeypatch.setattr(variants, "sample_responses", sample)
    monkeypatch.setattr(variants, "score_batch", score)
    return run, seen


def test_sample_kept_groups_draws_the_next_batches_until_enough_groups_disagree(monkeypatch):
    accs = [[[1, 1], [0, 1], [0, 0], [1, 1]],   # round 0: prompt 1 kept
            [[0, 0], [0, 0], [1, 1], [1, 1]],   # round 1: none
            [[1, 0], [0, 0], [0, 1], [1, 0]],   # round 2: prompts 0, 2, 3 kept: 4 in all
            ]
    run, seen = kept_run(monkeypatch, accs)
    d, step = run.cfg.data, 5
    rows0 = rank_rows(64, 4, step, d.seed, d.shuffle, 0, 1)
    metrics = {}
    out, examples = variants.sample_kept_groups(run, rows0, step, None, metrics)
    assert seen == [rank_rows(64, 4, step + k, d.seed, d.shuffle, 0, 1) for k in range(3)]  # the next batches
    assert metrics == {"train/num_gen_batches": 3, "train/num_dropped_groups": 12 - 4}
    kept = [seen[0][1], seen[2][0], seen[2][2], seen[2][3]]  # generation order
    assert [ex["prompt"] for ex in examples] == [f"p{r}" for r in kept for _ in range(2)]
    # every response comes whole: its prompt, its tokens, its mask, its log-probs; left / right padding to the widest round
    P, R = out.prompt_length, out.responses.shape[1]
    assert (P, R) == (3, 5) and out.sequences.shape == (8, P + R)
    for i, row in enumerate(r for r in kept for _ in range(2)):
        prompt = out.sequences[i, :P][out.attention_mask[i, :P].bool()]
        assert prompt.tolist() == [100 + row] * len(prompt) and out.attention_mask[i, :P].tolist()[0] == 0
        rlen = int(out.response_mask[i].sum())
        assert out.responses[i, :rlen].tolist() == [1000 * row + i % 2] * rlen and out.responses[i, rlen:].eq(PAD).all()
        assert torch.equal(out.sequences[i, P:], out.responses[i])
        assert out.log_probs[i, :rlen].eq(-0.5).all() and out.log_probs[i, rlen:].eq(0).all()
        # positions as the rollout makes them: the prompt's count on from 0, the response's after it
        pos, mask = out.position_ids[i], out.attention_mask[i, :P]
        assert pos[:P][mask.bool()].tolist() == list(range(int(mask.sum())))
        assert pos[P:].tolist() == list(range(int(mask.sum()), int(mask.sum()) + R))


def test_sample_kept_groups_stops_at_the_round_cap_in_one_line(monkeypatch):
    accs = [[[1, 1], [0, 1], [0, 0], [1, 1]], [[0, 0], [0, 0], [1, 1], [1, 1]]]
    run, _ = kept_run(monkeypatch, accs, max_rounds=2)
    with pytest.raises(TrainingStopped) as e:
        variants.sample_kept_groups(run, rank_rows(64, 4, 0, 42, True, 0, 1), 0, None, {})
    assert "kept 1 of 4 prompts in 2 rounds" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# the overlong buffer in score_batch
# ---------------------------------------------------------------------------------------------

def test_overlong_buffer_in_score_batch_is_dapos_formula(monkeypatch):
    R, buf, factor = 32, 8, 1.0
    lengths = [0, 5, 24, 25, 28, 31, 32, 32]
    texts = ["#### 7" if i % 2 else "no" for i in range(len(lengths))]  # rule: 1 for odd rows
    mask = torch.tensor([[1] * L + [0] * (R - L) for L in lengths])
    eos = 2
    responses = torch.where(mask.bool(), 5, PAD)
    for i, L in enumerate(lengths[:-1]):  # every response ends with its EOS but the last (cut at the limit)
        if L:
            responses[i, L - 1] = eos
    out = SimpleNamespace(responses=responses, response_mask=mask, attention_mask=mask, sequences=responses)
    tok = SimpleNamespace(batch_decode=lambda r, m: texts, eos_token_ids=[eos])
    examples = [{"ground_truth": "7", "data_source": "arith"}] * len(lengths)
    cfg = load_config(TINY, ["reward_model.overlong_buffer.enable=true", f"reward_model.overlong_buffer.len={buf}",
                             f"reward_model.overlong_buffer.penalty_factor={factor}",
                             "reward_model.missing_eos_penalty=0.5"])
    metrics = {}
    token_scores, scores, rule = scoring.score_batch(tok, out, examples, cfg, metrics=metrics)
    want_penalty = [min(-(L - (R - buf)) / buf * factor, 0.0) for L in lengths]
    want_rule = [float(i % 2) for i in range(len(lengths))]
    assert rule.tolist() == want_rule  # the rule's verdict stays unshaped
    assert scores.tolist() == pytest.approx([r + p for r, p in zip(want_rule, want_penalty)], abs=1e-6)
    for i, L in enumerate(lengths):  # on the last token, minus the missing-EOS penalty for the one cut off
        expect = torch.zeros(R)
        if L:
            expect[L - 1] = want_rule[i] + want_penalty[i] - (0.5 if i == len(lengths) - 1 else 0.0)
        assert torch.allclose(token_scores[i], expect, atol=1e-6), i
    assert metrics["critic/overlong_penalty/mean"] == pytest.approx(sum(want_penalty) / len(lengths))
    assert metrics["critic/overlong_penalty/min"] == -1.0
    assert metrics["critic/overlong_fraction"] == pytest.approx(5 / 8)
    # off (the default): the scores are the rule's and nothing is logged
    metrics = {}
    _, scores, _ = scoring.score_batch(tok, out, examples, load_config(TINY), metrics=metrics)
    assert scores.tolist() == want_rule and metrics == {}


# ---------------------------------------------------------------------------------------------
# greedy_baselines: ReMax's baseline
# ---------------------------------------------------------------------------------------------

def test_remax_baseline_is_each_prompts_greedy_score_generated_alone(sft_dir, tmp_path):
    from nanokl.harness.data import build_prompts
    from nanokl.harness.hf_format import from_pretrained
    from nanokl.harness.tokenizer import load_tokenizer
    from nanokl.rollout import generate
    from nanokl.tasks import get_task
    n = 3
    # a score with spread (the tiny warm start answers every problem wrong, alike): a checksum of the response,
    # plus the prompt's truth, so that a baseline on the wrong rows shows too
    (tmp_path / "checksum.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                          "    return float(sum(map(ord, solution_str)) % 101 + 1000 * int(ground_truth))\n")
    cfg = load_config(TINY, [f"actor_rollout_ref.model.path={sft_dir}", "algorithm.adv_estimator=remax",
                             f"actor_rollout_ref.rollout.n={n}", "data.max_response_length=32",
                             f"custom_reward_function.path={tmp_path / 'checksum.py'}"])
    d, ro = cfg.data, cfg.actor_rollout_ref.rollout
    tok, model = load_tokenizer(str(sft_dir)), from_pretrained(sft_dir, device=torch.device("cpu")).eval()
    train, _ = get_task("arith").examples(d, num_train=6, num_val=0, seed=0)
    run = SimpleNamespace(cfg=cfg, tok=tok, rollout_model=model, device=torch.device("cpu"), rm=None)
    metrics = {}
    got = variants.greedy_baselines(run, [ex for ex in train for _ in range(n)], metrics)
    assert "timing_s/gen_max" in metrics and got.shape == (len(train) * n,)
    want = []
    for ex in train:  # one prompt at a time: no padding, no batch
        ids, mask = build_prompts([ex], tok, d.prompt_template, d.max_prompt_length, d.truncation)
        out = generate(model, ids, mask, ro.response_length, do_sample=False, eos_token_id=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id)
        text = tok.batch_decode(out.responses, out.response_mask)[0]
        want += [float(sum(map(ord, text)) % 101 + 1000 * int(ex["ground_truth"]))] * n
    assert got.tolist() == want and len(set(want)) == len(train)


# ---------------------------------------------------------------------------------------------
# the correct parts: sequence weights and rejection
# ---------------------------------------------------------------------------------------------

def correction_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(7)[None] < torch.tensor([[7], [5], [3], [6]])).long()
    old = -torch.rand(4, 7, generator=g)
    mu = old + 0.4 * torch.randn(4, 7, generator=g)
    mu[3] = old[3]  # one response the sampler's own: never rejected, weight 1
    batch = {"old_log_probs": old, "ref_log_probs": old - 0.1, "response_mask": mask}
    return batch, mu


def correct_run(*extra):
    cfg = load_config(TINY, list(extra))
    return SimpleNamespace(cfg=cfg)


def test_sequence_is_and_rejection_equal_offlines_weights_and_mask():
    batch, mu = correction_case()
    RC = "algorithm.rollout_correction."
    run = correct_run(f"{RC}rollout_is=sequence", f"{RC}rollout_is_threshold=3.0", f"{RC}rollout_rs=token_k1,seq_max_k2",
                      f"{RC}rollout_rs_threshold='0.7_1.5,0.3'")
    part = variants.choose(run)[1]  # (respond, correct, read_kl, baselines)
    w, kept, metrics = part(batch, mu)
    want_w = sequence_is_weights(batch["old_log_probs"], mu, batch["response_mask"], 3.0)
    want_kept = rejection_mask(batch["old_log_probs"], mu, batch["response_mask"], "token_k1,seq_max_k2", "0.7_1.5,0.3")
    assert torch.equal(w, want_w) and torch.equal(kept, want_kept)
    assert 0 < int(kept.sum()) < int(batch["response_mask"].sum())  # some rejected, some kept
    assert torch.equal(kept[3], batch["response_mask"][3])
    real, rejected, seqs, rejected_seqs = rs_sums(want_kept, batch["response_mask"]).tolist()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(rejected / real)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"].item() == pytest.approx(rejected_seqs / seqs)
    assert {"rollout_corr/is_mean", "rollout_corr/is_clipfrac", "rollout_corr/is_ess"} <= set(metrics)
    # rejection alone: no weights; no correction at all: the mask as it was
    w, kept2, metrics = variants.choose(correct_run(f"{RC}rollout_rs=token_k1,seq_max_k2",
                                                    f"{RC}rollout_rs_threshold='0.7_1.5,0.3'"))[1](batch, mu)
    assert w is None and torch.equal(kept2, want_kept) and "rollout_corr/is_mean" not in metrics
    w, same, metrics = offline.no_correction(batch, mu)
    assert w is None and same is batch["response_mask"] and metrics == {}


def test_advantages_read_the_mask_rejection_left(sft_dir, tmp_path, monkeypatch):
    """Step 5 of ppo_step takes the response_mask that step 3's rollout_correction part returned, as verl's
    compute_advantage reads the batch's mask after rollout_rs rewrote it: GAE whitens over the kept
    tokens only. The part is scripted here to reject the second half of the responses."""
    import train_ppo
    from nanokl.harness.config.load import parse_cli
    from nanokl.harness.run import setup
    run = setup(parse_cli(["--config", str(TINY), "data.num_train=16", "data.num_val=0", "data.train_batch_size=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.logger=[jsonl]",
                           "trainer.val_before_train=false", f"actor_rollout_ref.model.path={sft_dir}",
                           f"trainer.default_local_dir={tmp_path}"]))
    kept, seen = {}, []

    def reject_half(batch, rollout_log_probs):
        mask = batch["response_mask"].clone()
        mask[len(mask) // 2:] = 0
        kept["mask"] = mask
        return None, mask, {}
    real = train_ppo.compute_advantage
    run.rollout_correction = reject_half
    monkeypatch.setattr(train_ppo, "compute_advantage",
                        lambda name, rewards, mask, *a, **k: seen.append(mask) or real(name, rewards, mask, *a, **k))
    train_ppo.ppo_step(run, 0)
    assert len(seen) == 1 and seen[0] is kept["mask"] and 0 < int(seen[0].sum())


# ---------------------------------------------------------------------------------------------
# validate with n > 1: verl's best@k / worst@k / maj@k
# ---------------------------------------------------------------------------------------------

def test_validate_at_k_equals_val_metrics_on_the_sampled_responses(sft_dir, monkeypatch):
    from nanokl.harness import reward_fn
    from nanokl.harness.hf_format import from_pretrained
    from nanokl.harness.tokenizer import load_tokenizer
    from nanokl.tasks import get_task
    n = 4
    cfg = load_config(TINY, [f"actor_rollout_ref.model.path={sft_dir}", f"actor_rollout_ref.rollout.val_kwargs.n={n}",
                             "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                             "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "data.val_batch_size=5"])
    tok, model = load_tokenizer(str(sft_dir)), from_pretrained(sft_dir, device=torch.device("cpu")).eval()
    _, val = get_task("arith").examples(cfg.data, num_train=0, num_val=12, seed=0)
    assert reward_fn.answerer(cfg)("x\n#### 07", val[0]) == "7"  # the arithmetic task's extraction, by default
    # the tiny warm start answers every problem wrong: a score and an answer with spread, read from the text
    monkeypatch.setattr(reward_fn, "scorer", lambda cfg: lambda text, ex: float(len(text) % 2))
    monkeypatch.setattr(reward_fn, "answerer", lambda cfg: lambda text, ex: text[-2:])
    samples = []
    got = scoring.evaluate(model, tok, val, cfg, torch.device("cpu"), samples=samples)
    assert len(samples) == len(val) * n
    outputs, hits = [s[1] for s in samples], [s[2] for s in samples]
    uids = [i // n for i in range(len(samples))]
    want = validation_metrics(["arith"] * len(samples), uids, {"acc": hits}, answers=[t[-2:] for t in outputs])
    assert set(got) - {"val-aux/response_length/mean"} == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-6), k
    for k in ("val-core/arith/acc/best@4/mean", "val-core/arith/acc/maj@4/mean", "val-aux/arith/acc/worst@4/mean",
              "val-aux/arith/acc/best@2/mean", "val-aux/arith/acc/std@4"):
        assert k in got, k
    assert 0 < sum(hits) < len(hits)  # scores of both kinds: best, worst and maj differ from the mean
    assert got["val-core/arith/acc/best@4/mean"] > got["val-core/arith/acc/mean@4"] > got["val-aux/arith/acc/worst@4/mean"]


def test_arith_answer_extraction():
    assert arith.extract_arith_answer(" 3+4=7\n#### 7") == "7"
    assert arith.extract_arith_answer("#### 1\n#### 07") == "07" and arith.answer("#### 07", None) == "7"
    assert arith.answer("#### 7.5", None) == "7.5" and arith.answer("Answer: 7", None) is None
    assert arith.arith_score("#### 07", "7") == 1.0 and arith.arith_score("#### 7.5", "7") == 0.0
