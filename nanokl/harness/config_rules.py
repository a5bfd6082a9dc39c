"""Derived defaults and impossible values: the two passes that follow loading a config.

`resolve` fills every key whose None means "derived from another key" (verl writes these as
`${...}` interpolations, e.g. `clip_ratio_low: ${clip_ratio}`), once, at load time, so the
training code reads `actor.clip_ratio_low` and never re-derives it. `validate` then rejects
values that are wrong in *every* run (not merely unusual): an infinite or NaN float anywhere,
non-positive sizes, ratios outside their ranges, mini-batches that do not divide the batch, GRPO
with one sample per prompt, ...
Each rejection is a one-line `ConfigError` naming the dotted key (config_io adds the file and
line that set it). tests/test_config.py checks every rule against a config that breaks it.
"""

import dataclasses
import difflib
import functools
import math

from nanokl.harness.config_io import ConfigError
from nanokl.harness.monitor import CHECKS, KNOBS


def resolve(cfg):
    """Fill every None-means-derived key from the key it derives from (in place; idempotent)."""
    data, arr, critic = cfg.data, cfg.actor_rollout_ref, cfg.critic
    actor, rollout = arr.actor, arr.rollout
    data.seed = _or(data.seed, cfg.trainer.seed)
    data.val_batch_size = _or(data.val_batch_size, data.train_batch_size)
    data.train_files, data.val_files = _file_list(data.train_files), _file_list(data.val_files)
    data.offline_files = _file_list(data.offline_files)
    arr.model.path = arr.model.path or cfg.sft.output_dir  # "" counts as unset for paths
    arr.model.tokenizer_path = arr.model.tokenizer_path or arr.model.path
    actor.clip_ratio_low = _or(actor.clip_ratio_low, actor.clip_ratio)
    actor.clip_ratio_high = _or(actor.clip_ratio_high, actor.clip_ratio)
    arr.ref.strategy = _or(arr.ref.strategy, actor.strategy)
    rollout.prompt_length = _or(rollout.prompt_length, data.max_prompt_length)
    rollout.response_length = _or(rollout.response_length, data.max_response_length)
    critic.strategy = _or(critic.strategy, actor.strategy)
    critic.model.path = critic.model.path or arr.model.path
    critic.model.tokenizer_path = critic.model.tokenizer_path or arr.model.tokenizer_path
    critic.ppo_mini_batch_size = _or(critic.ppo_mini_batch_size, actor.ppo_mini_batch_size)
    critic.ppo_epochs = _or(critic.ppo_epochs, actor.ppo_epochs)
    # verl's spellings of nanokl's knobs (the "mapped" rows of VERL_NOTES' table in README)
    data.task = _or(data.task, None if data.train_files else "arith")  # files, no task: data_source picks the rule
    for who in (actor, arr.ref, critic):
        who.strategy = "fsdp2" if who.strategy == "fsdp" else who.strategy
    if isinstance(cfg.trainer.logger, str):  # verl's trainer.logger=console
        cfg.trainer.logger = [cfg.trainer.logger]
    if rollout.enforce_eager is not None:
        rollout.use_cuda_graph = not rollout.enforce_eager
    for who, opt in ((actor, actor.optim), (critic, critic.optim)):
        who.grad_clip = _or(opt.clip_grad, who.grad_clip)
    return cfg


def _or(value, default):
    """`default` when `value` is None (not when it is 0: a zero must reach `validate`)."""
    return default if value is None else value


def _file_list(files):
    """None, "" or [] -> None (no files: a task that makes its own examples); "a.jsonl" -> ["a.jsonl"]."""
    if not files:
        return None
    return [files] if isinstance(files, str) else list(files)


def _get(cfg, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


_A, _R, _C = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic."
_M, _S = "trainer.kl_monitor.", "sft."

# (keys, test, what the value must be). A None value (an Optional left unset) passes.
_RULES = [
    (["data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
      "data.val_batch_size", "data.num_train",
      _A + "ppo_mini_batch_size", _A + "ppo_micro_batch_size_per_gpu", _A + "ppo_max_token_len_per_gpu",
      _A + "ppo_epochs", _A + "grad_clip",
      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
      "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
      _R + "temperature", _R + "n", _R + "prompt_length", _R + "response_length",
      _R + "log_prob_micro_batch_size_per_gpu", _R + "log_prob_max_token_len_per_gpu",
      _R + "max_batch_size", _R + "val_kwargs.n",
      _C + "ppo_mini_batch_size", _C + "ppo_micro_batch_size_per_gpu", _C + "ppo_max_token_len_per_gpu",
      _C + "forward_max_token_len_per_gpu", _C + "ppo_epochs", _C + "grad_clip", _C + "cliprange_value",
      "reward_model.micro_batch_size_per_gpu", "reward_model.max_length",
      "algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.integral_limit", _A + "kl_loss_ctrl.horizon", _R + "tensor_model_parallel_size",
      "trainer.n_gpus_per_node", "trainer.nnodes", _A + "ppo_micro_batch_size", _C + "ppo_micro_batch_size",
      "actor_rollout_ref.ref.log_prob_micro_batch_size", _R + "log_prob_micro_batch_size",
      _C + "forward_micro_batch_size", _C + "forward_micro_batch_size_per_gpu", "reward_model.micro_batch_size",
      _A + "optim.clip_grad", _C + "optim.clip_grad", "actor_rollout_ref.model.fused_chunk_size",
      "trainer.total_epochs", "trainer.total_training_steps", "trainer.max_actor_ckpt_to_keep",
      "trainer.log_freq", _M + "kl_high", _M + "kl_var_max", _M + "reward_var_max", _M + "kl_stop",
      _M + "kl_stop_patience", _M + "collapse_kl", _M + "score_window", _M + "rollback_actor_lr",
      _M + "rollback_critic_lr",
      "reward_model.train.steps", "reward_model.train.batch_size", "reward_model.train.lr",
      "reward_model.train.num_prompts", "reward_model.train.norm_samples",
      _S + "steps", _S + "batch_size", _S + "lr", _S + "num_examples", _S + "vocab_size", _S + "hidden_size",
      _S + "num_hidden_layers", _S + "num_attention_heads", _S + "num_key_value_heads",
      _S + "intermediate_size", _S + "max_position_embeddings"],
     lambda v: v > 0, "> 0"),
    (["data.num_val", "data.seed", "trainer.seed", "trainer.critic_warmup", _A + "kl_loss_coef",
      "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.ki", "algorithm.kl_ctrl.hold", "reward_model.missing_eos_penalty", _M + "kl_low", _M + "entropy_min", _M + "rollback_min_beta", _M + "collapse_entropy",
      _M + "max_rollbacks", "trainer.val_kl_prompts", "reward_model.train.num_val_prompts", "reward_model.train.seed",
      _R + "val_kwargs.temperature", _A + "optim.lr", _A + "optim.weight_decay",
      _C + "optim.lr", _C + "optim.weight_decay"],
     lambda v: v >= 0, ">= 0"),
    ([_A + "clip_ratio", _A + "clip_ratio_low", _A + "clip_ratio_high"], lambda v: 0 < v < 1, "in (0, 1)"),
    ([_A + "clip_ratio_c"], lambda v: v > 1, "> 1 (dual clip caps the loss at c * |advantage|)"),
    (["algorithm.gamma", "algorithm.lam", _A + "optim.lr_warmup_steps_ratio", _A + "optim.min_lr_ratio",
      _C + "optim.lr_warmup_steps_ratio", _C + "optim.min_lr_ratio"], lambda v: 0 <= v <= 1, "in [0, 1]"),
    ([_R + "top_p", _R + "val_kwargs.top_p"], lambda v: 0 < v <= 1, "in (0, 1]"),
    ([_R + "top_k", _R + "val_kwargs.top_k"], lambda v: v == -1 or v > 0, "-1 (off) or > 0"),
    ([_A + "optim.lr_warmup_steps", _C + "optim.lr_warmup_steps"], lambda v: v >= -1,
     "-1 (use the ratio) or >= 0"),
    ([_A + "optim.total_training_steps", _C + "optim.total_training_steps"], lambda v: v == -1 or v > 0,
     "-1 (filled in by the trainer) or > 0"),
    (["trainer.save_freq", "trainer.test_freq", "data.train_max_samples", "data.val_max_samples"],
     lambda v: v == -1 or v > 0, "-1 (off) or > 0"),
    ([_R + "gpu_memory_utilization"], lambda v: 0 < v <= 1, "in (0, 1]"),
    (["trainer.log_val_generations"], lambda v: v >= 0, ">= 0"),
    ([_A + "optim.betas", _C + "optim.betas"], lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    (["algorithm.rollout_correction.rollout_is_threshold"], lambda v: v >= 1,
     ">= 1 (so that a token sampled by pi_old itself gets weight exactly 1)"),
    ([_M + "rollback_beta_factor"], lambda v: v >= 1, ">= 1 (beta is multiplied by it after a rollback)"),
    ([_M + "length_drift_min", _M + "repetition_max", _M + "length_limit_max", _M + "ratio_out_band_max"],
     lambda v: v > 0, "> 0"),
    ([_M + "warmup_steps", _M + "ref_check_freq", _M + "kl_low_act"], lambda v: v >= 0, ">= 0"),
    (["data.arith_num_operands"], lambda v: v >= 2, ">= 2"),
    (["data.arith_max_operand"], lambda v: v >= 1, ">= 1"),
    (["data.arith_ops"], lambda v: v != "" and set(v) <= set("+-*"), "made of the characters + - *"),
    ([_S + "alt_answer_share"], lambda v: 0 <= v <= 1, "in [0, 1]"),
    (["reward_model.train.n"], lambda v: v >= 2, ">= 2 (a ranking needs two responses)"),
]


def _owned_names():
    """(key, the names it may take) for each key whose names a lesson module or the task table
    owns. Imported here, lazily, so that the config module itself does not import torch."""
    from nanokl.advantages import ESTIMATORS
    from nanokl.kl import KL_KINDS
    from nanokl.ppo import LOSS_AGG_MODES, POLICY_LOSSES
    from nanokl.tasks import TASKS
    return [("algorithm.kl_penalty", KL_KINDS), (_A + "kl_loss_type", KL_KINDS),
            (_A + "loss_agg_mode", LOSS_AGG_MODES), (_C + "loss_agg_mode", LOSS_AGG_MODES),
            (_A + "policy_loss.loss_mode", tuple(POLICY_LOSSES)),
            ("algorithm.adv_estimator", tuple(ESTIMATORS)), ("data.task", tuple(TASKS))]


def _check_target_kl(target, key="algorithm.kl_ctrl.target_kl"):
    if isinstance(target, (int, float)):
        if target <= 0:
            raise ConfigError(f"{key} must be > 0, got {target!r}", keys=key)
        return
    fractions = [p[0] if isinstance(p, list) and len(p) == 2 else None for p in target]
    if (not target or None in fractions or fractions[0] != 0 or any(b <= a for a, b in zip(fractions, fractions[1:]))
            or fractions[-1] > 1 or any(p[1] <= 0 for p in target)):
        raise ConfigError(f"{key} must be a number > 0 or a schedule [[0, target], [fraction, target], ...] with "
                          f"fractions rising from 0 to at most 1 and targets > 0; got {target!r}", keys=key)


def _check_rule(rule, key):
    if rule.knob not in KNOBS:
        close = difflib.get_close_matches(rule.knob, KNOBS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}.knob must be one of {', '.join(KNOBS)}; got {rule.knob!r}{hint}", keys=key + ".knob")
    if (rule.factor is None) == (rule.value is None):
        raise ConfigError(f"{key}: give exactly one of factor (multiply the knob) and value (set it)",
                          keys=(key + ".factor", key + ".value"))
    if rule.factor is not None and rule.factor <= 0:
        raise ConfigError(f"{key}.factor must be > 0, got {rule.factor!r}", keys=key + ".factor")
    if rule.knob == "kl_type":
        from nanokl.kl import KL_KINDS
        if rule.factor is not None or rule.value not in KL_KINDS:
            raise ConfigError(f"{key}.value must be one of {', '.join(KL_KINDS)} for the knob kl_type; got "
                              f"{rule.value!r}", keys=key + ".value")
    elif rule.value is not None and (isinstance(rule.value, str) or rule.value < 0):
        raise ConfigError(f"{key}.value must be a number >= 0 for the knob {rule.knob}; got {rule.value!r}",
                          keys=key + ".value")
    if rule.cooldown < 0:
        raise ConfigError(f"{key}.cooldown must be >= 0, got {rule.cooldown!r}", keys=key + ".cooldown")


FILTER_METRICS = ("acc", "score", "seq_reward")  # algorithm.filter_groups.metric (harness/variants.py reads them)


def _check_dapo_and_correction(cfg):
    """GSPO's aggregation, the overlong buffer, dynamic sampling, rejection sampling and the KL probe."""
    alg, actor, rollout = cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    if actor.policy_loss.loss_mode == "gspo" and actor.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(f"{_A}policy_loss.loss_mode=gspo aggregates seq-mean-token-mean (as verl does); set "
                          f"{_A}loss_agg_mode to it, got {actor.loss_agg_mode!r}",
                          keys=(_A + "policy_loss.loss_mode", _A + "loss_agg_mode"))
    ob, R = cfg.reward_model.overlong_buffer, rollout.response_length
    if ob.enable and not (0 < ob.len <= R and ob.penalty_factor >= 0):
        raise ConfigError(f"reward_model.overlong_buffer.len must be in (0, {R}] (the response length limit) and "
                          f"penalty_factor >= 0 when overlong_buffer.enable; got len={ob.len!r}, "
                          f"penalty_factor={ob.penalty_factor!r}",
                          keys=("reward_model.overlong_buffer.len", "reward_model.overlong_buffer.penalty_factor"))
    fg, F = alg.filter_groups, "algorithm.filter_groups."
    if fg.enable and fg.metric not in FILTER_METRICS:
        raise ConfigError(f"{F}metric must be one of {', '.join(FILTER_METRICS)} when {F}enable (seq_final_reward "
                          f"needs the KL penalty before sampling ends); got {fg.metric!r}", keys=F + "metric")
    if fg.enable and (rollout.n < 2 or cfg.data.offline_files or actor.loss_mode != "ppo"):
        raise ConfigError(f"{F}enable keeps the prompts whose rollout.n >= 2 sampled responses disagree: it needs "
                          f"{_R}n >= 2 (got {rollout.n}), online sampling (no data.offline_files) and "
                          f"{_A}loss_mode=ppo", keys=(F + "enable", _R + "n", "data.offline_files"))
    rc, RC = alg.rollout_correction, "algorithm.rollout_correction."
    if rc.rollout_rs is not None:
        from nanokl.offline import rs_thresholds
        if rc.rollout_rs_threshold is None:
            raise ConfigError(f"{RC}rollout_rs_threshold must be set with {RC}rollout_rs (as verl requires)",
                              keys=(RC + "rollout_rs_threshold", RC + "rollout_rs"))
        try:
            rs_thresholds(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(f"{RC}{e}", keys=(RC + "rollout_rs", RC + "rollout_rs_threshold")) from None
        if actor.loss_mode != "ppo":
            raise ConfigError(f"{RC}rollout_rs removes tokens from the PPO loss; {_A}loss_mode={actor.loss_mode} "
                              f"compares whole responses", keys=(RC + "rollout_rs", _A + "loss_mode"))
    if actor.use_kl_loss and actor.kl_loss_type == "full" and (cfg.actor_rollout_ref.model.use_fused_kernels or
                                                                 actor.entropy_from_logits_with_chunking):
        raise ConfigError(f"{_A}kl_loss_type=full needs both models' whole next-token distributions, which the chunked "
                          f"log-probs never hold; set actor_rollout_ref.model.use_fused_kernels=false and "
                          f"{_A}entropy_from_logits_with_chunking=false, or another kl_loss_type",
                          keys=(_A + "kl_loss_type", "actor_rollout_ref.model.use_fused_kernels",
                                _A + "entropy_from_logits_with_chunking"))
    kp, KP = alg.kl_probe, "algorithm.kl_probe."  # nanokl/kl_probe.py
    if kp.enable and not (kp.every >= 1 and 1 <= kp.prompts <= cfg.data.train_batch_size and 0 < kp.ema <= 1):
        raise ConfigError(f"{KP}every must be >= 1, {KP}prompts in [1, data.train_batch_size = "
                          f"{cfg.data.train_batch_size}] (the step's prompts) and {KP}ema in (0, 1]; got every="
                          f"{kp.every!r}, prompts={kp.prompts!r}, ema={kp.ema!r}",
                          keys=(KP + "every", KP + "prompts", KP + "ema"))
    if kp.enable and not alg.use_kl_in_reward:
        raise ConfigError(f"{KP}enable corrects the KL the reward's controller reads; there is none without "
                          f"algorithm.use_kl_in_reward", keys=(KP + "enable", "algorithm.use_kl_in_reward"))


def _check_finite(section, prefix=""):
    """Every float of the config tree (lists of them included) finite. config_io refuses `.inf` and `.nan`
    where a file or an argument sets them; this catches one set in code, or derived by `resolve`."""
    for f in dataclasses.fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, key + ".")
            continue
        stack = [(key, value)]
        while stack:
            k, v = stack.pop()
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{k} must be a finite number, got {v!r}", keys=k)
            if isinstance(v, (list, tuple)):
                stack.extend((f"{k}[{i}]", x) for i, x in enumerate(v))


def validate(cfg):
    """Reject values that are wrong in every run (not merely unusual). Run after `resolve`."""
    _check_finite(cfg)
    for key, names in _owned_names():
        value = _get(cfg, key)
        if value not in names and not (key == "data.task" and value is None):  # None: by data_source
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key} must be one of {', '.join(names)}; got {value!r}{hint}", keys=key)
    _check_target_kl(cfg.algorithm.kl_ctrl.target_kl)
    _check_target_kl(cfg.actor_rollout_ref.actor.kl_loss_ctrl.target_kl, _A + "kl_loss_ctrl.target_kl")
    for keys, ok, rule in _RULES:
        for key in keys:
            value = _get(cfg, key)
            if value is not None and not ok(value):
                raise ConfigError(f"{key} must be {rule}, got {value!r}", keys=key)

    data, actor, rollout = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    for who, mini, micro, dyn in [(_A, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                                   actor.use_dynamic_bsz),
                                  (_C, cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_micro_batch_size_per_gpu,
                                   cfg.critic.use_dynamic_bsz)]:
        if data.train_batch_size % mini:
            raise ConfigError(f"{who}ppo_mini_batch_size ({mini}) must divide data.train_batch_size "
                              f"({data.train_batch_size}): a step splits its prompts into whole mini-batches",
                              keys=(who + "ppo_mini_batch_size", "data.train_batch_size"))
        if micro is not None and not dyn and (mini * rollout.n) % micro:
            raise ConfigError(f"{who}ppo_micro_batch_size_per_gpu ({micro}) must divide ppo_mini_batch_size "
                              f"* rollout.n ({mini * rollout.n}): a mini-batch's responses split into whole "
                              f"micro-batches",
                              keys=(who + "ppo_micro_batch_size_per_gpu", who + "ppo_mini_batch_size"))
    from nanokl.advantages import ESTIMATORS
    if ESTIMATORS[cfg.algorithm.adv_estimator].grouped and rollout.n < 2:
        raise ConfigError(f"{_R}n must be > 1 with algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                          f"(advantages are relative to the other responses to the same prompt), got {rollout.n}",
                          keys=(_R + "n", "algorithm.adv_estimator"))
    if rollout.val_kwargs.do_sample and rollout.val_kwargs.temperature <= 0:
        raise ConfigError(f"{_R}val_kwargs.temperature must be > 0 when val_kwargs.do_sample is true, got "
                          f"{rollout.val_kwargs.temperature}",
                          keys=(_R + "val_kwargs.temperature", _R + "val_kwargs.do_sample"))
    greedy = not rollout.do_sample or rollout.temperature == 0
    if cfg.algorithm.rollout_correction.bypass_mode is True and greedy and rollout.temperature != 1:
        raise ConfigError(f"algorithm.rollout_correction.bypass_mode=true takes the old log-probs from the rollout, "
                          f"but a greedy rollout records them at temperature 1, not at {_R}temperature "
                          f"({rollout.temperature}): use auto or false, or temperature 1",
                          keys=("algorithm.rollout_correction.bypass_mode", _R + "temperature", _R + "do_sample"))
    if actor.loss_mode != "ppo":  # DPO / IPO: pairs of logged responses, (chosen, rejected) rows next to each other
        why = f"{_A}loss_mode={actor.loss_mode} trains on (chosen, rejected) pairs of logged, ranked responses"
        if not data.offline_files:
            raise ConfigError(f"{why}: set data.offline_files", keys=(_A + "loss_mode", "data.offline_files"))
        if rollout.n != 2:
            raise ConfigError(f"{why}: {_R}n must be 2 (one pair per prompt), got {rollout.n}",
                              keys=(_R + "n", _A + "loss_mode"))
        if actor.use_dynamic_bsz or actor.shuffle or (actor.ppo_micro_batch_size_per_gpu or 2) % 2:
            raise ConfigError(f"{why}: a micro-batch must hold whole pairs, so {_A}use_dynamic_bsz and {_A}shuffle "
                              f"must be false and {_A}ppo_micro_batch_size_per_gpu even",
                              keys=(_A + "use_dynamic_bsz", _A + "shuffle", _A + "ppo_micro_batch_size_per_gpu"))
    _check_dapo_and_correction(cfg)
    mon = cfg.trainer.kl_monitor
    for check in CHECKS + ("kl_high", "kl_low"):
        if check != "kl_band":
            _check_rule(getattr(mon, f"{check}_adjust"), f"{_M}{check}_adjust")
    if mon.kl_low >= mon.kl_high:
        raise ConfigError(f"{_M}kl_low ({mon.kl_low}) must be below kl_high ({mon.kl_high}): the healthy KL band "
                          f"needs a width", keys=(_M + "kl_low", _M + "kl_high"))
    _check_rule(mon.kl_high_escalate, f"{_M}kl_high_escalate")
    if not (mon.kl_low_act <= mon.kl_low and mon.kl_high_act >= mon.kl_high):
        # an act threshold inside the band would turn a knob where the band does not even warn
        raise ConfigError(f"{_M}kl_low_act ({mon.kl_low_act}) must be <= kl_low ({mon.kl_low}) and kl_high_act "
                          f"({mon.kl_high_act}) >= kl_high ({mon.kl_high}): the remedies act outside the band",
                          keys=(_M + "kl_low_act", _M + "kl_high_act"))
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_from_path must be set when trainer.resume_mode is resume_path",
                          keys=("trainer.resume_from_path", "trainer.resume_mode"))
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise ConfigError("reward_model.model.path must be set when reward_model.enable is true",
                          keys=("reward_model.model.path", "reward_model.enable"))
    sft = cfg.sft
    if sft.hidden_size % sft.num_attention_heads or (sft.hidden_size // sft.num_attention_heads) % 2:
        raise ConfigError(f"{_S}hidden_size ({sft.hidden_size}) must be num_attention_heads "
                          f"({sft.num_attention_heads}) x an even head size (RoPE rotates pairs)",
                          keys=(_S + "hidden_size", _S + "num_attention_heads"))
    if sft.num_attention_heads % sft.num_key_value_heads:
        raise ConfigError(f"{_S}num_key_value_heads ({sft.num_key_value_heads}) must divide "
                          f"num_attention_heads ({sft.num_attention_heads})", keys=(_S + "num_key_value_heads",))
    if actor.kl_loss_ctrl.type == "adaptive" and actor.kl_loss_coef <= 0:
        raise ConfigError(f"{_A}kl_loss_coef must be > 0 with kl_loss_ctrl.type=adaptive (the controller multiplies "
                          f"it), got {actor.kl_loss_coef}", keys=(_A + "kl_loss_coef", _A + "kl_loss_ctrl.type"))
    from nanokl.harness.config_verl import check_verl_keys
    check_verl_keys(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# verl's keys without a nanokl counterpart (nanokl/harness/config_verl.py)
# ---------------------------------------------------------------------------------------------

_ARR, _RM, _T = "actor_rollout_ref.", "reward_model.", "trainer."
_RAY = "nanokl runs under torchrun, without Ray"
_ONE_PROC = "nanokl runs the reward model in the trainer processes, beside the policy"
_NO_HOOKS = "nanokl has no profiler or tracing hooks (timing_s/* times each stage)"
_FSDP = ("nanokl/dist.py wraps each decoder block with FSDP2, fp32 master weights under bf16 autocast; "
         "only param_offload and optimizer_offload are its to set")
_SP = "nanokl has no sequence parallelism: each GPU holds whole sequences (use_dynamic_bsz bounds memory)"
_ENT = "nanokl's chunked kernel (use_fused_kernels) recomputes each chunk's logits in backward, always"
_FUSED = "nanokl has no Liger or Triton kernels; use_fused_kernels chunks the log-probs in plain torch (nanokl/fused.py)"
_CKPT = "nanokl's checkpoints hold the model, the optimizer and the trainer state, always, written synchronously"
_VLLM = "nanokl's engine decodes each batch in lockstep; this vLLM scheduler setting has no counterpart"
_WEIGHTS = "nanokl's rollout takes the actor's weights in place after each update (nanokl/dist.py)"
_UNUSED = "used only with {} (refused)"

# key -> what nanokl does instead. A key whose value differs from its default (for a dict: one of the
# entries its default names) prints "note: key=value: <this>" once at start-up, on rank 0; README's
# verl table lists them all.
VERL_NOTES = {
    "data.tokenizer": "nanokl tokenizes with actor_rollout_ref.model.tokenizer_path",
    "data.use_shm": "nanokl reads the files where they are",
    "data.return_raw_input_ids": "nanokl keeps one tokenization of each prompt, the policy's",
    "data.return_full_prompt": "nanokl keeps one tokenization of each prompt, the policy's",
    "data.dataloader_num_workers": "nanokl reads and tokenizes the prompts once, in the main process",
    "data.filter_overlong_prompts_workers": "nanokl reads and tokenizes the prompts once, in the main process",
    "data.validation_shuffle": "nanokl validates on the validation rows in file order",
    "data.trust_remote_code": "nanokl runs no code from the data or model directories",
    **dict.fromkeys(["data.image_key", "data.video_key", "data.image_patch_size", "data.return_multi_modal_inputs",
                     "actor_rollout_ref.actor.freeze_vision_tower"], "nanokl is text-only: no image or video is read"),
    "data.tool_config_path": "nanokl's rollout is single-turn, without tools",
    **{f"{m}.{k}": v for m in (_ARR + "model", "critic.model") for k, v in {
        "use_shm": "nanokl loads the checkpoint from its path",
        "trust_remote_code": "nanokl builds Qwen2/Llama-format models with its own code (nanokl/model.py)",
        "external_lib": "nanokl builds Qwen2/Llama-format models with its own code (nanokl/model.py)",
        "enable_activation_offload": "nanokl keeps activations on the GPU (enable_gradient_checkpointing saves memory)",
        "lora_alpha": _UNUSED.format("lora_rank > 0"), "target_modules": _UNUSED.format("lora_rank > 0"),
        "exclude_modules": _UNUSED.format("lora_rank > 0"), "tiled_mlp": "nanokl's MLP runs untiled",
        "use_liger": _FUSED, "fused_kernel_options": _FUSED}.items()
       if m != "critic.model" or k not in ("exclude_modules", "use_liger", "fused_kernel_options")},
    **{f"{p}.fsdp_config.{k}": _FSDP for p in (_A[:-1], _ARR + "ref", "critic.model")
       for k in ("offload_policy", "reshard_after_forward", "fsdp_size", "forward_prefetch", "wrap_policy",
                 "model_dtype", "dtype", "use_orig_params", "use_torch_compile", "ulysses_sequence_parallel_size",
                 "seed", "full_determinism", "entropy_from_logits_with_chunking", "entropy_checkpointing",
                 "forward_only", "strategy")},
    **{f"{o}.optimizer_impl": "nanokl's optimizer is torch.optim.AdamW" for o in (_A + "optim", _C + "optim")},
    **{f"{p}{k}": v for p in (_A, _ARR + "ref.", _C) for k, v in {
        "ulysses_sequence_parallel_size": _SP,
        "entropy_from_logits_with_chunking": "the reference computes no entropy", "entropy_checkpointing": _ENT, "profiler": _NO_HOOKS, "router_replay": "nanokl's models are dense (no MoE router)",
        "checkpoint": _CKPT, "data_loader_seed": "nanokl shuffles mini-batches from trainer.seed and the step"}.items()
       if not (p == _C and k in ("use_torch_compile", "entropy_from_logits_with_chunking", "entropy_checkpointing",
                                 "router_replay"))
       and not (p == _A and k == "entropy_from_logits_with_chunking")
       and not (p == _ARR + "ref." and k in ("checkpoint", "data_loader_seed"))},
    _A + "calculate_entropy": "nanokl computes the entropy every step (actor/entropy)",
    _A + "use_prefix_grouper": "nanokl forwards each response with its own copy of the prompt",
    **dict.fromkeys([_A + "tau_pos", _A + "tau_neg"], _UNUSED.format("policy_loss.loss_mode=sapo")),
    **dict.fromkeys([f"{_A}policy_loss.{k}" for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                                                      "ppo_kl_coef")],
                    _UNUSED.format("policy_loss.loss_mode=clip_cov / kl_cov")),
    **dict.fromkeys([_A + "calculate_sum_pi_squared", _A + "sum_pi_squared_checkpointing"],
                    "nanokl does not compute sum(pi^2)"),
    _R + "name": "nanokl samples with its own engine (nanokl/rollout.py; CUDA graphs on GPU)",
    _R + "mode": "nanokl samples synchronously, inside the step",
    _R + "tensor_model_parallel_size": "nanokl has no tensor parallelism: each GPU samples its share of the prompts "
                                       "with the whole policy (the same distribution)",
    **dict.fromkeys([_R + "data_parallel_size", _R + "expert_parallel_size", _R + "pipeline_model_parallel_size"],
                    "nanokl's rollout runs one whole-policy replica per GPU"),
    _R + "cudagraph_capture_sizes": "nanokl captures one CUDA graph per batch size it meets (up to max_batch_size)",
    _R + "free_cache_engine": "nanokl sizes its KV cache once (gpu_memory_utilization) and keeps it",
    **dict.fromkeys([_R + k for k in ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
                                      "enable_prefix_caching", "scheduling_policy", "disable_log_stats",
                                      "engine_kwargs")], _VLLM),
    _R + "max_model_len": "nanokl's rollout holds prompt_length + response_length tokens",
    _R + "logprobs_mode": "nanokl records the log-probs of the temperature-scaled distribution it samples "
                          "(verl's processed_logprobs)",
    _R + "calculate_log_probs": "nanokl's rollout records the sampler's log-probs always",
    **dict.fromkeys([_R + k for k in ("load_format", "multi_stage_wake_up", "layered_summon", "skip_tokenizer_init",
                                      "enable_rollout_routing_replay", "checkpoint_engine")], _WEIGHTS),
    _R + "skip_dump_dir": _UNUSED.format("skip_rollout"),
    _R + "quantization_config_file": _UNUSED.format("quantization"),
    **dict.fromkeys([_R + "multi_turn", _R + "agent"], "nanokl's rollout is single-turn: one response per sample"),
    **dict.fromkeys([_R + "trace", _R + "profiler", _R + "prometheus", _RM + "profiler", "global_profiler"], _NO_HOOKS),
    _ARR + "hybrid_engine": "nanokl's actor and rollout share each GPU (verl's hybrid engine), always",
    _ARR + "nccl_timeout": "nanokl uses torch.distributed's default timeout",
    **dict.fromkeys([_RM + k for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "strategy",
                                       "ulysses_sequence_parallel_size", "use_dynamic_bsz",
                                       "forward_max_token_len_per_gpu")] +
                    [f"{_RM}model.{k}" for k in ("external_lib", "trust_remote_code", "use_shm", "use_remove_padding",
                                                  "use_fused_kernels", "fsdp_config")], _ONE_PROC),
    _RM + "model.input_tokenizer": "nanokl's reward model reads the decoded text with its own tokenizer",
    **dict.fromkeys([_RM + k for k in ("reward_loop_source", "reward_loop_module_path", "reward_loop_class_name",
                                       "use_reward_loop", "num_workers", "launch_reward_fn_async")],
                    "nanokl scores each batch in the trainer processes, after sampling"),
    _RM + "sandbox_fusion": "nanokl has no code sandbox: the task's rule scores",
    _RM + "rollout": "nanokl's reward model is a sequence classifier (no generative reward model)",
    _RM + "reward_manager": "prime scores in a process pool; nanokl scores in the trainer process (the same scores)",
    "reward_manager": "nanokl's reward manager is reward_model.reward_manager",
    "algorithm.pf_ppo": _UNUSED.format("algorithm.use_pf_ppo"),
    _RM + "overlong_buffer.log": "nanokl logs critic/overlong_penalty/* and critic/overlong_fraction whenever "
                                 "overlong_buffer.enable",
    _T + "balance_batch": "nanokl gives each rank the same number of prompts, unbalanced by length (the same metrics)",
    _T + "esi_redundant_time": "nanokl saves a checkpoint on SIGTERM / SIGUSR1 instead (nanokl/harness/faults.py)",
    _T + "default_hdfs_dir": "nanokl saves under trainer.default_local_dir only",
    _T + "del_local_ckpt_after_load": "nanokl keeps the checkpoint it resumed from",
    _T + "max_critic_ckpt_to_keep": "nanokl's checkpoints hold actor and critic together: max_actor_ckpt_to_keep counts",
    **dict.fromkeys([_T + "ray_wait_register_center_timeout", _T + "use_legacy_worker_impl", "ray_kwargs", "ray_init",
                     "transfer_queue"], _RAY),
}

def startup_notes(cfg) -> list[str]:
    """One line per verl key set to something nanokl does otherwise (VERL_NOTES), and one per KL
    controller with nothing to steer. Printed once, on rank 0, by harness/run.py's setup."""
    from nanokl.harness.config import Config
    defaults, lines = Config(), []
    for key, note in VERL_NOTES.items():
        value = _get(cfg, key)
        if _differs(value, _get(defaults, key)):
            lines.append(f"note: {key}={value!r}: {note}")
    alg, a = cfg.algorithm, cfg.actor_rollout_ref.actor
    if alg.kl_ctrl.type in ("adaptive", "pi") and not alg.use_kl_in_reward and a.loss_mode == "ppo":
        fix = ("set algorithm.use_kl_in_reward=true to penalise KL in the reward" if not a.use_kl_loss else
               f"the KL loss's coefficient has its own, {_A}kl_loss_ctrl" if a.kl_loss_ctrl.type == "adaptive" else
               f"to steer the KL loss's coefficient set {_A}kl_loss_ctrl.type=adaptive")
        lines.append(f"warning: algorithm.kl_ctrl.type={alg.kl_ctrl.type} steers beta of the in-reward KL penalty, but "
                     f"algorithm.use_kl_in_reward is false: the controller has nothing to steer; {fix}")
    if a.kl_loss_ctrl.type == "adaptive" and not a.use_kl_loss:
        lines.append(f"warning: {_A}kl_loss_ctrl.type=adaptive steers kl_loss_coef, but {_A}use_kl_loss is false: "
                     f"the controller has nothing to steer")
    return lines


def _differs(value, default) -> bool:
    """`value` is not `default`; for a group of settings (a dict), only the entries the default names
    count (verl's files spell out many more, at values that ask nothing), unless it names none."""
    if isinstance(value, dict) and isinstance(default, dict):
        if not default:  # a group verl leaves empty (engine kwargs): any entry asks something
            return bool(value)
        return any(_differs(value.get(k, d), d) for k, d in default.items())
    return value != default
