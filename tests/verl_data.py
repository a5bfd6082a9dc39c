"""Prompt rows as verl's preprocessing writes them, and files of rows: shared by tests/test_data.py,
test_tasks.py, test_reward_fn.py and test_verl_commands.py (nanokl reads such rows; it never writes them)."""

import json
import re
from pathlib import Path

from nanokl.harness.config.yaml_io import UserError
from nanokl.tasks.gsm8k import INSTRUCTION, SOURCE


def write_rows(path, rows) -> Path:
    """The tests' writer: rows (dicts) as a .jsonl or .parquet file that nanokl.harness.data's
    `read_rows` reads back (Parquet needs pyarrow)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"{path}: writing Parquet needs pyarrow (pip install pyarrow)") from None
        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    else:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def verl_row(question: str, answer: str, split: str, index: int) -> dict:
    """The tests' reference for verl's GSM8K preprocessing: raw GSM8K row -> the row verl's
    examples/data_preprocess/gsm8k.py writes (its `process_fn`): a one-message chat prompt with the
    instruction, the final answer as ground truth, extra_info."""
    found = re.search(r"#### (\-?[0-9\.\,]+)", answer)  # verl's extract_solution: the first `#### N`
    if found is None:
        raise UserError(f"GSM8K row {index} ({split}): the answer has no '#### <number>' final answer")
    return {"data_source": SOURCE, "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": found.group(1).replace(",", "")},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question}}
