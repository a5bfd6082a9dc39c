"""Where the numbers go: metrics.jsonl, a compact console line, and optional TensorBoard / W&B.

Every PPO step produces a flat dict of floats under verl's metric names (`actor/ppo_kl`,
`critic/score/mean`, `timing_s/gen`, ...). `Tracker` appends it as one JSON object per line to
`<run dir>/metrics.jsonl` (with `training/global_step`), the file that nanokl/harness/plot.py, the tests
and the README's numbers read; prints a line per step through tqdm so the progress bar stays intact;
and forwards it to the trackers `trainer.logger` names, verl's backends (verl/utils/tracking.py `Tracking`):
- `tensorboard`: events in `$TENSORBOARD_DIR` if set, else `tensorboard_log/{project_name}/{experiment_name}`
  (relative to the working directory), as verl's _TensorboardAdapter; a start-up line says where;
- `wandb`, `mlflow`, `swanlab`, `clearml`: through their package, each adapter a few lines (mlflow: experiment
  = project_name, run = experiment_name, `mlflow.log_metrics(step=)`; the tracking URI is mlflow's own choice,
  $MLFLOW_TRACKING_URI or ./mlruns; '@' in a name, which mlflow refuses, becomes '_at_');
- `file`: verl's FileLogger, a JSON line `{"step": N, "data": {...}}` a step, to `$VERL_FILE_LOGGER_PATH` if
  set, else `{$VERL_FILE_LOGGER_ROOT or .}/{project_name}/{experiment_name}.jsonl`; a start-up line says where.
None of these packages is a dependency: a tracker whose package is absent is one line at start
("tracking: mlflow is not installed; skipping it") and the run goes on.

The console line, one per step (and one per validation row), under `console` in trainer.logger:
- verl's (`verl_console_line`), as verl's console logger prints it (verl/utils/logger/aggregate_logger.py
  `concat_dict_to_str`): `step:N - training/global_step:N - actor/pg_loss:-0.0123... - ...`, every
  numeric metric of the row in its order, each value as `pprint.pformat` writes it (repr: full
  precision; ints as ints, nan as nan), strings left out; on stdout, as verl prints it. That is what
  a verl command gets: `trainer.logger=console`, `['console','wandb']`, or no logger key at all;
- nanokl's short line (`console_line`: score, val, kl, beta, ..., seconds) on stderr, when the list
  also names nanokl's own `jsonl` (the CPU demo's `[console, jsonl]`, configs/*.yaml): the demo reads
  a handful of numbers per step, the full row is in metrics.jsonl.
Never both: verl's line holds every number of the short one.

Validation samples (trainer.log_val_generations; which ones: nanokl/harness/generations.py) are
text, not numbers, so they go beside metrics.jsonl, not into it: `log_generations` appends one
line per sample, {"step", "input", "output", "score"}, to `<run dir>/val_generations.jsonl`, and
keeps metrics.jsonl all numbers for the readers that expect it. W&B gets verl's table
`val/generations` (a row per validation: step, then input_i, output_i, score_i), TensorBoard
verl's text panel of the same name.

A resumed run redoes the steps after its checkpoint, which a crashed run may already have logged.
Before it appends, the tracker drops those rows (`drop_rows_after`: a new file renamed over the
old, so a crash while it does so leaves one or the other), and metrics.jsonl holds each step once;
val_generations.jsonl likewise. A run that starts over instead finds an earlier run's files already
set aside (metrics.1.jsonl, ...: harness/run_state.set_aside), and a step's row is logged before its
checkpoint commits (harness/after_step.py), so no checkpoint is without its row.
"""

import json
import math
import numbers
import os
import pprint
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


def verl_console_line(step, metrics: dict) -> str:
    """verl's console logger line (concat_dict_to_str): `step:{step}`, then `key:value` for each number of
    `metrics` in its order, the value as pprint.pformat writes it, joined by ' - '."""
    return " - ".join([f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" for k, v in metrics.items()
                                          if isinstance(v, numbers.Number)])


def console_style(backends) -> str | None:
    """Which console line trainer.logger asks for: "verl", "short" (with nanokl's jsonl too), or None."""
    backends = set(backends)
    return None if "console" not in backends else "short" if "jsonl" in backends else "verl"


def drop_rows_after(path, step: int, key: str = "training/global_step") -> int:
    """Keep only the rows of metrics.jsonl (or another JSONL whose rows say their step under `key`)
    logged for global steps <= `step` (and drop a last line cut by a crash mid-write); returns how
    many rows went. Atomic: the kept rows are written to a new file, synced, and renamed over the old one."""
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
            if row.get(key, 0) <= step:
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


GENERATIONS = "val_generations.jsonl"  # beside metrics.jsonl: validation samples, text (log_generations)


class Tracker:
    def __init__(self, run_dir, backends=("console", "jsonl"), config: dict | None = None, enabled=True,
                 project="nanokl", experiment="default", resume_step: int | None = None):
        self.enabled, self.backends = enabled, set(backends)
        self.console = console_style(self.backends)
        self.file = self.tb = self.wandb = self.generations = self.table = None
        self.others = []  # mlflow, swanlab, clearml, file: objects with log(row, step) and finish()
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        if resume_step is not None:  # the steps after the checkpoint are about to be logged again
            for name, key in (("metrics.jsonl", "training/global_step"), (GENERATIONS, "step")):
                dropped = drop_rows_after(run_dir / name, resume_step, key)
                if dropped:
                    print(f"tracking: dropped {dropped} row(s) of {name} logged after step {resume_step}, "
                          "which this run redoes", file=sys.stderr)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if "tensorboard" in self.backends:
            where = tensorboard_dir(project, experiment)
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(where)
                print(f"tracking: tensorboard events go to {where}", file=sys.stderr)
            except ImportError:
                print(f"tracking: tensorboard is not installed; skipping it (its events would go to {where})",
                      file=sys.stderr)
        for name, make in (("mlflow", _Mlflow), ("swanlab", _Swanlab), ("clearml", _ClearML), ("file", _File)):
            if name in self.backends:
                try:
                    self.others.append(make(project, experiment, config, resume_step))
                except ImportError:
                    print(f"tracking: {name} is not installed; skipping it", file=sys.stderr)
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
        if self.console == "verl":
            plain = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}  # nan stays nan
            tqdm.write(verl_console_line(step, {"training/global_step": step, **plain}), file=sys.stdout)
            sys.stdout.flush()
        elif self.console == "short":
            tqdm.write(console_line(step, metrics), file=sys.stderr)
        for k, v in row.items():
            if self.tb is not None and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        for other in self.others:
            other.log(row, step)

    def log_generations(self, samples, step: int):
        """Validation samples [(input, output, score), ...] of step `step` (the module docstring)."""
        if not self.enabled or not samples:
            return
        if self.generations is None:
            self.generations = open(self.run_dir / GENERATIONS, "a", encoding="utf-8")
        for inp, out, score in samples:
            row = {"step": step, "input": inp, "output": out, "score": _plain(score)}
            self.generations.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.generations.flush()
        if self.tb is not None:
            text = "".join(f"### Sample {i + 1}\n**Input:** {inp}\n\n**Output:** {out}\n\n**Score:** {score}\n\n---\n\n"
                           for i, (inp, out, score) in enumerate(samples))
            self.tb.add_text("val/generations", f"**Generation Results - Step {step}**\n\n" + text, step)
        if self.wandb is not None:
            import wandb
            columns = ["step"] + [f"{c}_{i + 1}" for i in range(len(samples)) for c in ("input", "output", "score")]
            # a new table holding the old rows each time: W&B shows only a table's first logged version otherwise
            self.table = wandb.Table(columns=columns, data=self.table.data if self.table is not None else None)
            self.table.add_data(step, *[x for sample in samples for x in sample])
            self.wandb.log({"val/generations": self.table}, step=step)

    def close(self):
        if self.file:
            self.file.close()
        if self.generations:
            self.generations.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        for other in self.others:
            other.finish()


def tensorboard_dir(project: str, experiment: str) -> str:
    """Where verl's _TensorboardAdapter writes: $TENSORBOARD_DIR, else tensorboard_log/{project}/{experiment}."""
    return os.environ.get("TENSORBOARD_DIR") or f"tensorboard_log/{project}/{experiment}"


def file_logger_path(project: str, experiment: str) -> str:
    """Where verl's FileLogger writes: $VERL_FILE_LOGGER_PATH, else {$VERL_FILE_LOGGER_ROOT or .}/{project}/{experiment}.jsonl."""
    root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
    return os.environ.get("VERL_FILE_LOGGER_PATH") or os.path.join(root, project, f"{experiment}.jsonl")


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class _File:
    """verl's `file` logger: {"step": N, "data": row} a line (a resumed run first drops the steps it redoes)."""

    def __init__(self, project, experiment, config, resume_step):
        self.path = Path(file_logger_path(project, experiment))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            drop_rows_after(self.path, resume_step, "step")
        self.f = open(self.path, "a")
        print(f"tracking: file logger writes to {self.path}", file=sys.stderr)

    def log(self, row, step):
        self.f.write(json.dumps({"step": step, "data": row}) + "\n")
        self.f.flush()

    def finish(self):
        self.f.close()


class _Mlflow:
    def __init__(self, project, experiment, config, resume_step):
        import mlflow
        self.mlflow = mlflow
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=experiment)

    def log(self, row, step):
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in _numbers(row).items()}, step=step)

    def finish(self):
        self.mlflow.end_run()


class _Swanlab:
    def __init__(self, project, experiment, config, resume_step):
        import swanlab
        self.swanlab = swanlab
        swanlab.init(project=project, experiment_name=experiment, config=config,
                     logdir=os.environ.get("SWANLAB_LOG_DIR", "swanlog"), mode=os.environ.get("SWANLAB_MODE", "cloud"))

    def log(self, row, step):
        self.swanlab.log(_numbers(row), step=step)

    def finish(self):
        self.swanlab.finish()


class _ClearML:
    def __init__(self, project, experiment, config, resume_step):
        import clearml
        self.task = clearml.Task.init(project_name=project, task_name=experiment, continue_last_task=True,
                                      output_uri=False)
        self.task.connect_configuration(config or {}, name="Hyperparameters")

    def log(self, row, step):
        logger = self.task.get_logger()
        for k, v in _numbers(row).items():
            title, _, series = k.partition("/")
            logger.report_scalar(title=title, series=series or title, value=v, iteration=step)

    def finish(self):
        self.task.close()


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
