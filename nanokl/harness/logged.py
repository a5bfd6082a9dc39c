"""Logged responses: read them, check them, and draw a PPO batch from them (the offline step 1).

An offline run (data.offline_files) trains on responses that were sampled before training, by
some behaviour policy mu: the warm start's ranked samples of the reward-model pipeline, a
`generate.py --out` file, a verl or vLLM rollout dump. Nothing samples in the loop; step 1 of
`ppo_step` draws a batch from these rows instead (nanokl/offline.py teaches what changes after).

One row per prompt, JSONL, a JSON array or Parquet (nanokl.harness.data.read_rows), in the format
the reward model reads (nanokl/supervised/preference_data.py), with two optional extras:

    {"prompt": "Q: 17+4-9=?\\nA:",                  a string, or [system?, user] chat messages
     "responses": ["r0", "r1", "r2"],               one or more
     "ranking": [2, 0, 1],                          optional: best first (DPO needs it)
     "ended": [true, true, false],                  optional: did the response end with EOS
     "logprobs": [[-0.1, ...], [...], [...]],       optional: mu's log-prob of every response token
     "ground_truth": "12", "data_source": "arith"}  optional: for the task's rule
    {"prompt": "...", "chosen": "better", "rejected": "worse"}     = responses [chosen, rejected], ranking [0, 1]

(`reward_model.ground_truth`, verl's spelling, is read too.) A response's tokens are its text
tokenized alone, plus the EOS when it ended (as the rollout produces them and the reward model
reads them), so `logprobs[k]` must have exactly that many values, each finite: the log-prob of
each of those tokens under mu at the rollout temperature. A response longer than
data.max_response_length tokens is cut there, as the rollout cuts one (a sampled text need not
re-tokenize to the tokens it was sampled as, so a 32-token sample can come back longer). Every row is checked when the run
starts, before anything trains; a bad row is one line naming `file:line` (exit status 2).

Drawing a batch (`draw_responses`, `logged_batch`). Step s takes its prompts as an online step
does (data.batch_indices, a pure function of the step), and from each row `rollout.n` of its
responses: without replacement when the row has that many (with repeats for the rest when it
has fewer), seeded by (seed, step, row) alone, so every rank and every world size draws the same
responses, and listed in ranking order, so that for DPO (n = 2) the chosen response comes first.
The batch has the layout of a rollout (nanokl/rollout.py's RolloutOutput): left-padded prompts,
right-padded responses, masks and positions, and `log_probs` = mu's log-probs where logged, NaN
where the row has none (the step then takes the reference's: nanokl/offline.py).

tests/test_logged.py checks every bad-row case (file:line, exit status 2, nothing trained), that a
batch equals a hand-built one, and that the draw is the same for every rank split.
"""

import math
import random

import torch

from nanokl.harness.data import build_prompts, step_seed

from nanokl.tasks.rows import DataError, _chat_prompt, read_examples
from nanokl.harness.tokenizer import apply_template
from nanokl.rollout import RolloutOutput


def _strings(value, what, where):
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(f"{where}: {what} must be a list of strings")
    return value


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond every float: JSON writes ints of any length
        return False


def parse_row(obj, where: str) -> dict:
    """One logged row -> {"prompt", "responses", "ranking" or None, "ended", "logprobs" or None, ...}."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
    prompt, system = obj.get("prompt"), None
    if prompt is None:
        raise DataError(f"{where}: missing field 'prompt'")
    if isinstance(prompt, list):
        prompt, system = _chat_prompt(prompt, where)
    if not isinstance(prompt, str):
        raise DataError(f"{where}: field 'prompt' must be a string or a list of chat messages")
    pairwise = "chosen" in obj or "rejected" in obj
    if pairwise and "responses" in obj:
        raise DataError(f"{where}: give either 'responses' (+ 'ranking') or 'chosen' + 'rejected', not both")
    if pairwise:
        if not (isinstance(obj.get("chosen"), str) and isinstance(obj.get("rejected"), str)):
            raise DataError(f"{where}: fields 'chosen' and 'rejected' must both be strings")
        responses, ranking = [obj["chosen"], obj["rejected"]], [0, 1]
    else:
        if "responses" not in obj:
            raise DataError(f"{where}: no response: give 'responses' (a list of strings) or 'chosen' + 'rejected'")
        responses, ranking = _strings(obj["responses"], "field 'responses'", where), obj.get("ranking")
        if not responses:
            raise DataError(f"{where}: no response: 'responses' is empty")
        # ints checked before sorting: sorted([0, "1"]) raises
        if ranking is not None and (not isinstance(ranking, list) or not all(type(i) is int for i in ranking)
                                    or sorted(ranking) != list(range(len(responses)))):
            raise DataError(f"{where}: 'ranking' {ranking} is not a permutation of the {len(responses)} response "
                            f"indices 0..{len(responses) - 1} (best first, each once)")
    K = len(responses)
    ended = obj.get("ended", [True] * K)
    if not isinstance(ended, list) or len(ended) != K or not all(type(e) is bool for e in ended):
        raise DataError(f"{where}: optional field 'ended' must be a list of {K} booleans")
    logprobs = obj.get("logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, list) or len(logprobs) != K:
            raise DataError(f"{where}: 'logprobs' must hold one list of per-token log-probs per response ({K})")
        for k, lp in enumerate(logprobs):
            if not isinstance(lp, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in lp):
                raise DataError(f"{where}: logprobs[{k}] must be a list of numbers")
            bad = next((j for j, v in enumerate(lp) if not _finite(v)), None)
            if bad is not None:
                raise DataError(f"{where}: logprobs[{k}][{bad}] is {lp[bad]}, not a finite log-prob")
    reward = obj.get("reward_model") if isinstance(obj.get("reward_model"), dict) else {}
    truth = obj.get("ground_truth", reward.get("ground_truth"))
    row = {"prompt": prompt, "responses": responses, "ranking": ranking, "ended": ended, "logprobs": logprobs,
           "where": where}
    if system is not None:
        row["system_prompt"] = system
    if truth is not None:
        row["ground_truth"] = str(truth)
    if isinstance(obj.get("data_source"), str):
        row["data_source"] = obj["data_source"]
    return row


def read_logged(paths, tok, *, template="plain", max_prompt_length=None, max_response_length=None,
                need_ranking=False, need_truth=False) -> list[dict]:
    """Every row of the logged file(s), checked and tokenized: each row gains `response_ids` (the
    tokens of each response, EOS included when it ended). `need_ranking` (DPO: two or more ranked
    responses) and `need_truth` (scoring by the task's rule: ground truth and data_source) make
    those fields required. Any bad row is a DataError naming file:line."""
    def checked(obj, where):
        row = parse_row(obj, where)
        row["response_ids"] = [tok.encode_one(r) + [tok.eos_token_id] * e
                               for r, e in zip(row["responses"], row["ended"])]
        for k, ids in enumerate(row["response_ids"]):
            if row["logprobs"] is not None and len(row["logprobs"][k]) != len(ids):
                raise DataError(f"{where}: logprobs[{k}] has {len(row['logprobs'][k])} values but response "
                                f"{k} has {len(ids)} tokens (its text tokenized{', plus the EOS' * row['ended'][k]})")
            if max_response_length is not None and len(ids) > max_response_length:
                # cut as the rollout cuts a response at max_response_length: no EOS, scored as cut off
                row["response_ids"][k] = ids[:max_response_length]
                if row["logprobs"] is not None:
                    row["logprobs"][k] = row["logprobs"][k][:max_response_length]
        if max_prompt_length is not None:
            n = len(tok.encode_one(apply_template(row["prompt"], template, row.get("system_prompt"))))
            if n > max_prompt_length:
                raise DataError(f"{where}: the prompt has {n} tokens, over data.max_prompt_length={max_prompt_length}")
        if need_ranking and (row["ranking"] is None or len(row["responses"]) < 2):
            raise DataError(f"{where}: DPO needs at least two responses ranked best first "
                            "('responses' + 'ranking', or 'chosen' + 'rejected')")
        if need_truth and not ("ground_truth" in row and "data_source" in row):
            raise DataError(f"{where}: scoring by the task's rule needs 'ground_truth' and 'data_source' "
                            "(or enable a reward model: reward_model.enable=true)")
        return row
    return read_examples(paths, checked)


def draw_responses(row, n, seed, step, index) -> list[int]:
    """Which `n` of the row's responses step `step` trains on, in ranking order (best first)."""
    K = len(row["responses"])
    rng = random.Random(step_seed(seed, step, index))  # the same on every rank
    picks = rng.sample(range(K), min(n, K)) + rng.choices(range(K), k=max(0, n - K))
    if row["ranking"] is not None:
        place = {r: i for i, r in enumerate(row["ranking"])}
        picks.sort(key=place.__getitem__)
    return picks


def logged_batch(rows, picks, tok, template="plain", max_prompt_length=None, truncation="error",
                 device=None) -> RolloutOutput:
    """The responses `picks[i]` of rows[i], in a rollout's layout; `log_probs` are μ's where the row
    logged them and NaN where it did not."""
    n = len(picks[0])
    ids, mask = build_prompts(rows, tok, template, max_prompt_length, truncation, device=device)
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    resp = [row["response_ids"][k] for row, ks in zip(rows, picks) for k in ks]
    logp = [row["logprobs"][k] if row["logprobs"] is not None else None for row, ks in zip(rows, picks) for k in ks]
    N, R = len(resp), max(1, max(len(r) for r in resp))
    responses = torch.full((N, R), tok.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(N, R, dtype=torch.long)
    log_probs = torch.zeros(N, R)
    for i, (r, lp) in enumerate(zip(resp, logp)):
        responses[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, :len(r)] = 1
        if lp is None:
            log_probs[i] = float("nan")  # not logged: unknown (nanokl/offline.py's behaviour_log_probs)
        else:
            log_probs[i, :len(r)] = torch.tensor(lp, dtype=torch.float32)
    responses, response_mask, log_probs = (t.to(device) for t in (responses, response_mask, log_probs))
    prompt_pos = (mask.cumsum(-1) - 1).clamp(min=0)
    resp_pos = mask.sum(-1, keepdim=True) + torch.arange(R, device=mask.device)
    out = RolloutOutput(sequences=torch.cat([ids, responses], 1), attention_mask=torch.cat([mask, response_mask], 1),
                        position_ids=torch.cat([prompt_pos, resp_pos], 1), responses=responses,
                        response_mask=response_mask, log_probs=log_probs, prompt_length=ids.shape[1])
    return out
