"""verl's main_eval habit (issue 48 item 5): `python -m nanokl.harness.main_eval data.path=<generate.py's
data.output_path>` scores each row's `responses` against reward_model.ground_truth by data_source (or a
custom_reward_function) and prints test_score/<data_source>: the mean over rows of each row's mean score."""

import json
import sys

import pytest

from test_cluster import ROOT, errors, launch
from test_generate_verl import GENERATE, verl_rows
from verl_data import write_rows


def main_eval(*argv):
    import subprocess, os
    return subprocess.run([sys.executable, "-m", "nanokl.harness.main_eval", *map(str, argv)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.parametrize("suffix", [".jsonl", pytest.param(".parquet", marks=pytest.mark.slow)])
def test_generate_then_main_eval_scores_by_data_source(sft_dir, tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    from nanokl.tasks import arith
    src = write_rows(tmp_path / f"test{suffix}", verl_rows())
    out = tmp_path / f"gen{suffix}"
    r = launch([f"model.path={sft_dir}", f"data.path={src}", "data.n_samples=4", f"data.output_path={out}",
                "rollout.temperature=0.5", "rollout.response_length=12", "--device", "cpu"], script=GENERATE)
    assert r.returncode == 0, r.stderr[-2000:]
    e = main_eval(f"data.path={out}", "ray_init.num_cpus=4")
    assert e.returncode == 0, e.stderr[-2000:]
    rows = [json.loads(ln) for ln in out.read_text().splitlines()] if suffix == ".jsonl" else \
        __import__("pyarrow.parquet").parquet.read_table(out).to_pylist()
    per_row = [sum(arith.score(t, {"ground_truth": row["reward_model"]["ground_truth"]}) for t in row["responses"])
               / len(row["responses"]) for row in rows]
    want = sum(per_row) / len(per_row)
    [line] = [ln for ln in e.stdout.splitlines() if ln.startswith("test_score/")]
    name, value = line.split(": ")
    assert name == "test_score/arith" and float(value) == pytest.approx(want, abs=1e-5)


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_custom_function_and_one_line_errors(tmp_path):
    rows = [{"data_source": "mine", "reward_model": {"ground_truth": "a"}, "responses": ["a", "b"]},
            {"data_source": "mine", "reward_model": {"ground_truth": "b"}, "responses": ["b", "b"]},
            {"data_source": "other", "reward_model": {"ground_truth": "x"}, "responses": ["y"]}]
    gen = write_rows(tmp_path / "gen.jsonl", rows)
    fn = tmp_path / "rf.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return {'score': float(solution_str == ground_truth)}\n")
    e = main_eval(f"data.path={gen}", f"custom_reward_function.path={fn}")
    assert e.returncode == 0, e.stderr
    assert e.stdout.splitlines() == ["test_score/mine: 0.75", "test_score/other: 0"]
    bad = write_rows(tmp_path / "bad.jsonl", [{"data_source": "arith", "reward_model": {"ground_truth": "1"}}])
    for argv, named in [([f"data.path={bad}"], f"{bad}:1"), ([f"data.path={gen}"], "'mine'"),
                        ([f"data.path={tmp_path / 'absent.parquet'}"], "absent.parquet"),
                        ([f"data.path={gen}", "data.bogus=1"], "data.bogus"), ([], "data.path")]:
        e = main_eval(*argv)
        assert e.returncode == 2 and "Traceback" not in e.stderr, (argv, e.stderr)
        assert len(errors(e.stderr)) == 1 and named in errors(e.stderr)[0], (argv, e.stderr)
