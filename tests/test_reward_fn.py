"""verl's reward hook (nanokl/harness/reward_fn.py) and the data_source table (nanokl/tasks/): a
custom compute_score file against a hand-written loop over the same responses, each score on its
response's last token (verl's naive manager) and in the step's rollout_data_dir file; the hook's
one-line errors (exit 2); rows scored by their own data_source's rule; an unknown data_source
refused in one line."""

import json
import runpy
from pathlib import Path

import pytest
import torch

from nanokl.harness.config.yaml_io import UserError, run_cli
from nanokl.harness.config.load import load_config
from nanokl.harness.reward_fn import MANAGERS, check_sources, load_custom, manager, naive, scorer
from nanokl.harness.scoring import score_batch
from nanokl.harness.tokenizer import train_tokenizer
from nanokl.rollout import RolloutOutput
from nanokl.tasks import SOURCE_TASKS, arith, get_task, gsm8k
from nanokl.tasks.arith import arith_score
from nanokl.tasks.gsm8k import gsm8k_score
from verl_data import verl_row

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "arith_tiny.yaml"

# a rule no nanokl task has: the response's length mod 5, plus the bonus its row's extra_info grants;
# rows of data_source "dict" get verl's other return shape, {"score": ..., more keys}
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    value = len(solution_str) % 5 + (extra_info or {}).get("bonus", 0) + (ground_truth == "7")
    return {"score": value, "acc": True} if data_source == "dict" else value
'''


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["Q: 12+30=?\nA: 42\n#### 42", "Answer: 7", "#### -3 and more text"], vocab_size=300)


def rollout(tok, prompts, responses, eos=(True, False, True, True)):
    """A rollout batch by hand: left-padded prompts, then responses right-padded after their EOS."""
    ids, mask = tok.encode(prompts)
    rows = [tok.encode_one(r) + ([tok.eos_token_id] if e else []) for r, e in zip(responses, eos)]
    R = max(len(r) for r in rows)
    resp = torch.full((len(rows), R), tok.pad_token_id)
    rmask = torch.zeros(len(rows), R, dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, :len(r)], rmask[i, :len(r)] = torch.tensor(r), 1
    seq, att = torch.cat([ids, resp], 1), torch.cat([mask, rmask], 1)
    return RolloutOutput(sequences=seq, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0),
                         responses=resp, response_mask=rmask, log_probs=torch.zeros(resp.shape),
                         prompt_length=ids.shape[1])


PROMPTS = ["Q: 12+30=?\nA:", "Q: 1+1=?\nA:", "Q: 5-8=?\nA:", "Q: 3+4=?\nA:"]
RESPONSES = [" 12+30=42\n#### 42", "Answer: 7", "#### -3", " 3+4=7\n#### 7"]
EXAMPLES = [{"prompt": p, "ground_truth": t, "data_source": s, **({"extra_info": x} if x else {})}
            for p, t, s, x in zip(PROMPTS, ["42", "2", "-3", "7"], ["arith", "dict", "x", "arith"],
                                  [{"bonus": 10}, None, {"bonus": 0.5}, None])]


def test_a_custom_function_scores_every_response_as_a_hand_loop_does(tmp_path, tok):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    cfg = load_config(TINY, [f"custom_reward_function.path={path}", f"trainer.rollout_data_dir={tmp_path / 'dump'}",
                             "reward_model.missing_eos_penalty=0.25"])
    out = rollout(tok, PROMPTS, RESPONSES)
    token_scores, scores, rule = score_batch(tok, out, EXAMPLES, cfg, global_step=7)
    # the reference: the file's function, run on its own, called the way verl's naive manager calls it
    fn = runpy.run_path(str(path))["compute_score"]
    want, accs = [], []
    for i, ex in enumerate(EXAMPLES):
        text = tok.decode([t for t, m in zip(out.responses[i].tolist(), out.response_mask[i].tolist()) if m])
        got = fn(data_source=ex["data_source"], solution_str=text, ground_truth=ex["ground_truth"],
                 extra_info=ex.get("extra_info", {}))
        want.append(float(got["score"] if isinstance(got, dict) else got))
        accs.append(float(got["acc"] if isinstance(got, dict) else got))  # a dict's "acc", else the score
    assert scores.tolist() == want and rule.tolist() == accs and accs[1] == 1.0 != want[1]
    assert len(set(want)) > 2  # the rows differ: the test sees every input reach the function
    last = out.response_mask.sum(-1) - 1
    for i, w in enumerate(want):  # on the last token, minus the penalty where the EOS never came
        expected = torch.zeros(out.responses.shape[1])
        expected[last[i]] = w - (0.25 if i == 1 else 0.0)
        assert torch.equal(token_scores[i], expected)
    # the step's rollout_data_dir file: one line per response, verl's fields
    lines = [json.loads(line) for line in (tmp_path / "dump" / "7.jsonl").read_text().splitlines()]
    assert lines == [{"input": p, "output": r, "gts": ex["ground_truth"], "score": w - (0.25 if i == 1 else 0.0),
                      "step": 7} for i, (p, r, ex, w) in enumerate(zip(PROMPTS, RESPONSES, EXAMPLES, want))]


def test_without_a_custom_function_the_task_rule_scores_and_naive_loops():
    cfg = load_config(TINY)
    assert cfg.reward_model.reward_manager == "naive" and manager(cfg) is naive and MANAGERS["naive"] is naive
    score = scorer(cfg)
    for text, ex in [("#### 42", EXAMPLES[0]), ("#### 41", EXAMPLES[0]), ("42", EXAMPLES[0])]:
        assert score(text, ex) == arith_score(text, ex["ground_truth"])
    rows = [EXAMPLES[0], {"prompt": "logged, no truth", "data_source": "arith"}]
    got = naive(score, ["#### 42", "#### 1"], rows)
    assert got[0] == 1.0 and got[1] != got[1]  # nan: no rule judges a row without a ground truth


def test_the_hook_errors_are_one_line_naming_the_key(tmp_path, sft_dir, capsys):
    with pytest.raises(UserError, match=r"^custom_reward_function.path: no such file '.*nope.py'$"):
        load_custom(str(tmp_path / "nope.py"), "compute_score")
    good = tmp_path / "r.py"
    good.write_text(REWARD_FILE)
    with pytest.raises(UserError, match=r"^custom_reward_function.name: .*r.py' has no function 'score_it' "
                                        r"\(it defines: compute_score\)$"):
        load_custom(str(good), "score_it")
    broken = tmp_path / "broken.py"
    broken.write_text("import os\nraise ValueError('no API key\\nset one')\n")
    with pytest.raises(UserError, match=r"^custom_reward_function.path: importing .*broken.py' failed "
                                        r"\(ValueError: no API key set one\)$"):
        load_custom(str(broken), "compute_score")
    # through the trainer: the setup refuses before any model loads, one line, exit status 2
    import train_ppo
    with pytest.raises(SystemExit) as ended:
        run_cli(train_ppo.main, ["--config", str(TINY), f"actor_rollout_ref.model.path={sft_dir}",
                                 f"trainer.default_local_dir={tmp_path / 'run'}", f"custom_reward_function.path={good}",
                                 "custom_reward_function.name=score_it"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert ended.value.code == 2 and len(err) == 1 and "custom_reward_function.name" in err[0], err


def verl_rows(tmp_path):
    """A mixed file: two GSM8K rows as verl's preprocessing writes them, two arith rows, a raw GSM8K row."""
    rows = [verl_row("Tom has 3 apples and buys 4. How many?", "3+4=7\n#### 7", "train", 0),
            verl_row("A shop sells 1,200 pens a day. How many in 2 days?", "2*1200=2400\n#### 2,400", "train", 1),
            {"data_source": "arith", "prompt": [{"role": "user", "content": "Q: 3+4=?\nA:"}],
             "reward_model": {"style": "rule", "ground_truth": "7"}},
            {"data_source": "arith", "prompt": "Q: 9-2=?\nA:", "reward_model": {"ground_truth": 7}},
            {"question": "Ann has 5 pens and loses 3. How many?", "answer": "5-3=2\n#### 2"}]  # GSM8K's own JSONL
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_with_data_files_and_no_task_each_row_is_scored_by_its_data_source(tmp_path):
    path = verl_rows(tmp_path)
    cfg = load_config(TINY, ["data.task=null", f"data.train_files={path}"])
    assert cfg.data.task is None and load_config(TINY, ["data.task=null"]).data.task == "arith"
    assert {s: t for s, t in SOURCE_TASKS.items() if t in (arith, gsm8k)} == {"arith": arith, "openai/gsm8k": gsm8k}
    train, val = get_task(cfg.data.task).examples(cfg.data)
    assert [ex["data_source"] for ex in train] == ["openai/gsm8k"] * 2 + ["arith"] * 2 + ["openai/gsm8k"]
    assert val == [] and train[4]["ground_truth"] == "2"
    assert train[1]["ground_truth"] == "2400" and train[1]["extra_info"]["index"] == 1
    check_sources(cfg, train)  # every source has a rule: nothing to refuse
    score = scorer(cfg)
    # responses each rule reads differently: GSM8K's takes "#### 7.0" as the string "7.0", arith refuses a non-integer
    for text in ["#### 7", "so #### 2,400", "#### 7.0", "The answer is 7", "#### 2400\n", "#### 2"]:
        for ex in train:
            rule = gsm8k_score if ex["data_source"] == "openai/gsm8k" else arith_score
            assert score(text, ex) == rule(text, ex["ground_truth"]), (text, ex["data_source"])
    assert score("The answer is 7", train[0]) == 0.0  # strict by default ...
    flexible = scorer(load_config(TINY, ["data.task=null", f"data.train_files={path}",
                                         "reward_model.score_method=flexible"]))
    assert flexible("The answer is 7", train[0]) == 1.0  # ... reward_model.score_method reaches the source's rule


def test_an_unknown_data_source_is_one_line_naming_the_known_ones(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"data_source": "numina_olympiads", "prompt": [{"role": "user", "content": "1+1?"}],
                                "reward_model": {"ground_truth": "2"}}) + "\n")
    cfg = load_config(TINY, ["data.task=null", f"data.train_files={path}"])
    train, _ = get_task(None).examples(cfg.data)
    with pytest.raises(UserError) as err:
        check_sources(cfg, train)
    text = str(err.value)
    assert "\n" not in text and "'numina_olympiads'" in text and "known: arith, openai/gsm8k" in text
    assert "custom_reward_function.path" in text
    # the user's own function scores every row, whatever its data_source
    mine = tmp_path / "mine.py"
    mine.write_text(REWARD_FILE)
    cfg = load_config(TINY, ["data.task=null", f"data.train_files={path}", f"custom_reward_function.path={mine}"])
    check_sources(cfg, train)
    assert scorer(cfg)("abc", train[0]) == 3.0
