"""nanokl.harness.data: verl-style rows from JSONL / JSON / Parquet, one-line errors for bad rows,
stateless batches, and prompts that round-trip the tokenizer. (Each task's own data: tests/test_tasks.py.)"""

import json
import sys
import types

import pytest

from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.data import (_permutation, batch_indices, build_prompts, drop_overlong, filter_overlong,
                                 steps_per_epoch)
from nanokl.tasks.rows import read_examples, verl_row_to_example
from nanokl.harness.tokenizer import train_tokenizer
from nanokl.tasks.arith import ArithDifficulty, make_arith_task
from verl_data import write_rows


def load_examples(paths, prompt_key="prompt", reward_fn_key="data_source"):
    return read_examples(paths, lambda row, where: verl_row_to_example(row, where, prompt_key, reward_fn_key))


# ---------------------------------------------------------------------------------------------
# Rows from files
# ---------------------------------------------------------------------------------------------


def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"prompt": "What is 2+2?", "data_source": "x", "reward_model": {"ground_truth": "4"}})


@pytest.mark.parametrize("bad, message", [
    ('{"question": "x", "answer": ', "bad JSON"),
    ('{"prompt": 5, "data_source": "x", "reward_model": {"ground_truth": "1"}}',
     "field 'prompt' must be str or list, got int"),
    ('{"prompt": "q", "data_source": true, "reward_model": {"ground_truth": "1"}}',
     "field 'data_source' must be str, got bool"),
    ('[1, 2]', "a row must be a JSON object"),
    ('{"prompt": "q", "data_source": "openai/gsm8k"}', "missing field 'reward_model'"),
    ('{"prompt": "q", "data_source": "x", "reward_model": {"style": "rule"}}', "missing field 'ground_truth'"),
    ('{"prompt": "q", "data_source": "x", "reward_model": {"ground_truth": [1]}}', "must be str or int, got list"),
    ('{"prompt": [{"role": "assistant", "content": "hi"}], "data_source": "x", "reward_model": '
     '{"ground_truth": "1"}}', "roles ['assistant']"),
    ('{"other": 1}', "missing field 'prompt'"),
])
def test_a_bad_row_names_file_and_line(tmp_path, bad, message):
    # line 2 is blank: lines are counted in the file, as an editor counts them
    path = write(tmp_path / "train.jsonl", [GOOD, "", GOOD, bad, GOOD])
    with pytest.raises(UserError) as err:
        load_examples(path)
    text = str(err.value)
    assert text.startswith(f"{path}:4: ") and message in text and "\n" not in text


def test_missing_file_unknown_suffix_and_empty_file(tmp_path):
    with pytest.raises(UserError, match="data file not found: .*nope.jsonl"):
        load_examples(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="unknown data file type '.csv'"):
        load_examples(write(tmp_path / "a.csv", ["q,a"]))
    with pytest.raises(UserError, match="no examples"):
        load_examples(write(tmp_path / "empty.jsonl", [""]))


VERL_ROWS = [
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Q1"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "18"}, "extra_info": {"index": 0}},
    {"data_source": "arith", "prompt": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Q2"}],
     "reward_model": {"style": "rule", "ground_truth": -5}},
    {"data_source": "openai/gsm8k", "prompt": "Q3 as a plain string", "reward_model": {"ground_truth": "1000"}},
]
# the text fields for every template, the chat as given for the model's chat template, extra_info as given
VERL_EXPECTED = [
    {"prompt": "Q1", "ground_truth": "18", "data_source": "openai/gsm8k",
     "messages": [{"role": "user", "content": "Q1"}], "extra_info": {"index": 0}},
    {"prompt": "Q2", "ground_truth": "-5", "data_source": "arith", "system_prompt": "Be brief.",
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q2"}]},
    {"prompt": "Q3 as a plain string", "ground_truth": "1000", "data_source": "openai/gsm8k"},
]


def test_verl_style_rows_jsonl_json_array_and_keys(tmp_path):
    assert load_examples(write(tmp_path / "v.jsonl", [json.dumps(r) for r in VERL_ROWS])) == VERL_EXPECTED
    (tmp_path / "v.json").write_text(json.dumps(VERL_ROWS, indent=1))
    assert load_examples(str(tmp_path / "v.json")) == VERL_EXPECTED
    renamed = [{"question_text": "Q", "task": "arith", "reward_model": {"ground_truth": "3"}}]
    got = load_examples(write(tmp_path / "r.jsonl", [json.dumps(r) for r in renamed]),
                        prompt_key="question_text", reward_fn_key="task")
    assert got == [{"prompt": "Q", "ground_truth": "3", "data_source": "arith"}]


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [dict(r, prompt=r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}],
                 reward_model={"ground_truth": str(r["reward_model"]["ground_truth"])}) for r in VERL_ROWS]
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ("data_source", "prompt", "reward_model")}
                                         for r in rows]), tmp_path / "v.parquet")
    as_chat = [{**e, "messages": e.get("messages", [{"role": "user", "content": e["prompt"]}])} for e in VERL_EXPECTED]
    assert load_examples(tmp_path / "v.parquet") == [{k: v for k, v in e.items() if k != "extra_info"} for e in as_chat]
    rows[1]["reward_model"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r"bad.parquet:row 1: missing field 'reward_model'"):  # null = absent
        load_examples(tmp_path / "bad.parquet")


def test_parquet_nulls_are_absent_fields(tmp_path):
    """A Parquet table has every column in every row (null where a row lacks it): a file mixing
    chosen/rejected rows with responses/ranking rows reads as each row was written."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from nanokl.supervised.preference_data import read_preferences
    keys = ("prompt", "chosen", "rejected", "responses", "ranking")
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "responses": ["5", "4"],
                                                               "ranking": [1, 0]}]
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), tmp_path / "mixed.parquet")
    got = read_preferences(tmp_path / "mixed.parquet")
    assert [(r["responses"], r["ranking"]) for r in got] == [(["2", "3"], [0, 1]), (["5", "4"], [1, 0])]


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"t.parquet: reading Parquet needs pyarrow \(pip install pyarrow\)"):
        load_examples(tmp_path / "t.parquet")


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def test_each_epoch_covers_every_index_once():
    n, bs = 10, 3
    assert steps_per_epoch(n, bs, drop_last=False) == 4 and steps_per_epoch(n, bs) == 3
    epochs = []
    for e in range(3):
        batches = [batch_indices(n, bs, e * 4 + k, seed=5, drop_last=False) for k in range(4)]
        assert [len(b) for b in batches] == [3, 3, 3, 1]
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(n))
        epochs.append(flat)
    assert epochs[0] != epochs[1] != epochs[2]  # a fresh permutation per epoch
    for e in range(2):  # drop_last: three disjoint full batches, one index left out per epoch
        batches = [batch_indices(n, bs, e * 3 + k, seed=5) for k in range(3)]
        flat = [i for b in batches for i in b]
        assert [len(b) for b in batches] == [3, 3, 3] and len(set(flat)) == 9 and set(flat) <= set(range(n))


def test_batches_are_a_pure_function_of_step_and_seed():
    run = [batch_indices(1000, 64, s, seed=1) for s in range(40)]
    _permutation.cache_clear()  # as after a restart: step 23 alone gives the same batch
    assert batch_indices(1000, 64, 23, seed=1) == run[23]
    assert batch_indices(1000, 64, 23, seed=2) != run[23]
    assert batch_indices(10, 4, 1, seed=0, shuffle=False) == [4, 5, 6, 7]
    assert batch_indices(10, 4, 2, seed=0, shuffle=False) == [0, 1, 2, 3]  # epoch 1 starts over
    with pytest.raises(UserError, match="cannot fill one batch"):
        batch_indices(3, 4, 0, seed=0)


# ---------------------------------------------------------------------------------------------
# Prompts -> token ids
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    train, _ = make_arith_task(500, 0, seed=0)
    texts = [ex["prompt"] + ex["solution"] for ex in train]
    return train_tokenizer(texts + ["Be brief. system user assistant"], vocab_size=300)


def test_build_prompts_left_pads_and_round_trips(tok):
    examples = [{"prompt": "Q: 1+2=?\nA:"}, {"prompt": "Q: 37+48-12=?\nA:"},
                {"prompt": "Q: 5-9=?\nA:", "system_prompt": "Be brief."}]
    for template, expected in [
        ("plain", ["Q: 1+2=?\nA:", "Q: 37+48-12=?\nA:", "Be brief.\nQ: 5-9=?\nA:"]),
        ("chatml", ["<|im_start|>user\nQ: 1+2=?\nA:<|im_end|>\n<|im_start|>assistant\n",
                    "<|im_start|>user\nQ: 37+48-12=?\nA:<|im_end|>\n<|im_start|>assistant\n",
                    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 5-9=?\nA:<|im_end|>\n"
                    "<|im_start|>assistant\n"]),
    ]:
        ids, mask = build_prompts(examples, tok, template, max_length=64, truncation="error")
        lengths = [len(tok.encode_one(t)) for t in expected]
        assert ids.shape == mask.shape == (3, max(lengths))
        for b, n in enumerate(lengths):
            pad = ids.shape[1] - n
            assert mask[b, :pad].eq(0).all() and mask[b, pad:].eq(1).all()
            assert ids[b, :pad].eq(tok.pad_token_id).all()
        assert tok.batch_decode(ids, mask, skip_special_tokens=False) == expected
    # a run-wide system prompt applies where the row brings none
    ids, mask = build_prompts(examples[:1], tok, "plain", system_prompt="Be brief.")
    assert tok.batch_decode(ids, mask) == ["Be brief.\nQ: 1+2=?\nA:"]


def test_filter_overlong_keeps_exactly_the_prompts_that_fit(tok):
    short, _ = make_arith_task(20, 0, seed=2, difficulty=ArithDifficulty(2, 9, "+-"))
    long, _ = make_arith_task(20, 0, seed=2, difficulty=ArithDifficulty(4, 999, "+-"))
    train = [e for pair in zip(short, long) for e in pair]  # interleaved, so order must be kept
    lengths = [len(tok.encode_one(e["prompt"])) for e in train]
    limit = sorted(lengths)[len(lengths) // 2]
    kept = filter_overlong(train, tok, "plain", limit)
    assert kept == [e for e, n in zip(train, lengths) if n <= limit] and 0 < len(kept) < len(train)
    build_prompts(kept, tok, "plain", max_length=limit)  # fits: no error
    with pytest.raises(UserError, match=f"over data.max_prompt_length={limit}"):
        build_prompts(train, tok, "plain", max_length=limit)


def test_drop_overlong_says_the_count_once_and_refuses_to_drop_everything(tok):
    train, _ = make_arith_task(30, 0, seed=4)
    lengths = [len(tok.encode_one(e["prompt"])) for e in train]
    limit = sorted(lengths)[len(lengths) // 2]
    data = types.SimpleNamespace(prompt_template="plain", max_prompt_length=limit)
    said = []
    kept = drop_overlong(train, tok, data, "training", said.append)
    assert kept == [e for e, n in zip(train, lengths) if n <= limit]
    assert said == [f"data.filter_overlong_prompts: dropped {len(train) - len(kept)} of {len(train)} training "
                    f"prompts longer than {limit} tokens"]
    data.max_prompt_length = min(lengths) - 1
    with pytest.raises(UserError, match="dropped every validation prompt"):
        drop_overlong(train, tok, data, "validation", said.append)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_write_rows_round_trips_verl_rows(tmp_path, suffix):
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    # (one type per Parquet column: the ground truths as strings, as verl's preprocessing writes them)
    rows = [dict(r, reward_model={**r["reward_model"], "ground_truth": str(r["reward_model"]["ground_truth"])})
            for r in VERL_ROWS[:2]]
    assert load_examples(write_rows(tmp_path / f"rows.{suffix}", rows)) == VERL_EXPECTED[:2]
