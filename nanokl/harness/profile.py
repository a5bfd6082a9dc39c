"""Profiling chosen steps with torch.profiler, as verl users ask for it.

verl chooses the steps to profile with `global_profiler.steps` (global steps, from 1; the older
`trainer.profile_steps` before it) and records them with `global_profiler.tool` (nsys, npu, torch,
torch_memory) under `global_profiler.save_path`. nanokl records each chosen step with
torch.profiler, whatever the tool (nsys and npu need their own launchers; a start-up note says so):

    <save_path>/step<N>_prof_rank-<r>.json     a chrome trace of the whole global step N
                                               (rollout, scoring, forwards, updates, and the
                                               validation and checkpoint that follow it, as verl's
                                               step profile spans them); open it in
                                               chrome://tracing or ui.perfetto.dev
    stderr                                     a short summary: the step's timing_s/* phases and
                                               the top ops by self time (CPU, and CUDA on a GPU)

save_path defaults to <trainer.default_local_dir>/profile. CPU activity is always recorded, CUDA
activity too when the run is on a GPU. From the roles' own `profiler` sections
(actor_rollout_ref.{actor,ref,rollout}, critic, reward_model) nanokl takes which ranks record
(`all_ranks`, `ranks`; rank 0 when none says) and verl's torch `tool_config.torch.contents`
(`cpu`, `cuda`: which activities; `stack`, `shapes`, `memory`: with_stack, record_shapes,
profile_memory). nanokl's roles share one process per GPU, so one trace covers all of them; the
per-role switches (`enable`, `discrete`) have no counterpart and keep their start-up note
(notes.VERL_NOTES: with no step chosen nothing is recorded, as in verl), and config/notes.py's `profiler_notes` gives
one for a tool other than torch (nsys, npu, torch_memory: their options in global_tool_config
change nothing) and for `profile_continuous_steps` (one trace per step here).
A bad steps value stops the run at start-up in one line.

harness/run.py's `steps()` opens `StepProfiler.step(N)` around each global step, harness/after_step.py's
`end_step` shows it the step's metrics (`saw`), and `finish` closes a trace still open (a run stopped
mid-step).
"""

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from nanokl.harness.config.notes import chosen_steps

ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic", "reward_model")
TOP_OPS = 8  # ops listed in the summary, by self time


def _section(cfg, dotted):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, dict) else {}


def _role_profilers(cfg):
    return [(role, _section(cfg, f"{role}.profiler")) for role in ROLES]





def _flags(cfg, rank):
    """(whether this rank records, the torch.profiler contents) from the roles' profiler sections."""
    ranks, all_ranks, contents = set(), False, set()
    for _, p in _role_profilers(cfg):
        all_ranks |= bool(p.get("all_ranks"))
        ranks |= set(p.get("ranks") or [])
        torch_cfg = (p.get("tool_config") or {}).get("torch") or {}
        contents |= set(torch_cfg.get("contents") or [])
    return all_ranks or rank in (ranks or {0}), contents


class StepProfiler:
    """torch.profiler around each chosen global step of a run (the module docstring); a no-op otherwise."""

    def __init__(self, cfg, rank: int, device: torch.device, run_dir):
        self.steps, self.key = chosen_steps(cfg)
        here, self.contents = _flags(cfg, rank)
        self.steps = set(self.steps) if here else set()
        g = cfg.global_profiler if isinstance(cfg.global_profiler, dict) else {}
        self.save_path = Path(os.path.expanduser(g.get("save_path") or Path(run_dir) / "profile"))
        self.rank, self.device = rank, device
        self.prof, self.step_n, self.metrics, self.written = None, None, None, []

    def activities(self):
        c, cuda = self.contents, self.device.type == "cuda" and torch.cuda.is_available()
        acts = [torch.profiler.ProfilerActivity.CPU] if not c & {"cpu", "cuda"} or "cpu" in c else []
        if cuda and (not c & {"cpu", "cuda"} or "cuda" in c):
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return acts

    @contextmanager
    def step(self, n: int):
        """Global step `n` (from 1) runs inside; recorded when it is a chosen one."""
        if n not in self.steps:
            yield
            return
        self.save_path.mkdir(parents=True, exist_ok=True)
        self.prof = torch.profiler.profile(activities=self.activities(), with_stack="stack" in self.contents,
                                           record_shapes="shapes" in self.contents,
                                           profile_memory="memory" in self.contents)
        self.step_n, self.metrics = n, None
        self.prof.start()
        try:
            yield
        finally:
            self.close()

    def saw(self, metrics: dict):
        """The step's metrics (end_step): the summary reads its timing_s/* from them when the step ends."""
        if self.prof is not None:
            self.metrics = metrics

    def close(self):
        """Stop the open recording (if any), write its trace and print its summary."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        prof.stop()
        path = self.save_path / f"step{self.step_n}_prof_rank-{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)
        tqdm.write(summary(prof, self.step_n, self.rank, path, self.metrics or {}, self.key), file=sys.stderr)


def summary(prof, step, rank, path, metrics, key=None) -> str:
    """The few lines printed for a recorded step: where its trace went, its phases, its top ops."""
    phases = " | ".join(f"{k[len('timing_s/'):]} {v:.3f}" for k, v in metrics.items()
                        if k.startswith("timing_s/") and isinstance(v, (int, float)))
    lines = [f"profile: global step {step} (rank {rank}{', ' + key if key else ''}): trace {path} "
             "(chrome://tracing or ui.perfetto.dev)"]
    if phases:
        lines.append(f"  phases (s): {phases}")
    events = prof.key_averages()
    for label, attrs in (("CPU", ("self_cpu_time_total",)),
                         ("CUDA", ("self_device_time_total", "self_cuda_time_total"))):  # the latter: older torch
        timed = [(next((getattr(e, a) for a in attrs if hasattr(e, a)), 0) or 0, e.key) for e in events]
        total = sum(t for t, _ in timed)
        if total <= 0:
            continue
        top = sorted(timed, reverse=True)[:TOP_OPS]
        lines.append(f"  top ops by self {label} time (of {total / 1e3:.1f} ms): " +
                     ", ".join(f"{name} {t / 1e3:.1f} ms ({100 * t / total:.0f}%)" for t, name in top))
    return "\n".join(lines)
