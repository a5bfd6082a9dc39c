"""nanokl: KL-regularized PPO for RLHF of language models, small enough to read as a course.

Read the modules in this order (README.md has the full reading list):
config -> model -> tokenizer -> kl -> kl_ctrl -> gae -> ppo -> rollout -> train_ppo.py.
"""

__version__ = "0.1.0"
