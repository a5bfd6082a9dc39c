"""train_ppo.py's command line: every way a run ends, as one exit status and at most one line.

    0    the run ended: its last step, a monitor stop, a preemption signal (SIGTERM / SIGUSR1 / SIGHUP)
    1    a stop that is not the user's input: a failing reward function, repeated non-finite
         steps (TrainingStopped, said by rank 0 as `error: ...`), a collective that waited
         actor_rollout_ref.nccl_timeout for a hung rank (said by the rank that waited)
    2    a mistake in what the user gave (config, paths, data): `error: ...` (UserError, run_cli)
    130  Ctrl-C: after the step it finishes and its checkpoint, or at once outside the steps

A write the file system refuses outside a checkpoint (summary.json into a folder made read-only
meanwhile, a full disk, a quota) is a stop that is not the user's input too: exit 1, one line naming
the file and its folder (a refused checkpoint says so in its own words: TrainingStopped), and the
folder's lock released. A console that nobody reads any more (a `| head`, a closed terminal) stops
nothing: the run goes on and exits as it would have (nanokl/harness/streams.py).

The process group is torn down after `main` returned, so its DDP/FSDP models are released first.
tests/test_faults.py and tests/test_bad_input.py drive it as a user types it.
"""

import errno
import os
import sys
from pathlib import Path

from nanokl.engine import dist
from nanokl.harness.config.yaml_io import run_cli
from nanokl.harness.faults import INTERRUPTED
from nanokl.harness.run_state import TrainingStopped, release_all
from nanokl.harness.streams import guard

REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}  # the file system said no


def cli(main):
    """Run `main()` (train_ppo.main) and exit with its status (the table above)."""
    guard()  # first: stdout and stderr outlive their reader (nanokl/harness/streams.py)
    status = 0
    try:
        status = run_cli(main) or 0
    except TrainingStopped as e:  # every rank stops; one says why
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        status = 1
    except OSError as e:  # a bug's OSError (a missing file) keeps its traceback
        if e.errno not in REFUSED:
            raise
        print(f"error: {refused(e)}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:  # Ctrl-C outside the steps (setup, the first validation): no step to finish
        if dist.rank() == 0:
            print("error: interrupted (Ctrl-C) outside the training steps: no step was running", file=sys.stderr)
        status = INTERRUPTED
    except RuntimeError as e:
        if not dist.timed_out(e):
            raise
        # a peer hung or died mid-collective: the group is broken, so no teardown that would wait on it
        print(f"error: rank {dist.rank()} waited actor_rollout_ref.nccl_timeout={dist.TIMEOUT_S[0]:g} s for the "
              "other ranks in a collective and stopped: a rank hung, died or fell that far behind (its own log "
              "says which); the same command resumes from the newest checkpoint", file=sys.stderr)
        sys.exit(1)
    release_all()  # a run that stopped before its finish: the folder is free for the next one
    dist.destroy()  # after main returned, so its DDP/FSDP models are already released
    sys.exit(status)


def refused(e: OSError) -> str:
    """A refused write in one line: the folder, the file (a rename: both names), the reason."""
    if not e.filename:
        return f"a write failed ({e.strerror}); the run stopped there"
    path = Path(os.fsdecode(e.filename))
    what = f"{path.name} -> {Path(os.fsdecode(e.filename2)).name}" if e.filename2 else path.name
    return f"{path.parent}: cannot write {what} ({e.strerror}); the run stopped there"
