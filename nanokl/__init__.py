"""nanokl: KL-regularized PPO for RLHF of language models, small enough to read as a course.

The lesson is the modules of this package (they import only torch and each other), read in this
order: kl -> kl_ctrl -> masked -> advantages -> ppo -> rollout -> workers (batching, dist) ->
train_ppo.py -> model. nanokl.harness makes it run for real (config, data, checkpoints, logging,
scoring, the KL monitor, the run around the step); nanokl.tasks holds the tasks and
nanokl.supervised the warm start and the reward model. README.md has the full reading list.
"""

__version__ = "0.1.0"
