"""Supervised stages before RL: the warm start (SFT), preference data and the reward model."""
