"""generate.py as a verl user evaluates (issue 48 item 5): verl's Parquet / JSONL rows as prompts, every
prompt written as training wrote it (a chat through the model's own chat template: Qwen's default system
turn kept), and verl's main_generation keys (model.path=, data.path=, data.n_samples=, data.output_path=,
rollout.*=) with its output shape (each row + a `responses` column of n_samples texts). Each test drives
generate.py in a subprocess as it is typed; errors are one line, exit 2."""

import json
import shutil

import pytest

from chat_templates import QWEN2_5
from test_cluster import ROOT, errors, launch
from verl_data import write_rows

GENERATE = ROOT / "generate.py"
QUESTIONS = ["Q: 1+2-1=?\nA:", "Q: 5-3+4=?\nA:", "Q: 7+1-2=?\nA:"]


def verl_rows():
    return [{"data_source": "arith", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(eval(q[3:8]))}, "extra_info": {"index": i}}
            for i, q in enumerate(QUESTIONS)]


def qwen_model(sft_dir, tmp_path):
    """The warm start with Qwen2.5's chat template in its tokenizer_config.json (and room for its system turn)."""
    model = tmp_path / "qwen_like"
    shutil.copytree(sft_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 512}))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": QWEN2_5}))
    return model


def test_parquet_prompts_are_read_as_verl_rows(sft_dir, tmp_path):
    pytest.importorskip("pyarrow")
    src = write_rows(tmp_path / "test.parquet", verl_rows())
    r = launch(["--model", sft_dir, "--prompts", src, "--max-new-tokens", 4, "--device", "cpu"], script=GENERATE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stdout.count("=== prompt ") == len(QUESTIONS)


@pytest.mark.parametrize("suffix", [".jsonl", pytest.param(".parquet", marks=pytest.mark.slow)])
def test_chat_rows_are_written_as_training_writes_them(sft_dir, tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    from nanokl.harness.data import prompt_text
    from nanokl.harness.tokenizer import load_tokenizer
    from nanokl.tasks.rows import read_examples, verl_row_to_example
    model = qwen_model(sft_dir, tmp_path)
    src = write_rows(tmp_path / f"test{suffix}", verl_rows())
    tok = load_tokenizer(model)
    # what train_ppo feeds the model for data.train_files=src (return_raw_chat, as verl renders it)
    trained = [prompt_text(ex, tok, "plain") for ex in read_examples(src, verl_row_to_example)]
    assert all(t.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud") for t in trained)
    r = launch(["--model", model, "--prompts", src, "--max-new-tokens", 2, "--temperature", 0, "--device", "cpu"],
               script=GENERATE)
    assert r.returncode == 0, r.stderr[-2000:]
    for i, text in enumerate(trained):
        assert f"=== prompt {i} ===\n{text}" in r.stdout


@pytest.mark.parametrize("suffix", [".jsonl", pytest.param(".parquet", marks=pytest.mark.slow)])
def test_main_generation_keys_write_verls_output(sft_dir, tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    rows = verl_rows()
    src = write_rows(tmp_path / f"test{suffix}", rows)
    out = tmp_path / "gen" / f"out{suffix}"
    r = launch([f"model.path={sft_dir}", f"data.path={src}", "data.n_samples=3", f"data.output_path={out}",
                "data.batch_size=2", "rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=-1",
                "rollout.response_length=4", "rollout.prompt_length=256", "trainer.n_gpus_per_node=8",
                "trainer.nnodes=1", "rollout.name=vllm", "rollout.tensor_model_parallel_size=2",
                "rollout.gpu_memory_utilization=0.8", "--device", "cpu"], script=GENERATE)
    assert r.returncode == 0, r.stderr[-2000:]
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note: not acted on")]
    assert len(notes) == 1 and notes[0].endswith(": trainer.n_gpus_per_node, trainer.nnodes, rollout.name, "
                                                 "rollout.tensor_model_parallel_size, rollout.gpu_memory_utilization")
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        got = pq.read_table(out).to_pylist()
    else:
        got = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(got) == len(rows)
    for row, g in zip(rows, got):
        assert {k: v for k, v in g.items() if k != "responses"} == row
        assert len(g["responses"]) == 3 and all(isinstance(t, str) for t in g["responses"])


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_do_sample_false_is_greedy_and_keys_mix_with_flags(sft_dir, tmp_path):
    src = write_rows(tmp_path / "test.jsonl", verl_rows())
    outs = []
    for seed in (0, 1):
        out = tmp_path / f"out{seed}.jsonl"
        r = launch(["--model", sft_dir, f"data.path={src}", "data.n_samples=2", f"data.output_path={out}",
                    "rollout.do_sample=false", "rollout.response_length=4", "--seed", seed, "--device", "cpu"],
                   script=GENERATE)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append([json.loads(ln)["responses"] for ln in out.read_text().splitlines()])
    assert outs[0] == outs[1] and all(a == b for a, b in outs[0])


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_bad_inputs_are_one_line(sft_dir, tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1\x00\xff\xfe not parquet")
    binary_txt = tmp_path / "test.txt"
    binary_txt.write_bytes(b"PAR1\x00\xff\xfe\x80")
    rows = write_rows(tmp_path / "ok.jsonl", verl_rows())
    cases = [
        (["--model", sft_dir, "--prompts", bad], str(bad)),
        (["--model", sft_dir, "--prompts", binary_txt], str(binary_txt)),
        ([f"model.path={sft_dir}", f"data.path={tmp_path / 'absent.parquet'}"], "absent.parquet"),
        ([f"model.path={sft_dir}", f"data.path={rows}", "data.n_samples=two"], "data.n_samples"),
        ([f"model.path={sft_dir}", f"data.path={rows}", "rollout.bogus=1"], "rollout.bogus"),
        ([f"model.path={sft_dir}", f"data.path={rows}", "data.prompt_key=question"], "'question'"),
        ([f"model.path={sft_dir}", f"data.path={rows}", "rollout.prompt_length=2"], "rollout.prompt_length=2"),
        ([f"data.path={rows}"], "model.path"),
    ]
    for argv, named in cases:
        r = launch([*argv, "--device", "cpu"], script=GENERATE)
        assert r.returncode == 2, (argv, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and len(errors(r.stderr)) == 1 and named in errors(r.stderr)[0], r.stderr


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_without_pyarrow_parquet_is_one_line_and_output_falls_back_to_jsonl(sft_dir, tmp_path):
    """pyarrow absent (an import of it fails): a .parquet source is one line saying pip install pyarrow; a
    .parquet data.output_path is written as JSONL beside it, and a note says so."""
    import os
    import subprocess
    import sys
    block = tmp_path / "block" / "pyarrow"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('pyarrow is blocked by the test')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(block.parent)}
    pq_src = tmp_path / "test.parquet"
    pq_src.write_bytes(b"PAR1 whatever PAR1")
    src = write_rows(tmp_path / "test.jsonl", verl_rows())

    def gen(*argv):
        return subprocess.run([sys.executable, str(GENERATE), *map(str, argv), "--device", "cpu"], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=600)
    r = gen(f"model.path={sft_dir}", f"data.path={pq_src}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    [line] = errors(r.stderr)
    assert str(pq_src) in line and "pip install pyarrow" in line
    r = gen(f"model.path={sft_dir}", f"data.path={src}", f"data.output_path={tmp_path / 'out.parquet'}",
            "rollout.response_length=3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (tmp_path / "out.parquet").exists()
    assert any(ln.startswith("note: pyarrow is not installed") and str(tmp_path / "out.jsonl") in ln
               for ln in r.stderr.splitlines())
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == len(QUESTIONS)
