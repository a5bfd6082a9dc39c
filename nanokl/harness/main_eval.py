"""verl's main_eval: score a generation file's responses by data_source, as `verl.trainer.main_eval` does.

    python generate.py model.path=DIR data.path=test.parquet data.n_samples=4 data.output_path=gen.parquet
    python -m nanokl.harness.main_eval data.path=gen.parquet

Reads the file generate.py's data.output_path wrote (verl's main_generation shape: each source row plus a
`responses` list), Parquet, JSONL or JSON (nanokl/tasks/rows.py's `read_rows`). Each response is scored
against the row's `reward_model.ground_truth` by the rule its data_source names (nanokl/tasks/by_source.py,
verl's default_compute_score; strict GSM8K), or by `custom_reward_function.path` / `.name` (default
compute_score), called as verl's main_eval calls it: fn(data_source, solution_str, ground_truth, extra_info);
a dict's "score" is the reward. As verl: a row's reward is the mean over its responses, and
`test_score/<data_source>` the mean over that source's rows; one line each is printed (and a dict returned).

verl's evaluation.yaml keys: data.path, data.response_key (responses), data.data_source_key (data_source),
data.reward_model_key (reward_model), custom_reward_function.path, custom_reward_function.name;
ray_init.num_cpus is noted (no effect). Any other key, a missing file, a row without its fields, an unknown
data_source: one line, exit 2.
"""

import sys
from pathlib import Path

from nanokl.harness.config.yaml_io import ConfigError, UserError, parse_override, run_cli
from nanokl.tasks.rows import DataError, read_rows

KEYS = {"data.path": None, "data.response_key": "responses", "data.data_source_key": "data_source",
        "data.reward_model_key": "reward_model", "custom_reward_function.path": None,
        "custom_reward_function.name": "compute_score"}
NOTED = ("ray_init.num_cpus", "ray_kwargs.ray_init.num_cpus")


def parse(argv) -> dict:
    values = dict(KEYS)
    for arg in argv:
        try:
            _, parts, value = parse_override(arg)
        except ConfigError as e:
            raise UserError(str(e)) from None
        key = ".".join(parts)
        if key in NOTED:
            print(f"note: {key}: nanokl scores in this one process (no effect on the scores)", file=sys.stderr)
            continue
        if key not in KEYS:
            raise UserError(f"{arg}: not a key of verl's main_eval (keys: {', '.join(KEYS)})")
        if value is not None and not isinstance(value, str):
            raise UserError(f"{key}={value!r}: must be a string")
        values[key] = value
    if not values["data.path"]:
        raise UserError("no file to score: give data.path=<the generation output (.parquet or .jsonl)>")
    return values


def main(argv=None) -> dict:
    from nanokl.harness.reward_fn import Reward, RewardError, call, load_custom, reward_value
    from nanokl.tasks.by_source import source_task
    c = parse(sys.argv[1:] if argv is None else list(argv))
    path = Path(c["data.path"])
    if not path.is_file():
        raise UserError(f"data.path={path}: no such file")
    if c["custom_reward_function.path"]:  # verl's main_eval call: (data_source, solution_str, ground_truth, extra_info)
        fn = load_custom(c["custom_reward_function.path"], c["custom_reward_function.name"])

        def score(text, ex):
            return fn(ex["data_source"], text, ex["ground_truth"], ex["extra_info"])
        score.what = f"custom_reward_function {c['custom_reward_function.name']} ({c['custom_reward_function.path']})"
    else:  # the rule of the row's data_source, as verl's default_compute_score
        def score(text, ex):
            task = source_task(ex["data_source"])
            if hasattr(task, "result"):
                return reward_value(task.result(text, ex, "strict"))
            return Reward(task.score(text, ex, "strict"))
        score.what = "the rule of the row's data_source"
    custom_path = c["custom_reward_function.path"]
    rk, sk, gk = c["data.response_key"], c["data.data_source_key"], c["data.reward_model_key"]
    by_source = {}
    for where, row in read_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be an object")
        responses, source, rm = row.get(rk), row.get(sk), row.get(gk)
        if not isinstance(responses, list) or not responses or not all(isinstance(r, str) for r in responses):
            raise DataError(f"{where}: field {rk!r} must be a non-empty list of response texts (generate.py "
                            "data.output_path writes it)")
        if not isinstance(source, str):
            raise DataError(f"{where}: field {sk!r} must be a string")
        if not isinstance(rm, dict) or not isinstance(rm.get("ground_truth"), (str, int)):
            raise DataError(f"{where}: field {gk!r} must hold a ground_truth")
        truth, extra = str(rm["ground_truth"]), row.get("extra_info") or {}
        ex = {"prompt": row.get("prompt"), "ground_truth": truth, "data_source": source, "extra_info": extra}
        source_task(source) if custom_path is None else None  # an unknown data_source: its one line
        scores = []
        for j, text in enumerate(responses):
            try:
                scores.append(float(call(score, text, ex, f"{where} response {j}")))
            except RewardError as e:
                raise UserError(str(e)) from None
        by_source.setdefault(source, []).append(sum(scores) / len(scores))
    if not by_source:
        raise DataError(f"{path}: no rows in the file")
    metrics = {f"test_score/{s}": sum(v) / len(v) for s, v in sorted(by_source.items())}
    for k, v in metrics.items():
        print(f"{k}: {v:.6g}")
    return metrics


if __name__ == "__main__":
    run_cli(main)
