"""The stages before RL that a config can ask for, run when their output is missing: the warm start
(supervised fine-tuning: the reference policy), the logged samples an offline run trains on, and the
reward model distilled from rankings. Rank 0 makes each, the others wait at a barrier.

train_ppo.py hands `train_missing_stages` to the harness's setup (nanokl/harness/run.py), which
calls it while the run holds its folder, before any model loads: the harness sits below the
supervised stages and imports none of them."""

import sys
from pathlib import Path

from nanokl.engine import dist
from nanokl.harness.hf_format import require_model_dir
from nanokl.supervised.reward_model import build_ranked_data
from nanokl.supervised.reward_model import train_from_config as train_reward_model
from nanokl.supervised.sft import train_sft
from nanokl.tasks import get_task


def train_missing_stages(cfg, rank):
    """The warm start (reference policy) and the reward model, when the config says how to make them."""
    model_path, rm_path = Path(cfg.actor_rollout_ref.model.path), cfg.reward_model.model.path
    if (not (model_path / "config.json").exists() and get_task(cfg.data.task).demonstrations is not None
            and model_path == Path(cfg.sft.output_dir)):
        if rank == 0:
            print(f"no reference policy at {model_path}: training the warm start first (nanokl.supervised.sft)",
                  file=sys.stderr)
            train_sft(cfg)
        dist.barrier()
    require_model_dir(model_path)
    ranked, offline = cfg.reward_model.train.data_path, cfg.data.offline_files
    if offline and ranked in offline and not Path(ranked).is_file():
        if rank == 0:  # the logged responses are the reward model's ranked warm-start samples: make them first
            print(f"no logged responses at {ranked}: sampling and ranking them from the warm start first "
                  "(nanokl.supervised.preference_data)", file=sys.stderr)
            build_ranked_data(cfg)
        dist.barrier()
    if cfg.reward_model.enable and not (Path(rm_path) / "config.json").exists() and cfg.reward_model.train.data_path:
        if rank == 0:  # the config says how to distil one from rankings: do it first, like the warm start
            print(f"no reward model at {rm_path}: training it from rankings first (nanokl.supervised.reward_model)",
                  file=sys.stderr)
            train_reward_model(cfg)
        dist.barrier()
