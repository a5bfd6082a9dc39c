"""Derived defaults and impossible values: the two passes that follow loading a config.

`resolve` fills every key whose None means "derived from another key" (verl writes these as
`${...}` interpolations, e.g. `clip_ratio_low: ${clip_ratio}`), once, at load time, so the
training code reads `actor.clip_ratio_low` and never re-derives it. `validate` then rejects
values that are wrong in *every* run (not merely unusual): an infinite or NaN float anywhere,
non-positive sizes, ratios outside their ranges, mini-batches that do not divide the batch, GRPO
with one sample per prompt, ... and, last, the verl values nanokl cannot honour
(verl_keys.check_verl_keys).
Each rejection is a one-line `ConfigError` naming the dotted key (yaml_io adds the file and
line that set it). tests/test_config.py checks every rule against a config that breaks it.
Both passes read the config only through its attributes: this module imports none of config.py.
"""

import dataclasses
import difflib
import math
import os

from nanokl.harness.config.yaml_io import ConfigError, get_key
from nanokl.harness.config.verl_keys import check_verl_keys
from nanokl.harness.config.nanokl_keys import CHECKS, KNOBS, RENAMED_KNOBS


def resolve(cfg):
    """Fill every None-means-derived key from the key it derives from (in place; idempotent)."""
    data, arr, critic = cfg.data, cfg.actor_rollout_ref, cfg.critic
    actor, rollout = arr.actor, arr.rollout
    for key in PATH_KEYS:  # `~/gsm8k/train.parquet`: the user's home, as a shell would have it
        *owner, name = key.split(".")
        section, value = get_key(cfg, ".".join(owner)), get_key(cfg, key)
        setattr(section, name, [_home(v) for v in value] if isinstance(value, list) else _home(value))
    data.seed = _or(data.seed, cfg.trainer.seed)
    data.gen_batch_size = _or(data.gen_batch_size, data.train_batch_size)
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
    rm = cfg.reward_model  # verl's main_ppo passes DAPO's buffer as reward_kwargs (the recipe: overlong_buffer)
    given = rm.reward_kwargs.overlong_buffer_cfg
    if given != type(given)() and rm.overlong_buffer == type(given)():
        rm.overlong_buffer = dataclasses.replace(given)
    # verl's GSPO loss aggregates seq-mean-token-mean whatever loss_agg_mode says; nanokl's actor aggregates its
    # loss terms alike, so with no KL loss and no entropy bonus (verl's would follow loss_agg_mode) the mode is set
    if (actor.policy_loss.loss_mode == "gspo" and actor.loss_agg_mode in _VERL_AGG and not actor.use_kl_loss
            and not actor.entropy_coeff):
        cfg.__dict__.setdefault("resolve_notes", []).append(
            f"note: {_A}policy_loss.loss_mode='gspo' with {_A}loss_agg_mode={actor.loss_agg_mode!r}: the GSPO loss is "
            f"aggregated seq-mean-token-mean whatever loss_agg_mode says, as verl's compute_policy_loss_gspo does")
        actor.loss_agg_mode = "seq-mean-token-mean"
    return cfg


# keys holding a file or folder path (or a list of them): a leading `~` is expanded (os.path.expanduser)
PATH_KEYS = [f"data.{k}" for k in ("train_files", "val_files", "offline_files", "tokenizer", "tool_config_path")] + [
    f"{m}.{k}" for m in ("actor_rollout_ref.model", "critic.model") for k in ("path", "tokenizer_path")] + [
    "actor_rollout_ref.model.hf_config_path", "actor_rollout_ref.model.lora_adapter_path", "reward_model.model.path",
    "reward_model.model.input_tokenizer", "reward_model.train.data_path", "reward_model.train.val_data_path",
    "custom_reward_function.path", "sft.output_dir", "actor_rollout_ref.rollout.skip_dump_dir",
    "actor_rollout_ref.rollout.quantization_config_file"] + [
    f"trainer.{k}" for k in ("default_local_dir", "resume_from_path", "rollout_data_dir", "validation_data_dir")]
_VERL_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")  # verl's other loss_agg_modes


def _home(path):
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path


def _or(value, default):
    """`default` when `value` is None (not when it is 0: a zero must reach `validate`)."""
    return default if value is None else value


def _file_list(files):
    """None, "" or [] -> None (no files: a task that makes its own examples); "a.jsonl" -> ["a.jsonl"]."""
    if not files:
        return None
    return [files] if isinstance(files, str) else list(files)


_A, _R, _C = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic."
_M, _S = "trainer.kl_monitor.", "sft."

# (keys, test, what the value must be). A None value (an Optional left unset) passes.
_RULES = [
    (["data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
      "data.val_batch_size", "data.gen_batch_size", "data.num_train",
      _A + "ppo_mini_batch_size", _A + "ppo_micro_batch_size_per_gpu", _A + "ppo_max_token_len_per_gpu",
      _A + "ppo_epochs", _A + "grad_clip",
      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
      "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
      _R + "temperature", _R + "n", _R + "prompt_length", _R + "response_length",
      _R + "log_prob_micro_batch_size_per_gpu", _R + "log_prob_max_token_len_per_gpu",
      _R + "max_batch_size", _R + "val_kwargs.n",
      _C + "ppo_mini_batch_size", _C + "ppo_micro_batch_size_per_gpu", _C + "ppo_max_token_len_per_gpu",
      _C + "forward_max_token_len_per_gpu", _C + "ppo_epochs", _C + "grad_clip", _C + "cliprange_value",
      "reward_model.micro_batch_size_per_gpu", "reward_model.max_length", "actor_rollout_ref.model.lora_alpha",
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
      _R + "val_kwargs.temperature", "actor_rollout_ref.model.lora_rank", _A + "optim.lr", _A + "optim.weight_decay",
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
    (["trainer.log_val_generations", "trainer.signal_grace_s"], lambda v: v >= 0, ">= 0"),
    (["actor_rollout_ref.nccl_timeout"], lambda v: v > 0, "> 0 (seconds)"),
    (["custom_reward_function.timeout"], lambda v: v <= 1e6, "null or <= 0 (no limit), or seconds up to 1e6"),
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
    if rule.knob in RENAMED_KNOBS:  # kl_coef is verl's beta (algorithm.kl_ctrl.kl_coef); the knob moves either weight
        raise ConfigError(f"{key}.knob={rule.knob} is now {RENAMED_KNOBS[rule.knob]} (beta in the reward and/or the "
                          "KL loss's weight; algorithm.kl_ctrl.kl_coef is beta's start)", keys=key + ".knob")
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
        # (resolve set it where that changes nothing else) verl aggregates the KL loss and the entropy bonus by
        # loss_agg_mode and GSPO's loss seq-mean-token-mean; nanokl aggregates all of the actor's terms alike
        raise ConfigError(f"{_A}policy_loss.loss_mode=gspo aggregates seq-mean-token-mean (as verl does) and, with "
                          f"{_A}use_kl_loss or entropy_coeff, nanokl aggregates those terms alike: set "
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
    if fg.enable and (rollout.n < 2 or cfg.data.offline_files or actor.objective != "ppo"):
        raise ConfigError(f"{F}enable keeps the prompts whose rollout.n >= 2 sampled responses disagree: it needs "
                          f"{_R}n >= 2 (got {rollout.n}), online sampling (no data.offline_files) and "
                          f"{_A}objective=ppo", keys=(F + "enable", _R + "n", "data.offline_files"))
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
        if actor.objective != "ppo":
            raise ConfigError(f"{RC}rollout_rs removes tokens from the PPO loss; {_A}objective={actor.objective} "
                              f"compares whole responses", keys=(RC + "rollout_rs", _A + "objective"))
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
    """Every float of the config tree (lists of them included) finite. yaml_io refuses `.inf` and `.nan`
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
        value = get_key(cfg, key)
        if value not in names and not (key == "data.task" and value is None):  # None: by data_source
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key} must be one of {', '.join(names)}; got {value!r}{hint}", keys=key)
    _check_target_kl(cfg.algorithm.kl_ctrl.target_kl)
    _check_target_kl(cfg.actor_rollout_ref.actor.kl_loss_ctrl.target_kl, _A + "kl_loss_ctrl.target_kl")
    for keys, ok, rule in _RULES:
        for key in keys:
            value = get_key(cfg, key)
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
    if actor.objective != "ppo":  # DPO / IPO: pairs of logged responses, (chosen, rejected) rows next to each other
        why = f"{_A}objective={actor.objective} trains on (chosen, rejected) pairs of logged, ranked responses"
        if not data.offline_files:
            raise ConfigError(f"{why}: set data.offline_files", keys=(_A + "objective", "data.offline_files"))
        if rollout.n != 2:
            raise ConfigError(f"{why}: {_R}n must be 2 (one pair per prompt), got {rollout.n}",
                              keys=(_R + "n", _A + "objective"))
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
    check_verl_keys(cfg)
    return cfg
