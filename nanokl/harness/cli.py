"""train_ppo.py's command line: every way a run ends, as one exit status and at most one line.

    0    the run ended: its last step, a monitor stop, a preemption signal (SIGTERM / SIGUSR1)
    1    a stop that is not the user's input: a failing reward function, repeated non-finite
         steps (TrainingStopped, said by rank 0 as `error: ...`)
    2    a mistake in what the user gave (config, paths, data): `error: ...` (UserError, run_cli)
    130  Ctrl-C: after the step it finishes and its checkpoint, or at once outside the steps

The process group is torn down after `main` returned, so its DDP/FSDP models are released first.
tests/test_faults.py and tests/test_bad_input.py drive it as a user types it.
"""

import sys

from nanokl.engine import dist
from nanokl.harness.config.yaml_io import run_cli
from nanokl.harness.faults import INTERRUPTED
from nanokl.harness.run_state import TrainingStopped


def cli(main):
    """Run `main()` (train_ppo.main) and exit with its status (the table above)."""
    status = 0
    try:
        status = run_cli(main) or 0
    except TrainingStopped as e:  # every rank stops; one says why
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:  # Ctrl-C outside the steps (setup, the first validation): no step to finish
        if dist.rank() == 0:
            print("error: interrupted (Ctrl-C) outside the training steps: no step was running", file=sys.stderr)
        status = INTERRUPTED
    dist.destroy()  # after main returned, so its DDP/FSDP models are already released
    sys.exit(status)
