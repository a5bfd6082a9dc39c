"""What the policy wrote, kept for reading: trainer.rollout_data_dir and trainer.log_val_generations.

The idea
--------
The numbers say that a run goes wrong; the text says how: a format the rule does not read, a
phrase repeated to the length limit, an answer copied from the prompt. verl keeps two samples of
the text, and nanokl keeps the same two in the same shape:

- `trainer.rollout_data_dir`: every training step's prompts, responses and scores, one JSONL file
  per step, `<dir>/<step>.jsonl` (verl's RayPPOTrainer._dump_generations), one line per response:

      {"input": ..., "output": ..., "gts": ..., "score": ..., "step": ...}

  `input` is the prompt and `output` the response, decoded without padding or special tokens;
  `gts` the row's ground truth; `score` the response's reward before the KL penalty (what sits on
  its last token, missing-EOS penalty included); `step` the global step as metrics.jsonl counts it
  (the first step is 1).
- `trainer.log_val_generations = N`: at each validation, N (input, output, score) samples go to the
  tracker (nanokl/harness/tracking.py: `Tracker.log_generations`). Which N is verl's choice: sort
  every sample by its input, shuffle with a fixed seed (numpy's RandomState(42)), keep the first
  N, so that the same prompts are followed from one validation to the next.

Under torchrun each rank holds its slice of the prompts: rank 0 gathers the slices (in rank order,
which is batch order: rank r holds the r-th part of the step's batch) and writes.
tests/test_generations.py checks the files against the texts and scores the step computed.
"""

import json
from pathlib import Path

import numpy as np
import torch.distributed

from nanokl.engine import dist


def gather(items: list) -> list:
    """Every rank's `items`, concatenated in rank order (a collective: every rank calls it)."""
    if dist.world() == 1:
        return list(items)
    parts = [None] * dist.world()
    torch.distributed.all_gather_object(parts, list(items))
    return [x for part in parts for x in part]


def prompt_texts(tok, out) -> list[str]:
    """The prompt of each row of a rollout, decoded without its left padding or special tokens."""
    P = out.prompt_length
    return tok.batch_decode(out.sequences[:, :P], out.attention_mask[:, :P])


def dump_rollout(directory, step: int, inputs, outputs, gts, scores) -> Path | None:
    """Write `<directory>/<step>.jsonl` (rank 0, after gathering every rank's rows); returns its path."""
    rows = gather([{"input": i, "output": o, "gts": g, "score": s, "step": step}
                   for i, o, g, s in zip(inputs, outputs, gts, scores)])
    if dist.rank() != 0:
        return None
    path = Path(directory) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def pick_val_generations(samples, n: int) -> list[tuple]:
    """verl's `_maybe_log_val_generations` choice of (input, output, score) samples (any further
    fields are dropped): sorted by input, shuffled with seed 42, the first n."""
    samples = sorted((tuple(s[:3]) for s in samples), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]
