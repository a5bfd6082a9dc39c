"""The reward model: a scalar score for (prompt, response), learned from rankings.

The idea
--------
When no rule can check an answer, RLHF learns the reward from human preferences: a model
r(x, y) -> R that scores a prompt x and response y, trained so that preferred responses score
higher (Christiano et al. 2017; Ziegler et al. 2019; Ouyang et al. 2022). PPO then maximises
r(x, y) - beta * KL(pi || pi_ref), and the KL term keeps the policy where r was trained to judge.

The model (`RewardModel`, nanokl/engine/model.py) is the policy's backbone (nanokl/engine/model.py `Decoder`) with the LM
head replaced by a bias-free linear head `score` [1, hidden] read at the *last real token* of
prompt+response (the EOS that ends the response): the one position that has seen the whole text,
initialised from the warm start (its LM head dropped, a fresh `score` row). The layout is
`transformers`' `Qwen2ForSequenceClassification` with `num_labels=1`, so a saved RM loads there.

Two losses over a ranking pi = (pi_1 > pi_2 > ... > pi_K) of K responses to one prompt:

  Bradley-Terry (Bradley & Terry 1952): P(y_w > y_l) = sigma(r_w - r_l). A ranking of K implies
  the K-choose-2 pairs (pi_i, pi_j), i < j (`ranking_pairs`), and the loss is their mean of

      -log sigma(r_w - r_l).

  InstructGPT puts all K-choose-2 comparisons of a prompt in one batch: each response is
  forwarded once and reused in K-1 pairs, which is both cheaper and less prone to overfitting
  than shuffling the pairs apart. `collate` does the same: a batch is a set of prompts, each with
  all its responses.

  Plackett-Luce (Plackett 1975; Luce 1959): the ranking is drawn by picking the best of the
  remaining responses with softmax probabilities, then the best of the rest, and so on:

      P(pi) = prod_i exp(r_{pi_i}) / sum_{j >= i} exp(r_{pi_j})
      loss  = -sum_i [ r_{pi_i} - logsumexp_{j >= i} r_{pi_j} ]      (mean over rankings)

  For K = 2 both losses are -log sigma(r_w - r_l). For K > 2 PL uses the order once, as a list,
  where BT counts each implied pair separately (`loss: bt | pl` chooses).

Normalisation (Ziegler et al. 2019; lm-human-preferences' `reward_gain`/`reward_bias`): a reward
model is only defined up to a constant (the losses see differences), and its scale drifts with
training. After training, we score samples of the *reference* policy (the warm start, at the
rollout temperature, on PPO's own training prompts) and store their mean and (population) std in
`reward_normalization.json` beside the weights; `load_reward_model` (harness/hf_format.py) reads it and
`score_with_rm` (harness/scoring.py)
returns (r - mean) / std, so rewards have mean 0 and std 1 on reference samples and beta means the
same thing whatever the RM. The weights stay the raw HF model: transformers' logits are the raw r.

    python -m nanokl.supervised.reward_model                 # configs/arith_tiny.yaml: data, train, normalise, save
    python -m nanokl.supervised.reward_model reward_model.train.loss=pl

builds the ranking data when `reward_model.train.data_path` is missing (nanokl/supervised/preference_data.py:
4 samples per prompt from the warm start, ranked correct-by-rule, then graded format, then shorter),
trains the RM from the warm start, prints the held-out pairwise accuracy (the share of implied
pairs of held-out prompts it orders correctly) and saves to `reward_model.model.path`.

tests/test_reward_model.py: pairs equal a hand enumeration; both losses equal float64 loops; the
rewards equal transformers' SequenceClassification logits (<= 1e-4); save/load round-trips; a tiny
RM learns a synthetic ranking to >= 90% held-out pairwise accuracy; normalised rewards have mean 0
and std 1 on the samples they were fitted on; bad rows name file:line.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nanokl.harness.config.yaml_io import ConfigError, UserError, run_cli
from nanokl.harness.config.load import parse_cli
from nanokl.harness.data import build_prompts
from nanokl.harness.hf_format import from_pretrained, load_reward_model, save_reward_model
from nanokl.harness.scoring import keep_last_tokens, raw_rewards
from nanokl.supervised.preference_data import build_preference_data, pair_kinds, read_preferences
from nanokl.rollout import generate
from nanokl.supervised.sft import adamw_cosine
from nanokl.harness.tokenizer import apply_template, load_tokenizer, right_pad
from nanokl.harness.world import pick_device
from nanokl.tasks import get_task

# ---------------------------------------------------------------------------------------------
# Rankings and their losses


def ranking_pairs(ranking) -> list[tuple[int, int]]:
    """Every (winner, loser) pair a ranking (best first) implies: A>B>C -> (A,B), (A,C), (B,C)."""
    return [(ranking[i], ranking[j]) for i in range(len(ranking)) for j in range(i + 1, len(ranking))]


def bt_loss(rewards, rankings):
    """Bradley-Terry: mean over every implied pair of -log sigma(r_w - r_l). `rankings` index `rewards`."""
    pairs = torch.tensor([p for rk in rankings for p in ranking_pairs(rk)], device=rewards.device)
    return -F.logsigmoid(rewards[pairs[:, 0]] - rewards[pairs[:, 1]]).mean()


def pl_loss(rewards, rankings):
    """Plackett-Luce: mean over rankings of -sum_i [r_pi_i - logsumexp_{j>=i} r_pi_j]."""
    total = rewards.new_zeros(())
    for K in sorted({len(rk) for rk in rankings}):  # rankings of one length stack into [G, K]
        s = rewards[torch.tensor([rk for rk in rankings if len(rk) == K], device=rewards.device)]
        tail = torch.logcumsumexp(s.flip(-1), -1).flip(-1)  # tail[:, i] = logsumexp(s[:, i:])
        total = total + (tail - s).sum()
    return total / len(rankings)


LOSSES = {"bt": bt_loss, "pl": pl_loss}


# ---------------------------------------------------------------------------------------------
# Batches: token ids of prompt + response + EOS, the way PPO's rollout will present them


def encode_rankings(rows, tok, template="plain") -> list[tuple[list[list[int]], list[int]]]:
    """Each row -> ([prompt + response (+ EOS) token ids for each response], ranking). The prompt
    and the response are tokenized apart, as the rollout produces them, and a finished response
    ends with the EOS at which PPO reads its reward; one cut off before its EOS (the row's optional
    `ended` flag is False) is read at its last token, as PPO reads a cut-off rollout."""
    items = []
    for row in rows:
        prompt = tok.encode_one(apply_template(row["prompt"], template))
        ended = row.get("ended", [True] * len(row["responses"]))
        items.append(([prompt + tok.encode_one(r) + [tok.eos_token_id] * e for r, e in zip(row["responses"], ended)],
                      row["ranking"]))
    return items


def collate(items, pad_token_id, device=None):
    """A batch of prompts, all responses of each: right-padded (ids, mask) [M, T] and rankings
    re-indexed into the M rows."""
    seqs, rankings = [], []
    for responses, ranking in items:
        rankings.append([len(seqs) + i for i in ranking])
        seqs += responses
    ids, mask = right_pad(seqs, pad_token_id)
    return ids.to(device), mask.to(device), rankings


def train_reward_model(rm, items, steps, batch_size, lr, loss="bt", seed=0, pad_token_id=0, progress=True):
    """AdamW on the ranking loss, `batch_size` prompts a step, each ranking once per epoch.
    Linear warm-up, then cosine to 10% of lr. Returns the loss of every step."""
    if not items:  # else the epoch refill below never fills a batch
        raise ValueError("train_reward_model: no rankings to train on")
    device = next(rm.parameters()).device
    loss_fn = LOSSES[loss]
    opt, sched = adamw_cosine(rm, lr, steps)
    gen = torch.Generator().manual_seed(seed)
    order, history = [], []
    rm.train()
    bar = tqdm(range(steps), desc=f"reward model ({loss})", disable=not progress, file=sys.stderr)
    for _ in bar:
        if len(order) < batch_size:  # next epoch: a fresh permutation appended to what is left
            order += torch.randperm(len(items), generator=gen).tolist()
        batch, order = [items[i] for i in order[:batch_size]], order[batch_size:]
        ids, mask, rankings = collate(batch, pad_token_id, device)
        value = loss_fn(rm(ids, mask).float(), rankings)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(value.item())
        bar.set_postfix(loss=f"{value.item():.3f}")
    rm.eval()
    return history


@torch.no_grad()
def pair_outcomes(rm, items, pad_token_id=0, batch_size=64) -> list[bool]:
    """r_winner > r_loser for every implied pair, item by item in ranking_pairs order."""
    device = next(rm.parameters()).device
    out = []
    for i in range(0, len(items), batch_size):
        ids, mask, rankings = collate(items[i:i + batch_size], pad_token_id, device)
        r = rm(ids, mask).float().tolist()
        out += [r[w] > r[l] for rk in rankings for w, l in ranking_pairs(rk)]
    return out


def pairwise_accuracy(rm, items, pad_token_id=0, batch_size=64) -> float:
    """Share of the implied (winner, loser) pairs the RM orders right (a tie counts as wrong)."""
    outcomes = pair_outcomes(rm, items, pad_token_id, batch_size)
    return sum(outcomes) / max(len(outcomes), 1)


# ---------------------------------------------------------------------------------------------
# Scoring for PPO, normalisation, load and save


def fit_normalization(rm, sequences, attention_mask, micro_batch_size=None) -> tuple[float, float]:
    """Set rm.reward_mean / reward_std to the mean and population std of its raw rewards on these
    (reference-policy) samples, so score_with_rm gives them mean 0 and std 1."""
    r = raw_rewards(rm, sequences, attention_mask, micro_batch_size).double()
    rm.reward_mean, rm.reward_std = r.mean().item(), max(r.std(unbiased=False).item(), 1e-8)
    return rm.reward_mean, rm.reward_std


@torch.no_grad()
def reference_samples(policy, tok, examples, max_new_tokens, temperature=1.0, template="plain", seed=0):
    """One sampled response per example: the rollout's (sequences, attention_mask)."""
    device = next(policy.parameters()).device
    ids, mask = build_prompts(examples, tok, template, device=device)
    out = generate(policy, ids, mask, max_new_tokens, temperature=temperature, eos_token_id=tok.eos_token_ids,
                   pad_token_id=tok.pad_token_id, generator=torch.Generator(device=device).manual_seed(seed))
    return out.sequences, out.attention_mask


# ---------------------------------------------------------------------------------------------
# The command line: data, training, held-out accuracy, normalisation, save


def build_ranked_data(cfg) -> dict:
    """The ranked warm-start samples reward_model.train describes (train and held-out files); they are
    also the logged responses of the offline configs."""
    t, d = cfg.reward_model.train, cfg.data
    return build_preference_data(cfg.actor_rollout_ref.model.path, t.data_path, t.num_prompts, t.n, t.seed,
                                 t.val_data_path, t.num_val_prompts, d, d.prompt_template, d.max_response_length,
                                 cfg.actor_rollout_ref.rollout.temperature, device=pick_device(cfg.trainer.device))


def train_from_config(cfg, progress=True) -> dict:
    """What `python -m nanokl.supervised.reward_model` does; returns the metrics it also writes to rm_metrics.json."""
    rc, t, d = cfg.reward_model, cfg.reward_model.train, cfg.data  # sizes and rates: checked by rules
    task = get_task(d.task)
    if not rc.model.path or not t.data_path:
        raise ConfigError("set reward_model.model.path (where the RM is saved) and reward_model.train.data_path")
    policy_dir = cfg.actor_rollout_ref.model.path
    if not (Path(policy_dir) / "config.json").is_file():
        raise UserError(f"{policy_dir}: no warm start to start the reward model from; run python -m nanokl.supervised.sft")
    device = pick_device(cfg.trainer.device)
    temperature = cfg.actor_rollout_ref.rollout.temperature
    t0 = time.perf_counter()
    if not Path(t.data_path).is_file():
        build_ranked_data(cfg)
    t_data = time.perf_counter() - t0
    tok = load_tokenizer(cfg.actor_rollout_ref.model.tokenizer_path)
    train_items = encode_rankings(read_preferences(t.data_path), tok, d.prompt_template)
    val_rows = read_preferences(t.val_data_path) if t.val_data_path and Path(t.val_data_path).is_file() else []
    val_items = encode_rankings(val_rows, tok, d.prompt_template)

    rm = load_reward_model(policy_dir, device, seed=t.seed)
    history = train_reward_model(rm, train_items, t.steps, t.batch_size, t.lr, t.loss, t.seed, tok.pad_token_id,
                                 progress)
    # Normalise on the reference policy's samples of PPO's own training prompts, scored as PPO
    # will score them (each row's last reward_model.max_length tokens); then save, before anything
    # else can fail.
    examples = task.examples(d, num_train=t.norm_samples, num_val=0, seed=d.seed)[0]
    policy = from_pretrained(policy_dir, device=device).eval()
    seqs, mask = reference_samples(policy, tok, examples, d.max_response_length, temperature, d.prompt_template,
                                   t.seed)
    mean, std = fit_normalization(rm, seqs, keep_last_tokens(mask, rc.max_length), rc.micro_batch_size_per_gpu)
    save_reward_model(rm, rc.model.path, tok, {"num_samples": len(examples), "temperature": temperature,
                                                "policy": str(policy_dir)})

    # Held-out pairwise accuracy, and on the pairs each part of the preference decides, where the
    # task's rule can judge the rows (build_preference_data's keep their ground_truth and data_source).
    outcomes = pair_outcomes(rm, val_items, tok.pad_token_id)
    metrics = {"val_pairwise_acc": sum(outcomes) / len(outcomes) if outcomes else None,
               "train_pairwise_acc": pairwise_accuracy(rm, train_items[:len(val_items) or 256], tok.pad_token_id)}
    by_kind = {}
    if val_items and all("data_source" in r and "ground_truth" in r for r in val_rows):
        for kind, ok in zip((k for r in val_rows for k in pair_kinds(r, task.score)), outcomes):
            by_kind.setdefault(kind, []).append(ok)
    metrics.update({f"val_pairwise_acc/{k}": sum(v) / len(v) for k, v in by_kind.items()})
    metrics.update({f"val_pairs/{k}": len(v) for k, v in by_kind.items()})
    metrics.update(final_loss=history[-1], loss=t.loss, steps=t.steps, train_rankings=len(train_items),
                   val_rankings=len(val_items), data_s=round(t_data, 1), total_s=round(time.perf_counter() - t0, 1))
    (Path(rc.model.path) / "rm_metrics.json").write_text(json.dumps(metrics, indent=2))
    acc = metrics["val_pairwise_acc"]
    shown = ("n/a" if acc is None else f"{acc:.3f}") + f" ({len(val_items)} rankings)"
    shown += "".join(f", {k} {sum(v) / len(v):.3f} ({len(v)} pairs)" for k, v in by_kind.items())
    print(f"reward model: held-out pairwise accuracy {shown}; train {metrics['train_pairwise_acc']:.3f}; "
          f"reference rewards mean {mean:.3f} std {std:.3f} stored for normalisation; saved to {rc.model.path} "
          f"in {metrics['total_s']:.0f} s (data {t_data:.0f} s)", file=sys.stderr)
    return metrics


def main(argv=None):
    train_from_config(parse_cli(argv))


if __name__ == "__main__":
    run_cli(main)
