"""verl's data and trainer switches end to end on the tiny warm start: rows in verl's shape with no
data.task (each scored by its data_source), data.filter_overlong_prompts (the count said once,
checked against transformers' token counts), trainer.rollout_data_dir and validation_data_dir
(the files against the rule recomputed on their own text), trainer.log_val_generations (verl's
choice of samples, recomputed here from the full validation dump), and trainer.val_only; and the
gather behind the dumps over two gloo processes (each rank's rows, in rank order, one file)."""

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

import train_ppo
from nanokl.harness.tracking import read_metrics
from nanokl.tasks.arith import ArithDifficulty, arith_score, make_arith_task

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), "data.train_batch_size=8",
        "data.max_response_length=32", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.logger=[jsonl]", "trainer.save_freq=-1"]


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def write_verl_rows(path, examples):
    """The arithmetic problems as verl's preprocessing would write them: a chat prompt, a rule ground truth."""
    rows = [{"data_source": ex["data_source"], "prompt": [{"role": "user", "content": ex["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": ex["ground_truth"]}, "extra_info": {"index": i}}
            for i, ex in enumerate(examples)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_rows_filter_dumps_and_val_generations(sft_dir, tmp_path, capfd):
    train, val = make_arith_task(48, 12, seed=3, difficulty=ArithDifficulty(3, 20, "+-"))
    files = write_verl_rows(tmp_path / "train.jsonl", train), write_verl_rows(tmp_path / "val.jsonl", val)
    # filter_overlong_prompts is checked against transformers' own tokenizer of the model directory
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(str(sft_dir))
    length = {ex["prompt"]: len(hf(ex["prompt"], add_special_tokens=False)["input_ids"]) for ex in train + val}
    limit = sorted(length.values())[len(length) // 2]  # about half the prompts go
    run, dump, vdump = tmp_path / "run", tmp_path / "rollouts", tmp_path / "val_dump"
    train_ppo.main([*TINY, "data.task=null", f"data.train_files={files[0]}", f"data.val_files={files[1]}",
                    "data.return_raw_chat=false",  # the rows' chats as plain text: the prompts the warm start knows
                    "data.filter_overlong_prompts=true", f"data.max_prompt_length={limit}",
                    f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run}",
                    "trainer.total_training_steps=2", "trainer.test_freq=2", f"trainer.rollout_data_dir={dump}",
                    f"trainer.validation_data_dir={vdump}", "trainer.log_val_generations=3"])
    fits = {prompt for prompt, n in length.items() if n <= limit}
    kept_train, kept_val = [ex for ex in train if ex["prompt"] in fits], [ex for ex in val if ex["prompt"] in fits]
    assert 8 <= len(kept_train) < len(train)
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("data.filter_overlong_prompts")]
    assert said == [f"data.filter_overlong_prompts: dropped {len(train) - len(kept_train)} of {len(train)} training "
                    f"prompts longer than {limit} tokens",
                    f"data.filter_overlong_prompts: dropped {len(val) - len(kept_val)} of {len(val)} validation "
                    f"prompts longer than {limit} tokens"]
    # rollout_data_dir: one file per step, a line per response, each score the rule's verdict on that line's text
    truth = {ex["prompt"]: ex["ground_truth"] for ex in train}
    for step in (1, 2):
        lines = jsonl(dump / f"{step}.jsonl")
        assert len(lines) == 8 and {r["step"] for r in lines} == {step}
        for r in lines:
            assert r["input"] in fits and r["gts"] == truth[r["input"]]
            assert r["score"] == arith_score(r["output"], r["gts"])
    assert sorted(p.name for p in dump.iterdir()) == ["1.jsonl", "2.jsonl"]
    # validation: data_source names the metric; validation_data_dir holds every response of each validation
    rows = read_metrics(run)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2]
    for step in (0, 2):
        full = jsonl(vdump / f"{step}.jsonl")
        assert sorted(r["input"] for r in full) == sorted(ex["prompt"] for ex in kept_val)
        assert all(r["score"] == arith_score(r["output"], r["gts"]) for r in full)
        row = next(r for r in rows if r["training/global_step"] == step)
        assert row["val-core/arith/acc/mean@1"] == pytest.approx(np.mean([r["score"] for r in full]))
        # log_val_generations: verl's pick (sort by input, shuffle with seed 42, first 3), made here from the dump
        samples = sorted(((r["input"], r["output"], r["score"]) for r in full), key=lambda s: s[0])
        np.random.RandomState(42).shuffle(samples)
        logged = [(g["input"], g["output"], g["score"]) for g in jsonl(run / "val_generations.jsonl")
                  if g["step"] == step]
        assert logged == samples[:3]
    assert all("input" not in r for r in rows)  # metrics.jsonl stays numbers: the samples live beside it


def test_val_only_validates_once_and_stops(sft_dir, tmp_path):
    run = tmp_path / "run"
    train_ppo.main([*TINY, "data.num_train=16", "data.num_val=8", f"actor_rollout_ref.model.path={sft_dir}",
                    f"trainer.default_local_dir={run}", "trainer.val_only=true", "trainer.val_before_train=false",
                    "trainer.log_val_generations=2", "trainer.total_training_steps=5"])
    rows = read_metrics(run)
    assert [r["training/global_step"] for r in rows] == [0] and "val-core/arith/acc/mean@1" in rows[0]
    assert not any(k.startswith("actor/") for k in rows[0])  # no training step ran
    assert not (run / "checkpoints").exists() and not any(run.glob("global_step_*"))
    assert [g["step"] for g in jsonl(run / "val_generations.jsonl")] == [0, 0]


def _dump_from(rank, world, port, out_dir):
    from nanokl.harness.generations import dump_rollout
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    n = rank + 1  # ranks hold different numbers of rows
    dump_rollout(out_dir, 5, [f"in{rank}.{i}" for i in range(n)], [f"out{rank}.{i}" for i in range(n)],
                 [str(rank)] * n, [float(rank + i) for i in range(n)])
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_two_processes_write_one_file_in_rank_order(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_dump_from, args=(2, port, str(tmp_path)), nprocs=2)
    assert jsonl(tmp_path / "5.jsonl") == [
        {"input": "in0.0", "output": "out0.0", "gts": "0", "score": 0.0, "step": 5},
        {"input": "in1.0", "output": "out1.0", "gts": "1", "score": 1.0, "step": 5},
        {"input": "in1.1", "output": "out1.1", "gts": "1", "score": 2.0, "step": 5}]
