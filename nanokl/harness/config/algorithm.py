"""The config's `algorithm` section: the advantage estimator, the KL in the reward and its controller, the
rollout correction (verl's TIS and rejection sampling) and DAPO's dynamic sampling, with verl's key names and
defaults. Split from config/schema.py (which nests it as Config.algorithm) to keep each file short; the
formulas these keys choose are taught in nanokl/advantages.py, kl.py, kl_ctrl.py, offline.py and
sampling.py."""

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from nanokl.harness.config.nanokl_keys import KLProbeConfig
from nanokl.harness.config.verl_keys import VerlAlgorithmKeys


@dataclass
class KLCtrlConfig:
    # fixed beta, or beta steered toward target_kl: adaptive (Ziegler's), or pi (nanokl-only: + an integral term)
    type: Literal["fixed", "adaptive", "pi"] = "fixed"
    kl_coef: float = 0.001  # beta: the (initial) weight of the KL penalty in the reward
    horizon: int = 10000  # adaptive, pi: responses over which beta may move by ~20%
    # adaptive, pi: per-token KL the controller steers toward; or a schedule [[fraction of training, target], ...]
    target_kl: Union[float, list[list[float]]] = 0.1
    target_kl_interp: Literal["step", "linear"] = "step"  # a schedule: piecewise constant, or linear between points
    ki: float = 0.3  # pi (nanokl-only): weight of the integral of the error in beta's rate (kl_ctrl.py)
    integral_limit: float = 1.0  # pi (nanokl-only): anti-windup, 0 <= integral <= this (in horizons x error)
    hold: int = 0  # adaptive, pi (nanokl-only): beta waits up to this many steps for the KL to first reach target


@dataclass
class RolloutCorrectionConfig:
    # verl's key, and verl's meaning: take pi_old's log-probs from the rollout instead of a forward of
    # the actor. verl's default is false; nanokl's "auto" turns it on only where the two are the same
    # numbers up to float error (the fp32 actor itself samples, on CPU, at the training temperature):
    # one forward fewer per step. forwards.rollout_log_probs_are_old states the rule.
    bypass_mode: Union[bool, Literal["auto"]] = "auto"  # true | false | auto
    # verl's truncated importance sampling (TIS): weigh each token's policy loss by min(pi_old / mu, threshold),
    # mu = the policy that sampled it (the rollout engine; offline, the logged behaviour policy). null: off
    # token: each token's own ratio; sequence: the response's whole product min(prod_t pi_old/mu, C) on every token
    rollout_is: Optional[Literal["token", "sequence"]] = None
    rollout_is_threshold: float = 2.0  # C, the truncation of those weights (>= 1)
    # verl's rejection sampling: tokens (or whole responses) whose log(pi_old/mu) statistic leaves its bounds
    # leave response_mask. Options of offline.RS_OPTIONS, comma-separated (e.g. "token_k1,seq_max_k2"); null: off
    rollout_rs: Optional[str] = None
    # their bounds: "upper" or "lower_upper" (k1), one for all options or one each, comma-separated (required with it)
    rollout_rs_threshold: Union[str, float, None] = None
    loss_type: Literal["ppo_clip"] = "ppo_clip"  # the policy loss the weights enter (verl's others refused)
    rollout_is_batch_normalize: bool = False  # refused when true


@dataclass
class FilterGroupsConfig:
    """verl's DAPO dynamic sampling (nanokl/sampling.py): train only on prompts whose responses' `metric`
    differs, sampling further batches of prompts until data.train_batch_size of them are kept."""
    enable: bool = False
    metric: Optional[str] = None  # acc (the rule's score, unshaped) | score (the reward) | seq_reward (its token sum)
    max_num_gen_batches: int = 0  # generation batches a step may sample; <= 0: no limit (verl's convention)


@dataclass
class AlgorithmConfig(VerlAlgorithmKeys):
    gamma: float = 1.0  # discount per token
    lam: float = 1.0  # GAE lambda: 0 one-step TD, 1 Monte-Carlo
    # advantages.ESTIMATORS: gae (critic); grpo, rloo, reinforce_plus_plus_baseline, grpo_passk (group baselines);
    # reinforce_plus_plus (whitened returns); remax (a greedy rollout's score as the baseline)
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's std (false: Dr. GRPO)
    use_kl_in_reward: bool = False  # subtract beta * KL(pi || pi_ref) from each token's reward
    kl_penalty: str = "kl"  # estimator for that in-reward KL (kl.KL_KINDS)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO's dynamic sampling
    kl_probe: KLProbeConfig = field(default_factory=KLProbeConfig)  # nanokl-only: the on-policy KL probe
