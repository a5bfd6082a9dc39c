"""A failure for bench/failure_zoo.py: the reference is another model than the one the policy starts from.

    python bench/zoo_wrongref.py OTHER_MODEL_DIR [train_ppo.py's arguments]

nanokl, like verl, loads the reference from actor_rollout_ref.model.path, the policy's own start, so no
key points it elsewhere. The mistake this stands for is a run whose start is not its anchor: a policy
resumed from an RL checkpoint against the SFT it left, or an SFT retrained after the reference was
chosen. The wrapper runs train_ppo.py with the reference's weights replaced by OTHER_MODEL_DIR's before
any step, and so before the reference check records its probe: to that check, the reference stays put.
"""

import runpy
import sys
from pathlib import Path

import torch

import nanokl.harness.run as run

ROOT = Path(__file__).resolve().parents[1]


def main():
    other, sys.argv = sys.argv[1], [str(ROOT / "train_ppo.py"), *sys.argv[2:]]
    load_models = run.load_models

    def swapped(cfg, *args, **kwargs):
        models = load_models(cfg, *args, **kwargs)
        theirs = run.from_pretrained(other, device=next(models["ref"].parameters()).device).state_dict()
        ours = models["ref"].state_dict()
        if theirs.keys() != ours.keys() or any(theirs[k].shape != ours[k].shape for k in ours):
            sys.exit(f"zoo_wrongref: {other} is not shaped like {cfg.actor_rollout_ref.model.path}")
        with torch.no_grad():
            for k, v in ours.items():
                v.copy_(theirs[k])
        print(f"zoo_wrongref: the reference's weights are {other}'s", file=sys.stderr)
        return models

    run.load_models = swapped
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
