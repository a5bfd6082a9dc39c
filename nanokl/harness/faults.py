"""Faults a long run must survive: preemption signals, a full disk, and test-only fault injection.

A run on shared GPUs is stopped by its scheduler, loses a rank, or fills its disk. What nanokl
promises (the rest of the story is in nanokl/harness/checkpoint.py and run.py):

Preemption. SLURM and Kubernetes send SIGTERM (SLURM's `--signal` often SIGUSR1) some time before
SIGKILL; a closed terminal sends SIGHUP. `catch_preemption` turns any of them into a flag instead of
death; the run finishes the step it is in, writes a checkpoint, says so, and exits with status 0.
Rerunning the same command resumes from that checkpoint (trainer.resume_mode=auto) and ends
bit-identical to a run that was never stopped: no work is lost. Under torchrun the signal may reach
the ranks at different moments, so after every step they agree on it with one all-reduce (max) of
the flag: all stop after the same step, or none does. Ctrl-C (SIGINT) takes the same path (the step
finishes, a checkpoint is written) and ends with status 130, the shell's code for an interrupt, where
a KeyboardInterrupt would lose the step.

Signals come in pairs. `scancel` signals every process of the job and torchrun's agent forwards the
one it got to its workers, so a worker sees SIGTERM twice within milliseconds; a Ctrl-C in a
terminal reaches torchrun and its workers alike (the terminal signals the whole foreground process
group), and the agent forwards it again. A repeat is therefore not impatience: within
trainer.signal_grace_s seconds of the first signal (30 by default) it is counted and the save goes on.
Two repeats kill at once: a second Ctrl-C typed into the terminal this process reads from (SIGINT
while it is the terminal's foreground group, at least ECHO_S after the first: a forwarded copy comes
sooner), and any signal after the grace window (the save is stuck, the user means it).
A crashed rank. torchrun --max-restarts=N restarts every process of the job when one dies; each
resumes from the newest checkpoint that verifies. Work since that checkpoint is redone, and
metrics.jsonl drops the rows logged after it (nanokl/harness/tracking.py).

A full disk. A checkpoint is written only when the free space covers its estimated size
(`checkpoint_bytes`: every tensor's bytes); a write that fails anyway (ENOSPC, a quota, safetensors'
SafetensorError wrapping either) removes its temporary directory, leaves the previous checkpoint
untouched, and ends the run with one line naming the directory and the bytes it needed. An output
folder that cannot be written at all (read-only, a path through a file) is one line before anything
runs (`check_writable`).

Fault injection (tests only). NANOKL_FAULT="kind@step[:rank]" fires at the start of global step
`step` on rank `rank` (default 0), only in the first attempt of a torchrun job (so a restarted
job runs clean): `sigterm` / `sigusr1` / `sigint` / `sighup` / `sigkill` send that signal to the process itself, `crash`
ends it at once with os._exit(13), as a segfault would, `scancel` sends SIGTERM to the process and, under
torchrun, to its agent (which forwards it: each worker then sees two), `hang` sleeps for ever (a frozen rank). Several faults: separate
them with commas. tests/test_faults.py uses it.
"""

import contextlib
import errno
import os
import signal
import tempfile
import time
from pathlib import Path

import torch

from nanokl.engine import dist
from nanokl.harness.config.yaml_io import UserError

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}
INTERRUPTED = 130  # the exit status after Ctrl-C (128 + SIGINT), once the step is finished and saved
ECHO_S = 1.0  # a forwarded copy of a signal (torchrun's agent, scancel's fan-out) arrives within this


class Preemption:
    """Which preemption signal arrived first (None: none yet), when, and how many came after it."""

    def __init__(self):
        self.signal, self.at, self.repeats = None, None, 0

    def requested(self) -> bool:
        """Did any rank receive a signal? A collective under torchrun: every rank calls it after every step."""
        mine = float(self.signal is not None)
        return (dist.all_reduce(torch.tensor(mine), op="max").item() if dist.world() > 1 else mine) > 0


def typed_at_terminal() -> bool:
    """Could a SIGINT have come from a Ctrl-C typed at this process's terminal: is stdin a terminal whose
    foreground process group is ours?"""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def kills_now(first_at, now, signum, grace_s, terminal) -> bool:
    """Does a repeated signal (the first came at `first_at`) kill at once? After the grace window, yes; a
    Ctrl-C typed at the terminal (`terminal`), yes once an echo would have come; any other repeat, no."""
    waited = now - first_at
    return waited > grace_s or (signum == signal.SIGINT and terminal and waited >= ECHO_S)


@contextlib.contextmanager
def catch_preemption(grace_s=30.0):
    """SIGTERM / SIGUSR1 / SIGINT / SIGHUP -> a flag on the yielded Preemption, while the block runs; then
    the old handlers. A repeat kills at once only as `kills_now` says (restoring the default handler and
    re-sending itself); otherwise it is counted and the save goes on."""
    flag = Preemption()

    def handler(signum, frame):
        now = time.monotonic()
        if flag.signal is None:
            flag.signal, flag.at = signal.Signals(signum).name, now
            return
        if kills_now(flag.at, now, signum, grace_s, typed_at_terminal()):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        flag.repeats += 1

    try:
        old = {s: signal.signal(s, handler) for s in SIGNALS.values()}
    except ValueError:  # not the main thread (train_ppo.main called from a thread): no handlers to install
        old = {}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


KINDS = ("sigterm", "sigusr1", "sigint", "sighup", "sigkill", "crash", "scancel", "hang")


def parse_faults(spec: str) -> list[tuple[str, int, int]]:
    """"sigterm@3,crash@5:1" -> [("sigterm", 3, 0), ("crash", 5, 1)]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, where = part.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"NANOKL_FAULT: cannot read {part!r} (kind@step[:rank], kind {'|'.join(KINDS)})")
        out.append((kind, int(step), int(rank or 0)))
    return out


def inject(step: int, rank: int):
    """Fire the faults NANOKL_FAULT schedules for this step and rank (test-only; a no-op when unset)."""
    spec = os.environ.get("NANOKL_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    for kind, at, who in parse_faults(spec):
        if at == step and who == rank:
            if kind == "crash":
                os._exit(13)
            if kind == "hang":  # frozen, but torchrun's SIGTERM still ends it (a real hang waits for its SIGKILL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                while True:
                    time.sleep(3600)
            if kind == "scancel":
                if os.environ.get("TORCHELASTIC_RUN_ID"):  # the agent: it forwards SIGTERM to every worker
                    os.kill(os.getppid(), signal.SIGTERM)
                kind = "sigterm"
            os.kill(os.getpid(), getattr(signal, kind.upper()))


def check_writable(folder, what: str) -> None:
    """A one-line UserError, before anything runs, when files cannot be written into `folder` (`what`
    names the setting that chose it): a read-only file system or folder, a path through a regular file.
    Creates nothing: a test file is made and removed in the folder, or, while it does not exist yet, in its
    nearest existing parent (where it would be created)."""
    folder = Path(folder)
    there = folder
    while not there.exists() and there != there.parent:
        there = there.parent
    try:
        if not there.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        fd, probe = tempfile.mkstemp(prefix=".nanokl_write_check_", dir=there)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = (e.strerror or str(e)) + ("" if there == folder else f": {there}")
        raise UserError(f"{what}={folder}: cannot write there ({why})") from None


def checkpoint_bytes(*trees) -> int:
    """The bytes of the tensors in nested dicts / lists / tuples (modules: their state dicts), each
    tensor once (tied weights share one): what a checkpoint of them writes, less the small headers
    of safetensors and torch.save and the config and tokenizer files."""
    total, seen = 0, set()
    stack = list(trees)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.nn.Module):
            x = x.state_dict()
        if isinstance(x, torch.Tensor):
            key = (x.device, x.data_ptr(), x.numel(), x.dtype) if x.numel() else id(x)
            if key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total
