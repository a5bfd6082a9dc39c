"""Bad input found when it loads (issue 39, item 6): one line `error: ...`, exit 2, before step 1.

- an over-long prompt anywhere in a file (not only in the first batch) with data.truncation=error:
  refused naming the file and line of the first one (filter_overlong_prompts still drops and counts);
- a ground truth its task's rule cannot read (arithmetic "" or "7.5", GSM8K "" or "n/a"), whether
  data.task or the row's data_source picks the rule: refused naming file:line;
- data.max_prompt_length + data.max_response_length past the model's max_position_embeddings
  (train_ppo.py), a prompt + --max-new-tokens past it (generate.py): refused naming config.json;
- an empty YAML config file: refused naming the file;
- an infinite or NaN value for any float config key: refused naming the key (every float key is tried);
- a custom reward function returning something other than a number or a dict with a numeric "score"
  ("1.0", None, a dict without "score"): refused naming the function, the row's data_source and index.
"""

import dataclasses
import json
import math
import sys
import types
import typing
from pathlib import Path

import pytest
import torch

import generate
import train_ppo
from nanokl.harness.config.schema import Config
from nanokl.harness.config.yaml_io import ConfigError, run_cli
from nanokl.harness.config.load import load_config, parse_cli
from nanokl.harness.tokenizer import train_tokenizer
from nanokl.harness.run_state import TrainingStopped
from nanokl.tasks import arith, gsm8k
from test_reward_fn import rollout

ROOT = Path(__file__).resolve().parents[1]
TINY_CFG = ROOT / "configs" / "arith_tiny.yaml"
TINY = ["--config", str(TINY_CFG), "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.total_training_steps=2",
        "trainer.val_before_train=false"]


def train_cli(argv, capfd, monkeypatch):
    """train_ppo.py's command line in this process: (exit status, stderr)."""
    capfd.readouterr()
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", *map(str, argv)])
    with pytest.raises(SystemExit) as info:
        train_ppo.cli(train_ppo.main)
    return info.value.code, capfd.readouterr().err


def one_error(err) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def verl_rows(path, n=16, source="arith", long_at=None, truth_at=None, truth=""):
    """n verl-style rows of small sums; row `long_at` has a prompt of ~90 tokens, row `truth_at` the ground
    truth `truth`."""
    rows = []
    for i in range(n):
        a, b = i % 10, (3 * i) % 10
        prompt = "Q: " + "+".join(["1"] * 40) + "=?\nA:" if i == long_at else f"Q: {a}+{b}=?\nA:"
        rows.append({"data_source": source, "prompt": prompt,
                     "reward_model": {"ground_truth": truth if i == truth_at else str(a + b)}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def files_args(sft_dir, run_dir, train, val=None, *extra):
    return [*TINY, "data.task=null", f"data.train_files={train}", *([f"data.val_files={val}"] if val else []),
            f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run_dir}", *extra]


# ---------------------------------------------------------------------------------------------
# over-long prompts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["train", "val"])
def test_an_overlong_prompt_past_the_first_batch_is_refused_at_load_naming_file_and_line(
        sft_dir, tmp_path, capfd, monkeypatch, split):
    good = verl_rows(tmp_path / "good.jsonl")
    bad = verl_rows(tmp_path / "bad.jsonl", long_at=11)  # line 12: not in the first 8 rows
    train, val = (bad, good) if split == "train" else (good, bad)
    code, err = train_cli(files_args(sft_dir, tmp_path / "run", train, val), capfd, monkeypatch)
    assert code == 2
    line = one_error(err)
    assert f"{bad}:12:" in line and "data.max_prompt_length=24" in line, line
    assert "data.filter_overlong_prompts" in line and "data.truncation" in line  # the ways out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any step (and any validation)


def test_filter_overlong_prompts_still_drops_and_counts_instead(sft_dir, tmp_path, capfd, monkeypatch):
    bad = verl_rows(tmp_path / "bad.jsonl", long_at=11)
    code, err = train_cli(files_args(sft_dir, tmp_path / "run", bad, None, "data.filter_overlong_prompts=true"),
                          capfd, monkeypatch)
    assert code == 0, err[-3000:]
    assert "data.filter_overlong_prompts: dropped 1 of 16 training prompts longer than 24 tokens" in err


# ---------------------------------------------------------------------------------------------
# ground truths the task's rule cannot read
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task,source,truth", [
    (None, "arith", ""),  # the row's data_source picks the arithmetic rule
    (None, "arith", "7.5"),
    ("gsm8k", "openai/gsm8k", ""),
    ("gsm8k", "openai/gsm8k", "n/a"),
    (None, "openai/gsm8k", "-"),
])
def test_a_ground_truth_the_rule_cannot_read_is_refused_at_load_naming_file_and_line(
        sft_dir, tmp_path, capfd, monkeypatch, task, source, truth):
    bad = verl_rows(tmp_path / "train.jsonl", source=source, truth_at=10, truth=truth)
    extra = [f"data.task={task}"] if task else []
    code, err = train_cli(files_args(sft_dir, tmp_path / "run", bad, None, *extra, "trainer.total_training_steps=1"),
                          capfd, monkeypatch)
    assert code == 2, err[-3000:]
    line = one_error(err)
    assert f"{bad}:11:" in line and "ground truth" in line and repr(truth) in line, line


def test_a_custom_reward_function_reads_its_own_truths(sft_dir, tmp_path, capfd, monkeypatch):
    """With custom_reward_function no task rule reads the truths: an empty one is the function's business."""
    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    bad = verl_rows(tmp_path / "train.jsonl", truth_at=10, truth="")
    code, err = train_cli(files_args(sft_dir, tmp_path / "run", bad, None, f"custom_reward_function.path={fn}",
                                     "trainer.total_training_steps=1"), capfd, monkeypatch)
    assert code == 0, err[-3000:]


def test_each_task_says_which_truths_its_rule_reads():
    for ok in ("0", "17", "-3", "007"):
        assert arith.truth_problem(ok) is None
    for bad in ("", " ", "7.5", "seven", "1e3"):
        assert "integer" in arith.truth_problem(bad)
    for ok in ("18", "-3", "1,234", "$18", "7.5"):
        assert gsm8k.truth_problem(ok) is None
    for bad in ("", "  ", "n/a", ".", "$"):
        assert gsm8k.truth_problem(bad)
    # what the rule reads is what it can match: each accepted truth scores 1 on its own `#### N`
    assert gsm8k.gsm8k_score("#### 1,234", "1,234") == 1.0 and arith.arith_score("#### -3", "-3") == 1.0


# ---------------------------------------------------------------------------------------------
# the model's positions
# ---------------------------------------------------------------------------------------------

def test_prompt_plus_response_past_max_position_embeddings_is_refused_at_start(sft_dir, tmp_path, capfd,
                                                                               monkeypatch):
    code, err = train_cli([*TINY, "data.max_response_length=48", f"actor_rollout_ref.model.path={sft_dir}",
                           f"trainer.default_local_dir={tmp_path / 'run'}"], capfd, monkeypatch)
    assert code == 2
    line = one_error(err)
    assert str(sft_dir / "config.json") in line and "max_position_embeddings=64" in line, line
    assert "data.max_prompt_length (24) + " in line and "(48) = 72" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def gen(sft_dir, capfd, *argv):
    capfd.readouterr()
    with pytest.raises(SystemExit) as info:
        run_cli(generate.main, ["--model", str(sft_dir), "--device", "cpu", *map(str, argv)])
    return info.value.code, capfd.readouterr().err


def test_generate_refuses_a_prompt_plus_new_tokens_past_max_position_embeddings(sft_dir, capfd):
    code, err = gen(sft_dir, capfd, "--prompt", "Q: 1+2=?\nA:", "--max-new-tokens", "60")
    assert code == 2
    line = one_error(err)
    assert str(sft_dir / "config.json") in line and "max_position_embeddings=64" in line and "--max-new-tokens" in line


def test_generate_without_max_new_tokens_stays_within_the_model(sft_dir, capfd):
    """The default --max-new-tokens (128) is capped by the room the longest prompt leaves."""
    stats = generate.main(["--model", str(sft_dir), "--device", "cpu", "--prompt", "Q: 1+2=?\nA:",
                           "--temperature", "0"])
    assert stats["rows"] == 0  # printed, not written
    assert "error" not in capfd.readouterr().err


# ---------------------------------------------------------------------------------------------
# config files and values
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "~\n"])
def test_an_empty_yaml_config_is_refused_naming_the_file(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="empty") as info:
        load_config(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(parse_cli, ["--config", str(path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {path}")


def test_an_empty_file_in_a_defaults_chain_is_refused_too(tmp_path):
    (tmp_path / "base.yaml").write_text("")
    (tmp_path / "main.yaml").write_text("defaults: [base.yaml]\ntrainer:\n  seed: 3\n")
    with pytest.raises(ConfigError, match="empty") as info:
        load_config(tmp_path / "main.yaml")
    assert str(tmp_path / "base.yaml") in str(info.value)


def float_keys(cls=Config, prefix=""):
    """Every dotted key whose annotation holds a float (float, Optional[float], float | list ...)."""
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += float_keys(tp, prefix + f.name + ".")
        elif tp is float or (typing.get_origin(tp) in (typing.Union, types.UnionType) and float in typing.get_args(tp)):
            keys.append(prefix + f.name)  # (a list of floats, AdamW's betas, is the next test's)
    return keys


def _str_first(key):
    """A key whose annotation takes a string before a float (a spec such as rollout_rs_threshold "0.5_2.0"):
    the text "inf" is a string there, parsed (or refused) by what reads the spec."""
    section, name = key.rsplit(".", 1)
    cls = Config
    for part in section.split("."):
        cls = typing.get_type_hints(cls)[part]
    args = typing.get_args(typing.get_type_hints(cls)[name])
    return str in args and args.index(str) < args.index(float)


def test_every_float_key_refuses_inf_and_nan():
    keys = float_keys()
    assert len(keys) > 40 and "algorithm.kl_ctrl.kl_coef" in keys
    for key in keys:
        spellings = (".inf", ".nan") if key != "algorithm.kl_ctrl.kl_coef" else (".inf", "-.inf", ".nan", "inf", "nan")
        for value in spellings + (() if _str_first(key) else ("-inf",)):
            with pytest.raises(ConfigError) as info:
                load_config(None, [f"{key}={value}"])
            message = str(info.value)
            assert key in message and "finite" in message, (key, value, message)


def test_inf_in_a_file_and_in_a_list_of_floats_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  kl_ctrl:\n    kl_coef: .inf\n")
    with pytest.raises(ConfigError, match=f"{path}:3: algorithm.kl_ctrl.kl_coef must be a finite number"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"algorithm.kl_ctrl.target_kl\[1\]\[1\] must be a finite number"):
        load_config(TINY_CFG, ["algorithm.kl_ctrl.target_kl=[[0, 0.1], [0.5, .nan]]"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.optim.betas\[0\] must be a finite number"):
        load_config(TINY_CFG, ["actor_rollout_ref.actor.optim.betas=[.nan, 0.999]"])


def test_validate_refuses_a_non_finite_float_set_in_code():
    from nanokl.harness.config.rules import validate
    cfg = load_config(TINY_CFG)
    cfg.algorithm.kl_ctrl.kl_coef = math.inf
    with pytest.raises(ConfigError, match="algorithm.kl_ctrl.kl_coef must be a finite number"):
        validate(cfg)


# ---------------------------------------------------------------------------------------------
# a custom reward function's return value
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["Q: 12+30=?\nA: 42\n#### 42", "Answer: 7"], vocab_size=300)


def batch(tok, prompts, responses):
    """A rollout batch by hand, every response ended by its EOS (test_reward_fn's builder)."""
    return rollout(tok, prompts, responses, eos=[True] * len(responses))


CUSTOM = '''
def my_score(data_source, solution_str, ground_truth, extra_info=None):
    return RETURNS if data_source == "odd" else 1.0
'''


@pytest.mark.parametrize("returns,shown", [('"1.0"', "'1.0' (str)"), ("None", "None (NoneType)"),
                                           ('{"acc": 1.0}', "without a 'score'"),
                                           ('{"score": "1"}', "'1' (str)"), ("[1.0]", "[1.0] (list)")])
def test_a_custom_reward_that_is_not_a_number_is_refused_naming_function_source_and_row(tmp_path, tok, returns,
                                                                                         shown):
    from nanokl.harness.scoring import score_batch
    path = tmp_path / f"r{abs(hash(returns))}.py"
    path.write_text(CUSTOM.replace("RETURNS", returns))
    cfg = load_config(TINY_CFG, [f"custom_reward_function.path={path}", "custom_reward_function.name=my_score"])
    examples = [{"prompt": "Q: 1+2=?\nA:", "ground_truth": "3", "data_source": s, "extra_info": {"index": 40 + i}}
                for i, s in enumerate(["even", "even", "odd", "even"])]
    out = batch(tok, [ex["prompt"] for ex in examples], ["#### 3"] * 4)
    with pytest.raises(TrainingStopped) as info:  # a stop (exit 1), not a traceback
        score_batch(tok, out, examples, cfg)
    message = str(info.value)
    assert "my_score" in message and str(path) in message and "'odd'" in message, message
    assert "response 2" in message and "index 42" in message and shown in message, message


@pytest.mark.parametrize("returns,want", [("True", 1.0), ("3", 3.0), ('{"score": 0.5, "acc": True}', 0.5),
                                          ("__import__('numpy').float32(0.25)", 0.25)])
def test_numbers_bools_and_score_dicts_are_still_taken(tmp_path, tok, returns, want):
    from nanokl.harness.scoring import score_batch
    path = tmp_path / f"ok{abs(hash(returns))}.py"
    path.write_text(CUSTOM.replace("RETURNS", returns))
    cfg = load_config(TINY_CFG, [f"custom_reward_function.path={path}", "custom_reward_function.name=my_score"])
    examples = [{"prompt": "Q: 1+2=?\nA:", "ground_truth": "3", "data_source": s} for s in ("even", "odd")]
    _, scores, _ = score_batch(tok, batch(tok, ["Q: 1+2=?\nA:"] * 2, ["#### 3"] * 2), examples, cfg)
    assert scores.tolist() == [1.0, want]
