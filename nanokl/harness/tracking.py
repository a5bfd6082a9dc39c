"""Where the numbers go: metrics.jsonl, a compact console line, and optional TensorBoard / W&B.

Every PPO step produces a flat dict of floats under verl's metric names (`actor/ppo_kl`,
`critic/score/mean`, `timing_s/gen`, ...). `Tracker` appends it as one JSON object per line to
`<run dir>/metrics.jsonl` (with `training/global_step`), the file that nanokl/harness/plot.py, the tests
and the README's numbers read; prints a one-line summary through tqdm so the progress bar stays
intact; and forwards it to TensorBoard or Weights & Biases only when the package is installed and
`trainer.logger` asks for it (verl's `Tracking` does the same with more backends).

A resumed run redoes the steps after its checkpoint, which a crashed run may already have logged.
Before it appends, the tracker drops those rows (`drop_rows_after`: a new file renamed over the
old, so a crash while it does so leaves one or the other), and metrics.jsonl holds each step once.
"""

import json
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

# (metric, label, format) of the console line: the few numbers a KL-regularised run is read by
CONSOLE = [
    ("critic/score/mean", "score", "{:.3f}"),
    ("val-core/acc", "val", "{:.3f}"),
    ("actor/reward_kl_penalty", "kl", "{:.4f}"),
    ("actor/reward_kl_penalty_coeff", "beta", "{:.2e}"),
    ("actor/kl_loss", "kl_loss", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("monitor/health", "health", "{}"),
    ("timing_s/step", "s", "{:.2f}"),
]


def console_line(step, metrics: dict) -> str:
    parts = [f"step {step:>4}"]
    for key, label, fmt in CONSOLE:
        if key == "val-core/acc":  # any data source's validation accuracy
            vals = [v for k, v in metrics.items() if k.startswith("val-core/") and k.endswith("/acc/mean@1")]
            if vals:
                parts.append(f"{label} " + "/".join(fmt.format(v) for v in vals))
        elif key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


def drop_rows_after(path, step: int) -> int:
    """Keep only the rows of metrics.jsonl logged for global steps <= `step` (and drop a last line cut
    by a crash mid-write); returns how many rows went. Atomic: the kept rows are written to a new
    file, synced, and renamed over the old one."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if row.get("training/global_step", 0) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class Tracker:
    def __init__(self, run_dir, backends=("console", "jsonl"), config: dict | None = None, enabled=True,
                 project="nanokl", experiment="default", resume_step: int | None = None):
        self.enabled, self.backends = enabled, set(backends)
        self.file = self.tb = self.wandb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:  # the steps after the checkpoint are about to be logged again
            dropped = drop_rows_after(run_dir / "metrics.jsonl", resume_step)
            if dropped:
                print(f"tracking: dropped {dropped} row(s) of metrics.jsonl logged after step {resume_step}, "
                      "which this run redoes", file=sys.stderr)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                print("tracking: tensorboard is not installed; skipping it", file=sys.stderr)
        if "wandb" in self.backends:
            try:
                import wandb
                self.wandb = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir))
            except ImportError:
                print("tracking: wandb is not installed; skipping it", file=sys.stderr)

    def log(self, metrics: dict, step: int):
        if not self.enabled:
            return
        row = {"training/global_step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()  # a crash loses no logged step
        if "console" in self.backends:
            tqdm.write(console_line(step, metrics), file=sys.stderr)
        for k, v in row.items():
            if self.tb is not None and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def close(self):
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the fact readable
    return v


def read_metrics(run_dir) -> list[dict]:
    """All rows of a run's metrics.jsonl, the rows of one step merged (validation logs its own row)."""
    rows = {}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[row["training/global_step"]] = {**rows.get(row["training/global_step"], {}), **row}
    return [rows[k] for k in sorted(rows)]
