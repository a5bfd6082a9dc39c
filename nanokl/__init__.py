"""nanokl: KL-regularized PPO for RLHF of language models, small enough to read as a course.

The lesson is the modules of this package, read in README's course order, in which each imports
only torch and the modules before it: attention -> model -> kl -> kl_ctrl -> masked -> rewards ->
advantages -> ppo -> rollout (-> graphs, fused: speed) -> batching -> dist -> forwards -> workers ->
offline -> dpo, then train_ppo.py, the step that ties them together. nanokl.harness makes it run for
real (config, data, checkpoints, logging, scoring, the KL monitor, the run around the step);
nanokl.tasks holds the tasks and nanokl.supervised the warm start and the reward model. README.md
has the full reading list.
"""

__version__ = "0.1.0"
