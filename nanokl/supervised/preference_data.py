"""Preference data: several responses to one prompt, ranked best first.

The idea
--------
A reward model learns from comparisons, not from scores: people (or, here, a rule standing in
for them) find it far easier and more consistent to say "this answer is better than that one"
than to grade an answer on an absolute scale (Christiano et al. 2017; Ziegler et al. 2019;
Ouyang et al. 2022, InstructGPT, where labelers rank K = 4..9 responses per prompt). One JSONL
row holds one prompt and its ranking, in either of two shapes:

    {"prompt": "Q: 17+4-9=?\\nA:", "responses": ["r0", "r1", "r2"], "ranking": [2, 0, 1]}
    {"prompt": "...", "chosen": "better response", "rejected": "worse response"}

`ranking` lists every response index once, best first (here r2 > r0 > r1). A chosen/rejected
row is the ranking of two (TRL's and OpenRLHF's pairwise format); `read_preferences` turns it
into `responses=[chosen, rejected], ranking=[0, 1]`, so downstream code knows one shape only.
Other fields are kept for the reader and ignored by training. A malformed row is a `UserError`
naming `file:line` and what is wrong with it.

The synthetic preference (`build_preference_data`). For the task data.task names (the
arithmetic one by default) we sample n = 4 responses per prompt from the warm-started policy at
the rollout temperature and rank them by a preference the reward model must discover from the
rankings alone:

    1. correct by the task's rule first (its `score`, strict: for arithmetic, the last "#### N"
       equals the truth);
    2. then graded format: a response ending "#### N" (wrong N) before one the rule cannot read
       ("Answer: N", or no number), since an answer in the graded format can at least be checked;
    3. then shorter (characters).

Why not "then closer to the truth" as the second key (the first design)? Measured on the warm
start's samples: an RM initialised from the warm start learns the rule and length pairs (95%+)
but orders the pairs decided by |answer - truth| at chance (48% held out, 66% overall after 200
steps), because that needs the RM to redo the arithmetic, which a 0.6M-parameter model does not
learn in minutes. A preference the RM cannot learn only adds label noise, so the key above keeps
correctness where it coincides with the graded format and uses what a small RM can see.

A ranking is a strict order, so responses the preference cannot tell apart (the same key, most
often the very same text, which a confident policy samples often) keep only their first copy;
a prompt left with fewer than two distinct responses gives no comparison and is skipped. The
held-out split is by prompt: validation rankings come from the task's validation problems,
which no training prompt equals (the arithmetic task splits its problem space by a hash).

tests/test_reward_model.py checks the ranking rule on hand-written responses and that every
kind of bad row names its file and line.
"""

import json
import re
import sys
from pathlib import Path

import torch

from nanokl.harness.config.schema import DataConfig
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.data import build_prompts
from nanokl.tasks.rows import read_rows
from nanokl.harness.hf_format import from_pretrained
from nanokl.harness.tokenizer import load_tokenizer
from nanokl.rollout import generate
from nanokl.tasks import get_task

# The graded format is the labeller's taste, not a task's: a final "#### N" in the last 300
# characters (the form both built-in rules read; see nanokl/tasks/).
_GRADED = re.compile(r"#### (-?[0-9.,]+)")
_GRADED_TAIL = 300


def _row(obj, where: str) -> dict:
    """One parsed JSONL object -> {"prompt", "responses", "ranking", ...}, or a UserError."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if not isinstance(obj.get("prompt"), str):
        raise UserError(f"{where}: field 'prompt' must be a string")
    pairwise, listwise = "chosen" in obj or "rejected" in obj, "responses" in obj or "ranking" in obj
    if pairwise == listwise:
        raise UserError(f"{where}: give either 'responses' + 'ranking' or 'chosen' + 'rejected'")
    if pairwise:
        for k in ("chosen", "rejected"):
            if not isinstance(obj.get(k), str):
                raise UserError(f"{where}: field '{k}' must be a string")
        return {**obj, "responses": [obj["chosen"], obj["rejected"]], "ranking": [0, 1]}
    responses, ranking = obj.get("responses"), obj.get("ranking")
    if not isinstance(responses, list) or len(responses) < 2 or not all(isinstance(r, str) for r in responses):
        raise UserError(f"{where}: field 'responses' must be a list of at least 2 strings")
    if not isinstance(ranking, list) or not all(type(i) is int for i in ranking):
        raise UserError(f"{where}: field 'ranking' must be a list of response indices, best first")
    if sorted(ranking) != list(range(len(responses))):
        raise UserError(f"{where}: 'ranking' {ranking} must list each of the {len(responses)} response "
                        f"indices 0..{len(responses) - 1} exactly once")
    ended = obj.get("ended", [True] * len(responses))
    if not isinstance(ended, list) or len(ended) != len(responses) or not all(type(e) is bool for e in ended):
        raise UserError(f"{where}: optional field 'ended' must be a list of {len(responses)} booleans")
    return obj


def read_preferences(path) -> list[dict]:
    """All rows of a preference file (.jsonl, .json or .parquet; nanokl.harness.data.read_rows), each as
    {"prompt", "responses", "ranking", ...}."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"cannot read preference file {path}: no such file")
    rows = [_row(obj, where) for where, obj in read_rows(path)]
    if not rows:
        raise UserError(f"{path}: no preference rows")
    return rows


def write_preferences(rows, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def preference_key(text: str, example: dict, score) -> tuple:
    """Sort key of a response, smaller is better: (wrong by the rule `score`, the task's, not in
    the graded "#### N" format, length in characters). See the module docstring."""
    correct = score(text, example, "strict") == 1.0
    graded = _GRADED.search(text[-_GRADED_TAIL:]) is not None
    return (0 if correct else 1, 0 if graded else 1, len(text))


def pair_kinds(row, score) -> list[str]:
    """For a built row (it keeps ground_truth and data_source): which part of the preference
    decides each implied pair, in ranking_pairs order: "rule", "format" or "length"."""
    keys = [preference_key(t, row, score) for t in row["responses"]]
    rk = row["ranking"]
    names = ("rule", "format", "length")
    return [next((names[k] for k in range(3) if keys[rk[i]][k] != keys[rk[j]][k]), "tie")
            for i in range(len(rk)) for j in range(i + 1, len(rk))]


def rank_responses(texts: list[str], example: dict, score) -> tuple[list[str], list[int]]:
    """(kept responses in sampling order, ranking of them best first); one response per distinct key."""
    keys = [preference_key(t, example, score) for t in texts]
    first = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    kept = sorted(first.values())  # sampling order
    order = sorted(range(len(kept)), key=lambda j: keys[kept[j]])
    return [texts[i] for i in kept], order


@torch.no_grad()
def sample_to_rank(policy, tok, examples, n, max_new_tokens, temperature=1.0, template="plain",
                     batch_size=256, seed=0):
    """n sampled response texts per example (rows i*n .. i*n+n-1 belong to example i), and for
    each whether it ended with EOS (False: cut off at max_new_tokens). The RM must see a cut-off
    response as PPO will, without an EOS (reward_model.encode_rankings)."""
    device = next(policy.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    texts, ended = [], []
    eos = torch.tensor(tok.eos_token_ids, device=device)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        ids, mask = build_prompts(chunk, tok, template, device=device)
        out = generate(policy, ids, mask, max_new_tokens, temperature=temperature, eos_token_id=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id, generator=gen, n=n)
        last = (out.response_mask.sum(-1) - 1).clamp(min=0)
        ended += (torch.isin(out.responses.gather(1, last[:, None])[:, 0], eos) & (out.response_mask.sum(-1) > 0)).tolist()
        texts += tok.batch_decode(out.responses, out.response_mask)
    return texts, ended


def build_preference_data(policy_dir, out_path, num_prompts, n=4, seed=0, val_out_path=None, num_val_prompts=0,
                          data=None, template="plain", max_new_tokens=32, temperature=1.0,
                          batch_size=256, device=None) -> dict:
    """Sample n responses per prompt of the task (`data`: the config's data section, which names
    the task and holds its knobs; None: the arithmetic task's defaults) from the policy, rank them by the synthetic
    preference, write the ranking JSONL (train to `out_path`, held-out prompts to `val_out_path`).
    Returns counts: rows written and prompts skipped (fewer than two distinct responses) per split."""
    data = DataConfig(task="arith") if data is None else data
    task = get_task(data.task)
    policy = from_pretrained(policy_dir, device=device).eval()
    tok = load_tokenizer(policy_dir)
    train, val = task.examples(data, num_prompts, num_val_prompts if val_out_path else 0, seed=seed)
    stats = {}
    for name, examples, path in (("train", train, out_path), ("val", val, val_out_path)):
        if path is None or not examples:  # no held-out split asked for (num_val_prompts = 0)
            continue
        texts, ended = sample_to_rank(policy, tok, examples, n, max_new_tokens, temperature, template, batch_size,
                                        seed=seed + (name == "val"))
        rows = []
        for i, ex in enumerate(examples):
            responses, ranking = rank_responses(texts[i * n:(i + 1) * n], ex, task.score)
            first_ended = {}  # rank_responses keeps the first of equal texts: take its EOS flag
            for t, e in zip(texts[i * n:(i + 1) * n], ended[i * n:(i + 1) * n]):
                first_ended.setdefault(t, e)
            if len(responses) >= 2:
                rows.append({"prompt": ex["prompt"], "responses": responses, "ranking": ranking,
                             "ended": [first_ended[t] for t in responses], "ground_truth": ex["ground_truth"],
                             "data_source": ex["data_source"]})
        if not rows:
            raise UserError(f"no {name} prompt got two distinguishable responses from {policy_dir} "
                            f"(n={n}); sample more per prompt or raise the temperature")
        write_preferences(rows, path)
        stats[f"{name}_rows"], stats[f"{name}_skipped"] = len(rows), len(examples) - len(rows)
        print(f"preference data: {len(rows)} {name} rankings -> {path} ({len(examples) - len(rows)} prompts "
              "with < 2 distinct responses skipped)", file=sys.stderr)
    return stats
