"""nanokl.tasks: the task table, the arithmetic task against a hand parser, GSM8K against its files
and OpenAI's labelled model solutions, and a task defined in this file alone driving train_ppo.py."""

import dataclasses
import json
import math
import random
import types
from pathlib import Path

import pytest

from nanokl.harness.config.schema import DataConfig
from nanokl.harness.config.yaml_io import ConfigError, UserError
from nanokl.harness.config.load import load_config
from nanokl.tasks.rows import DataError
from nanokl.tasks import TASKS, arith, get_task, gsm8k
from nanokl.tasks.arith import ArithDifficulty, arith_score, make_arith_task, mix_answer_formats
from nanokl.tasks.gsm8k import INSTRUCTION, extract_gsm8k_answer, gsm8k_score, load_examples
from verl_data import verl_row, write_rows

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "arith_tiny.yaml"

# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def test_every_task_has_the_interface():
    for name, task in TASKS.items():
        assert callable(task.examples) and callable(task.score), name
        assert task.demonstrations is None or callable(task.demonstrations), name
    assert get_task("arith") is arith
    with pytest.raises(UserError, match="unknown task 'nope' .*known: arith, gsm8k"):
        get_task("nope")


def test_config_rejects_an_unknown_task_naming_the_valid_ones(monkeypatch):
    valid = r"data.task must be one of arith, gsm8k; got 'arithh' \(did you mean 'arith'\?\)"
    with pytest.raises(ConfigError, match=valid):
        load_config(TINY, ["data.task=arithh"])
    monkeypatch.setitem(TASKS, "copy", COPY)  # a task is known once it is in the table: nothing else to register
    assert load_config(TINY, ["data.task=copy"]).data.task == "copy"


# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------


def hand_parse(expr):
    """'37+48*2-12' -> ([37, 48, 2, 12], ['+', '*', '-']), one character at a time."""
    nums, ops, cur = [], [], ""
    for ch in expr:
        if ch.isdigit():
            cur += ch
        else:
            nums.append(int(cur))
            ops.append(ch)
            cur = ""
    nums.append(int(cur))
    return nums, ops


def hand_value(nums, ops):
    """Sum of signed products: the school rule, written independently of arith._solve."""
    total, sign, term = 0, 1, nums[0]
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            term *= n
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), n
    return total + sign * term


def check_demo(ex):
    assert ex["prompt"].startswith("Q: ") and ex["prompt"].endswith("=?\nA:")
    nums, ops = hand_parse(ex["prompt"][3:-5])
    answer = hand_value(nums, ops)
    assert ex["ground_truth"] == str(answer) and ex["data_source"] == "arith"
    *steps, last = ex["solution"][1:].split("\n")
    assert last == f"#### {answer}"
    assert len(steps) == len(ops)  # one step per operator
    for step in steps:  # every step is a true equation "a op b=c"
        lhs, rhs = step.split("=")
        i = max(lhs.rfind(op) for op in "+-*")  # the operator (a leading digit is never an op here)
        a, op, b = int(lhs[:i]), lhs[i], int(lhs[i + 1:])
        assert int(rhs) == (a + b if op == "+" else a - b if op == "-" else a * b)
    assert int(steps[-1].split("=")[1]) == answer


def test_arith_is_deterministic_per_seed_and_differs_across_seeds():
    a = make_arith_task(300, 60, seed=0)
    assert a == make_arith_task(300, 60, seed=0)
    b = make_arith_task(300, 60, seed=1)
    assert [e["prompt"] for e in a[0]] != [e["prompt"] for e in b[0]]
    assert [e["prompt"] for e in a[1]] != [e["prompt"] for e in b[1]]
    # each split is its own stream: asking for more keeps the first ones
    more = make_arith_task(500, 80, seed=0)
    assert more[0][:300] == a[0] and more[1][:60] == a[1]


def test_arith_splits_are_disjoint_even_across_seeds_and_in_a_tiny_problem_space():
    tiny = ArithDifficulty(num_operands=2, max_operand=9, ops="+")  # only 100 problems exist
    train0, val0 = make_arith_task(80, 8, seed=0, difficulty=tiny)
    train1, _ = make_arith_task(80, 0, seed=1, difficulty=tiny)
    val_prompts = {e["prompt"] for e in val0}
    assert len(val_prompts) == 8 and len({e["prompt"] for e in train0}) == 80  # no repeats
    assert not val_prompts & {e["prompt"] for e in train0 + train1}
    train, val = make_arith_task(2000, 300, seed=3)
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in val}
    with pytest.raises(UserError, match="cannot draw 95 train problems"):
        make_arith_task(95, 0, seed=0, difficulty=tiny)
    with pytest.raises(UserError, match="num_operands >= 2"):
        make_arith_task(1, 1, seed=0, difficulty=ArithDifficulty(num_operands=1))


@pytest.mark.parametrize("difficulty", [ArithDifficulty(), ArithDifficulty(4, 20, "+-*")])
def test_arith_demonstrations_match_a_hand_parser(difficulty):
    train, val = make_arith_task(400, 100, seed=7, difficulty=difficulty)
    for ex in train + val:
        check_demo(ex)
    answers = [int(e["ground_truth"]) for e in train]
    assert min(answers) < 0 < max(answers)  # negative answers do occur: "#### -5"
    if "*" in difficulty.ops:
        assert any("*" in e["prompt"] and "+" in e["prompt"] for e in train)


def test_arith_default_responses_are_short_with_one_digit_per_token():
    from nanokl.harness.tokenizer import train_tokenizer
    train, val = make_arith_task(2000, 200, seed=0)
    tok = train_tokenizer([e["prompt"] + e["solution"] for e in train], vocab_size=300)
    lengths = [len(tok.encode_one(e["solution"])) for e in train + val]
    prompt_lengths = [len(tok.encode_one(e["prompt"])) for e in train + val]
    # worst case: 2+2 digits, intermediate and answer with up to 3 digits or a sign, written twice
    assert max(lengths) <= 28 and sum(lengths) / len(lengths) < 25
    assert max(prompt_lengths) <= 18


def test_every_arith_demonstration_scores_one_and_wrong_answers_zero():
    for difficulty in (ArithDifficulty(), ArithDifficulty(4, 30, "+-*")):
        train, val = make_arith_task(300, 50, seed=11, difficulty=difficulty)
        for ex in train + val:
            sol, truth = ex["solution"], ex["ground_truth"]
            assert arith_score(sol, truth) == 1.0 and arith.score(sol, ex) == 1.0
            body = sol.rsplit("#### ", 1)[0]
            assert arith_score(body + f"#### {int(truth) + 1}", truth) == 0.0
            assert arith_score(body + f"#### {truth}.5", truth) == 0.0  # not an integer
            assert arith_score(body, truth) == 0.0  # the steps alone do not count
    assert arith_score(" 2+3=5\n#### 5", 5) == 1.0
    assert arith_score("#### 5\n#### 6", "5") == 0.0  # the last one counts
    assert arith_score("#### -5", "-5") == 1.0 and arith_score("#### 5", "-5") == 0.0
    assert arith_score("5", "5") == 0.0


def test_arith_interface_reads_the_config_and_mixes_answer_formats():
    d = dataclasses.replace(DataConfig(), num_train=50, num_val=7, arith_num_operands=4, arith_ops="+-*")
    train, val = arith.examples(d, seed=3)
    assert (train, val) == make_arith_task(50, 7, 3, ArithDifficulty(4, 99, "+-*"))
    assert arith.examples(d, num_train=5, num_val=0, seed=3) == (train[:5], [])
    with pytest.raises(UserError, match="data.task=arith makes its own problems"):
        arith.examples(dataclasses.replace(d, train_files=["x.jsonl"]))
    train, _ = make_arith_task(400, 0, seed=0)
    mixed = arith.demonstrations(train, types.SimpleNamespace(alt_answer_share=0.7), seed=3)
    assert mixed == mix_answer_formats(train, 0.7, seed=3)
    alt = [m for m in mixed if "\nAnswer: " in m["solution"]]
    assert 0.6 < len(alt) / len(mixed) < 0.8
    for before, after in zip(train, mixed):  # only the final line changes
        assert after["solution"].replace("\nAnswer: ", "\n#### ") == before["solution"]


# ---------------------------------------------------------------------------------------------
# GSM8K: the rule on hand cases. format_score=0.5 tells "found but wrong" (0.5) from "no answer" (0).
# ---------------------------------------------------------------------------------------------

CASES = [
    # (text, ground truth, method, expected score)
    ("She makes 9 * 2 = $18 every day.\n#### 18", "18", "strict", 1.0),
    ("#### 1,234", "1234", "strict", 1.0),  # commas stripped from the answer ...
    ("#### 1234", "1,234", "strict", 1.0),  # ... and from the ground truth
    ("#### -5", "-5", "strict", 1.0),
    ("#### 5", "-5", "strict", 0.5),
    ("#### 7 first, then corrected: #### 18", "18", "strict", 1.0),  # the last #### wins
    ("#### 18 then a later #### 7", "18", "strict", 0.5),
    ("The answer is 18", "18", "strict", 0.0),  # strict wants the format
    ("####18", "18", "strict", 0.0),  # ... exactly: "#### " with the space
    ("#### $18", "18", "strict", 0.0),  # verl's pattern cannot start with $: no answer
    ("#### 18.0", "18", "strict", 0.5),  # verl: string equality, "18.0" is not "18"
    ("#### 3+4", "7", "strict", 0.5),  # never evaluated: it reads "3"
    ("The answer is 18", "18", "flexible", 1.0),
    ("She pays $1,000 in total", "1000", "flexible", 1.0),
    ("18 apples, so 20 in all", "20", "flexible", 1.0),  # the last number
    ("It is 18 . ", "18", "flexible", 1.0),  # a lone "." is punctuation, skipped
    ("It is 18 , . ,", "18", "flexible", 1.0),
    ("The answer is 18.", "18", "flexible", 0.5),  # verl parity: the period sticks: "18."
    ("x = 18.0", "18", "flexible", 0.5),
    ("temperature -3", "-3", "flexible", 1.0),
    ("no number at all.", "18", "flexible", 0.0),
    ("", "18", "strict", 0.0),
]


@pytest.mark.parametrize("text, truth, method, expected", CASES)
def test_gsm8k_hand_cases(text, truth, method, expected):
    assert gsm8k_score(text, truth, method, format_score=0.5) == expected
    ex = {"ground_truth": truth, "data_source": "openai/gsm8k"}
    assert gsm8k.score(text, ex, method) == (1.0 if expected == 1.0 else 0.0)


def test_gsm8k_defaults_score_and_clipping():
    assert gsm8k_score("#### 3", "4") == 0.0 and gsm8k_score("#### 4", "4", score=2.0) == 2.0
    assert gsm8k_score("#### 4", 4) == 1.0  # an int ground truth compares as its text
    # only the last 300 characters are read: 1000 digits before the answer do not matter ...
    assert gsm8k_score("9" * 1000 + " #### 18", "18") == 1.0
    assert gsm8k_score("9" * 1000 + " so 18", "18", "flexible") == 1.0
    # ... and an answer followed by more than 300 characters is out of sight
    assert gsm8k_score("#### 18" + " and so on" * 30, "18") == 0.0
    assert gsm8k_score("#### 18" + " and so on" * 29, "18") == 1.0  # 290 characters after: seen
    assert extract_gsm8k_answer("a lot\n#### 1,234,567") == "1234567"
    with pytest.raises(UserError, match="unknown GSM8K score method 'loose'"):
        gsm8k_score("#### 1", "1", "loose")


# ---------------------------------------------------------------------------------------------
# GSM8K: the files
# ---------------------------------------------------------------------------------------------


def test_gsm8k_test_file_loads_with_verl_preprocessing(gsm8k_dir):
    examples = load_examples(gsm8k_dir / "test.jsonl")
    raw = [json.loads(line) for line in open(gsm8k_dir / "test.jsonl", encoding="utf-8")]
    assert len(examples) == len(raw) == 1319
    for ex, row in zip(examples, raw):
        assert ex["prompt"] == row["question"] + " " + INSTRUCTION
        assert ex["ground_truth"] == row["answer"].split("####")[-1].strip().replace(",", "")
        assert ex["data_source"] == "openai/gsm8k" and ex["solution"] == row["answer"]
    assert examples[0]["ground_truth"] == "18"  # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2
    assert examples[0]["prompt"].endswith('farmers\' market? Let\'s think step by step and output '
                                          'the final answer after "####".')
    d = dataclasses.replace(DataConfig(), task="gsm8k", train_files=[str(gsm8k_dir / "test.jsonl")],
                            val_files=[str(gsm8k_dir / "test.jsonl"), str(gsm8k_dir / "train.jsonl")])
    train, val = gsm8k.examples(d)
    assert train == examples and len(val) == 1319 + 7473 and val[:1319] == examples
    assert gsm8k.examples(d, num_train=5, num_val=0) == (examples[:5], [])
    assert gsm8k.demonstrations(train, None, seed=0) == train  # the reference solutions
    with pytest.raises(UserError, match="data.task=gsm8k reads its prompts from files"):
        gsm8k.examples(DataConfig())


def test_every_reference_answer_scores_one(gsm8k_dir):
    examples = load_examples([gsm8k_dir / "test.jsonl", gsm8k_dir / "train.jsonl"])
    assert len(examples) == 1319 + 7473
    assert all(gsm8k.score(ex["solution"], ex) == 1.0 for ex in examples)
    # and a wrong ground truth makes each of them wrong: the check is not vacuous
    assert all(gsm8k_score(ex["solution"], str(int(ex["ground_truth"]) + 1)) == 0.0 for ex in examples[:200])


MODELS = ["6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"]


def test_flexible_agrees_with_labelled_model_solutions(gsm8k_dir):
    """OpenAI's released GSM8K samples carry `is_correct` labels; the flexible rule must agree.

    The reference solutions end in "A: 18"; that number (commas removed) is the ground truth,
    and it equals the `#### N` of the same question in test.jsonl."""
    rows = [json.loads(line) for line in open(gsm8k_dir / "example_model_solutions.jsonl", encoding="utf-8")]
    test = load_examples(gsm8k_dir / "test.jsonl")
    assert len(rows) == len(test) == 1319
    agree, labels_true = {}, 0
    for row, ex in zip(rows, test):
        truth = row["ground_truth"].rsplit("A:", 1)[1].strip().replace(",", "")
        assert truth == ex["ground_truth"] and ex["prompt"].startswith(row["question"])
        for m in MODELS:
            correct = gsm8k_score(row[m]["solution"], truth, "flexible") == 1.0
            agree[m] = agree.get(m, 0) + (correct == row[m]["is_correct"])
            labels_true += row[m]["is_correct"]
    rates = {m: agree[m] / len(rows) for m in MODELS}
    overall = sum(agree.values()) / (len(rows) * len(MODELS))
    print("flexible vs is_correct:", rates, "overall", overall)
    assert 0.2 < labels_true / (len(rows) * len(MODELS)) < 0.8  # both labels are common: agreement is earned
    assert overall >= 0.995 and min(rates.values()) >= 0.995, rates


GOOD = json.dumps({"question": "What is 2+2?", "answer": "2+2=4\n#### 4"})


@pytest.mark.parametrize("bad, message", [
    ('{"question": "What is 2+2?"}', "missing field 'answer'"),
    ('{"question": 5, "answer": "#### 5"}', "field 'question' must be str, got int"),
    ('{"question": "q", "answer": "no final answer"}', "no '#### <number>' final answer"),
    ('{"prompt": "q", "data_source": "lighteval/MATH", "reward_model": {"ground_truth": "1"}}',
     "data_source 'lighteval/MATH' is not 'openai/gsm8k'"),
    ('{"prompt": "q", "data_source": "openai/gsm8k"}', "missing field 'reward_model'"),  # verl rows: data.py
])
def test_a_bad_gsm8k_row_names_file_and_line(tmp_path, bad, message):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([GOOD, "", GOOD, bad, GOOD]) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_examples(path)
    text = str(err.value)
    assert text.startswith(f"{path}:4: ") and message in text and "\n" not in text


def test_verl_style_gsm8k_rows_have_no_demonstrations(tmp_path):
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Q1"}],
           "reward_model": {"ground_truth": "18"}}
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    [ex] = load_examples(tmp_path / "v.jsonl")
    assert ex == {"prompt": "Q1", "ground_truth": "18", "data_source": "openai/gsm8k", "messages": row["prompt"]}
    with pytest.raises(UserError, match="no GSM8K row here has a reference solution"):
        gsm8k.demonstrations([ex], None, seed=0)


def test_verl_row_is_what_verls_preprocessing_writes(tmp_path):
    """verl_row (tests/verl_data.py) against the row verl's examples/data_preprocess/gsm8k.py builds,
    written out by hand; and such rows read back from Parquet as verl's rows (write_rows; needs pyarrow)."""
    question, answer = "A pen costs $2. How much do 600 pens cost?", "600*2=1200\n#### 1,200"
    row = verl_row(question, answer, "test", 5)
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + ' Let\'s think step by step and output the final answer '
                                                          'after "####".'}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1200"},
        "extra_info": {"split": "test", "index": 5, "answer": answer, "question": question},
    }
    with pytest.raises(UserError, match="no '#### <number>' final answer"):
        verl_row("q", "no answer", "train", 0)
    pytest.importorskip("pyarrow")
    path = write_rows(tmp_path / "test.parquet", [row, verl_row("Q2", "#### -3", "test", 6)])
    got = load_examples(path)
    assert [(e["prompt"], e["ground_truth"], e["messages"], e["extra_info"]["index"]) for e in got] == [
        (row["prompt"][0]["content"], "1200", row["prompt"], 5), ("Q2 " + INSTRUCTION, "-3",
                                                                   [{"role": "user", "content": "Q2 " + INSTRUCTION}], 6)]


# ---------------------------------------------------------------------------------------------
# A new task is one module: this one lives in the test alone and trains end to end
# ---------------------------------------------------------------------------------------------

def _copy_examples(data, num_train=None, num_val=None, seed=0):
    num_train = data.num_train if num_train is None else num_train
    num_val = data.num_val if num_val is None else num_val
    numbers = random.Random(f"copy/{seed}").sample(range(100_000), num_train + num_val)
    out = [{"prompt": f"Copy {n}:", "ground_truth": str(n), "data_source": "copy"} for n in numbers]
    return out[:num_train], out[num_train:]


COPY = types.SimpleNamespace(
    examples=_copy_examples,
    score=lambda text, example, method="strict": float(text.strip() == example["ground_truth"]),
    demonstrations=lambda examples, sft_cfg, seed: [{**ex, "solution": " " + ex["ground_truth"]} for ex in examples],
)


def test_a_task_defined_in_the_test_alone_warm_starts_and_trains(tmp_path, monkeypatch):
    """Registering the module is all it takes: the warm start imitates its demonstrations,
    PPO samples its prompts and scores them with its rule, validation reports its data_source."""
    import train_ppo
    from nanokl.harness.tracking import read_metrics
    monkeypatch.setitem(TASKS, "copy", COPY)
    sft, run = tmp_path / "sft", tmp_path / "ppo"
    train_ppo.main(["--config", str(TINY), "data.task=copy", "data.num_train=32", "data.num_val=8",
                    "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=8",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                    "sft.steps=20", "sft.num_examples=256", "sft.hidden_size=32", "sft.intermediate_size=48",
                    "sft.num_hidden_layers=1", f"sft.output_dir={sft}", f"actor_rollout_ref.model.path={sft}",
                    "trainer.logger=[jsonl]", "trainer.total_training_steps=2", "trainer.test_freq=2",
                    "trainer.save_freq=-1", f"trainer.default_local_dir={run}", "trainer.device=cpu"])
    assert json.loads((sft / "sft_metrics.json").read_text())["steps"] == 20  # the task's own warm start
    rows = read_metrics(run)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2]
    assert "val-core/copy/acc/mean@1" in rows[0] and "val-core/copy/acc/mean@1" in rows[-1]
    assert not any(k.startswith("val-core/") and "/copy/" not in k for r in rows for k in r)
    for r in rows:
        for k, v in r.items():
            if k != "monitor/health":
                assert isinstance(v, (int, float)) and math.isfinite(v), f"{k}={v}"
    assert 0.0 <= rows[-1]["critic/score/mean"] <= 1.0
