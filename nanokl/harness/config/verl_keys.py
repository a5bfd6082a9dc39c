"""verl's keys that nanokl accepts without a knob of its own, at verl's paths and with verl's defaults.

A verl command line or config file carries keys for machinery nanokl does not have: vLLM's engine
settings, Ray, profilers, LoRA, multi-modal data, ... So that such a command runs unchanged, each of
those keys is a field here, and each class is the *base* of the config.py section at the same path
(`RolloutConfig(VerlRolloutKeys)` holds `actor_rollout_ref.rollout.max_num_seqs`). Nothing in
nanokl's training reads these fields: a key whose value is not its default prints its line of
`notes.VERL_NOTES` once at start-up (what nanokl does instead), or, where nanokl cannot
honour the value without changing the result, is refused in one line by `check_verl_keys` below
(part of `rules.validate`).

Groups of keys that only matter together (profiler settings, vLLM engine kwargs, the agent loop)
are one `dict` field each: any mapping is accepted, and changing it prints the group's note.
"""

import copy
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from nanokl.harness.config.yaml_io import ConfigError, get_key

__all__ = ["FSDPConfig", "PolicyLossConfig", "VerlActorKeys", "VerlActorRolloutRefKeys",
           "VerlAlgorithmKeys", "VerlCriticKeys", "VerlCriticModelKeys", "VerlDataKeys", "VerlModelKeys",
           "VerlOptimKeys", "VerlRefKeys", "VerlRewardModelKeys", "VerlRewardModelModelKeys", "VerlRolloutKeys",
           "VerlTrainerKeys", "verl_section"]


def verl_section(**kw):
    """A `dict` field defaulting to verl's entries `kw` (a fresh copy per instance)."""
    return field(default_factory=lambda: copy.deepcopy(kw))


_d = verl_section


@dataclass
class FSDPConfig:
    """verl's `fsdp_config` of the actor, the reference and the critic (nanokl/engine/shard.py shards with FSDP2)."""
    param_offload: bool = False  # keep the parameters in CPU memory between uses (nanokl/engine/shard.py)
    optimizer_offload: bool = False  # keep the optimizer state in CPU memory between steps (nanokl/engine/shard.py)
    offload_policy: bool = False  # FSDP2's CPUOffloadPolicy (noted)
    reshard_after_forward: bool = True  # free the gathered parameters after each forward (noted)
    fsdp_size: int = -1  # shard group size (HSDP); -1: all ranks (noted)
    forward_prefetch: bool = False  # prefetch the next block's parameters (noted)
    wrap_policy: dict = _d(min_num_params=0)  # which modules are FSDP units (noted: one per decoder block)
    model_dtype: str = "fp32"  # master weights' dtype (fp32 is what nanokl keeps; noted otherwise)
    dtype: str = "bfloat16"  # mixed-precision compute dtype (noted)
    use_orig_params: bool = False  # FSDP1 flag (noted)
    use_torch_compile: bool = True  # (noted)
    ulysses_sequence_parallel_size: int = 1  # (noted)
    seed: int = 42  # (noted)
    full_determinism: bool = False  # (noted)
    entropy_from_logits_with_chunking: bool = False  # (noted)
    entropy_checkpointing: bool = False  # (noted)
    forward_only: bool = False  # set by verl for the reference (noted)
    strategy: str = "fsdp"  # (noted)


@dataclass
class PolicyLossConfig:
    """verl's `actor.policy_loss`: which policy-gradient loss (nanokl/ppo.py's POLICY_LOSSES)."""
    # vanilla: dual-clip PPO; gspo: the response's length-normalised ratio clipped (seq-mean-token-mean whatever
    # loss_agg_mode says, as verl: rules.resolve); cispo: the clipped ratio as a REINFORCE weight. verl's
    # others (sapo, gpg, clip_cov, kl_cov, geo_mean) are refused
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov only
    clip_cov_lb: float = 1.0  # clip_cov only
    clip_cov_ub: float = 5.0  # clip_cov only
    kl_cov_ratio: float = 0.0002  # kl_cov only
    ppo_kl_coef: float = 0.1  # kl_cov only


@dataclass
class VerlDataKeys:
    tokenizer: Optional[str] = None  # noted: nanokl tokenizes with actor_rollout_ref.model.tokenizer_path
    use_shm: bool = False
    return_raw_input_ids: bool = False
    return_full_prompt: bool = False
    dataloader_num_workers: int = 8
    filter_overlong_prompts_workers: int = 1
    validation_shuffle: bool = False
    trust_remote_code: bool = False
    image_key: str = "images"
    video_key: str = "videos"
    image_patch_size: int = 14
    return_multi_modal_inputs: bool = True
    tool_config_path: Optional[str] = None
    custom_cls: dict = _d(path=None, name=None)  # refused when path is set
    sampler: dict = _d(class_path=None, class_name=None)  # refused when class_path is set
    datagen: dict = _d(path=None, name=None)  # refused when path is set
    apply_chat_template_kwargs: dict = _d()  # refused when not empty (it changes the prompts)


@dataclass
class VerlModelKeys:
    hf_config_path: Optional[str] = None  # refused when set: nanokl reads config.json from path
    use_shm: bool = False
    trust_remote_code: bool = False
    custom_chat_template: Optional[str] = None  # refused when set (it changes the prompts)
    external_lib: Optional[str] = None
    enable_activation_offload: bool = False
    lora_adapter_path: Optional[str] = None  # refused when set (lora_rank & co.: schema.PolicyModelConfig)
    use_liger: bool = False
    fused_kernel_options: dict = _d(impl_backend="torch")  # noted: nanokl's chunked kernel is plain torch
    tiled_mlp: dict = _d(enabled=False, num_shards=4)
    mtp: dict = _d(enable=False)  # refused when enable is true


@dataclass
class VerlCriticModelKeys:
    use_shm: bool = False
    trust_remote_code: bool = False
    external_lib: Optional[str] = None
    enable_activation_offload: bool = False
    lora_rank: int = 0  # refused when > 0: the critic trains every weight (its fresh value head must train)
    lora_alpha: int = 16
    target_modules: Union[str, list[str]] = "all-linear"
    tiled_mlp: dict = _d(enabled=False, num_shards=4)


@dataclass
class VerlOptimKeys:
    optimizer: Literal["AdamW"] = "AdamW"  # nanokl's optimizer is torch's AdamW; others are refused
    optimizer_impl: str = "torch.optim"
    num_cycles: float = 0.5  # cosine: half a cycle, peak to min_lr_ratio (others refused)
    override_optimizer_config: Optional[dict] = None  # refused when set
    clip_grad: Optional[float] = None  # verl's newer name for the section's grad_clip (mapped)


@dataclass
class VerlActorKeys:
    ppo_micro_batch_size: Optional[int] = None  # verl's older global size: / world -> ppo_micro_batch_size_per_gpu (mapped)
    ulysses_sequence_parallel_size: int = 1
    loss_scale_factor: Optional[float] = None  # refused when set
    calculate_entropy: bool = False
    use_prefix_grouper: bool = False
    data_loader_seed: int = 42
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    freeze_vision_tower: bool = False
    entropy_checkpointing: bool = False
    calculate_sum_pi_squared: bool = False
    sum_pi_squared_checkpointing: bool = False
    checkpoint: dict = _d(save_contents=["model", "optimizer", "extra"], async_save=False)
    profiler: dict = _d(enable=False)
    router_replay: dict = _d(mode="disabled")


@dataclass
class VerlRefKeys:
    log_prob_micro_batch_size: Optional[int] = None  # verl's older global size (mapped, as the actor's)
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    profiler: dict = _d(enable=False)
    router_replay: dict = _d(mode="disabled")


@dataclass
class VerlRolloutKeys:
    mode: str = "async"
    ignore_eos: bool = False  # refused when true (it changes the responses)
    cudagraph_capture_sizes: Optional[list[int]] = None
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    logprobs_mode: str = "processed_logprobs"
    scheduling_policy: str = "fcfs"
    load_format: str = "dummy"
    log_prob_micro_batch_size: Optional[int] = None  # verl's older global size (mapped)
    disable_log_stats: bool = True
    over_sample_rate: float = 0.0  # refused when > 0 (it drops the slowest responses)
    multi_stage_wake_up: bool = False
    calculate_log_probs: bool = False
    skip_rollout: bool = False  # refused when true
    skip_dump_dir: str = "/tmp/rollout_dump"
    skip_tokenizer_init: bool = True
    enable_rollout_routing_replay: bool = False
    quantization: Optional[str] = None  # refused when set
    quantization_config_file: Optional[str] = None
    layered_summon: bool = False
    engine_kwargs: dict = _d(vllm={}, sglang={}, trtllm={})
    multi_turn: dict = _d(enable=False)  # refused when enable is true
    agent: dict = _d(num_workers=8, default_agent_loop="single_turn_agent")
    checkpoint_engine: dict = _d(backend="naive")
    trace: dict = _d(backend=None)
    profiler: dict = _d(enable=False)
    prometheus: dict = _d(enable=False)


@dataclass
class VerlActorRolloutRefKeys:
    hybrid_engine: bool = True


@dataclass
class VerlCriticKeys:
    enable: Optional[bool] = None  # null: a critic iff the estimator needs one (nanokl's rule); a contradiction is refused
    ppo_micro_batch_size: Optional[int] = None  # verl's older global size (mapped)
    forward_micro_batch_size: Optional[int] = None  # verl's older global size (mapped)
    forward_micro_batch_size_per_gpu: Optional[int] = None  # responses per value forward; null: ppo_micro_batch_size_per_gpu (mapped)
    ulysses_sequence_parallel_size: int = 1
    data_loader_seed: int = 42
    checkpoint: dict = _d(save_contents=["model", "optimizer", "extra"], async_save=False)
    profiler: dict = _d(enable=False)


@dataclass
class VerlRewardModelKeys:
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0
    strategy: str = "fsdp"
    micro_batch_size: Optional[int] = None  # verl's older global size (mapped)
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int = 32768
    reward_loop_source: str = "register"
    reward_loop_module_path: Optional[str] = None
    reward_loop_class_name: Optional[str] = None
    launch_reward_fn_async: bool = False
    ulysses_sequence_parallel_size: int = 1
    use_reward_loop: bool = True
    num_workers: int = 1
    sandbox_fusion: dict = _d(url=None)
    profiler: dict = _d(enable=False)
    rollout: dict = _d()


@dataclass
class VerlRewardModelModelKeys:
    input_tokenizer: Optional[str] = None
    external_lib: Optional[str] = None
    trust_remote_code: bool = False
    override_config: dict = _d()  # refused when not empty
    use_shm: bool = False
    use_remove_padding: bool = False
    use_fused_kernels: bool = False
    fsdp_config: dict = _d(param_offload=False)


@dataclass
class VerlAlgorithmKeys:
    use_pf_ppo: bool = False  # refused when true (it resamples the batch)
    pf_ppo: dict = _d(reweight_method="pow", weight_pow=2.0)


@dataclass
class VerlTrainerKeys:
    balance_batch: bool = True
    esi_redundant_time: float = 0
    default_hdfs_dir: Optional[str] = None
    del_local_ckpt_after_load: bool = False
    max_critic_ckpt_to_keep: Optional[int] = None
    ray_wait_register_center_timeout: int = 300
    use_legacy_worker_impl: str = "auto"


# ---------------------------------------------------------------------------------------------
# Refused values
# ---------------------------------------------------------------------------------------------

_A, _R, _C, _ARR, _RM = ("actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic.", "actor_rollout_ref.",
                         "reward_model.")


# (key, bad value?, why nanokl refuses it): what nanokl cannot honour without changing the result
_VERL_REFUSED = [
    ("data.custom_cls", lambda v: v.get("path"), "a custom dataset class: nanokl reads the rows itself"),
    ("data.sampler", lambda v: v.get("class_path"), "a custom sampler: nanokl's order is a seeded shuffle"),
    ("data.datagen", lambda v: v.get("path"), "generated data: nanokl reads the files"),
    ("data.apply_chat_template_kwargs", bool, "chat-template arguments: nanokl renders with data.prompt_template"),
    (_ARR + "model.hf_config_path", lambda v: v, "nanokl reads config.json from model.path"),
    (_ARR + "model.custom_chat_template", lambda v: v, "nanokl renders prompts with data.prompt_template"),
    (_C + "model.lora_rank", lambda v: v > 0, "LoRA on the critic: nanokl trains every weight of the critic, "
     "whose fresh value head must train (the actor takes actor_rollout_ref.model.lora_rank)"),
    (_ARR + "model.lora_adapter_path", lambda v: v, "pretrained LoRA adapters: nanokl's start at B = 0 (lora_rank)"),
    (_ARR + "model.mtp", lambda v: v.get("enable"), "multi-token prediction: nanokl's models predict one token"),
    (_A + "optim.override_optimizer_config", lambda v: v, "nanokl's AdamW takes the optim keys only"),
    (_C + "optim.override_optimizer_config", lambda v: v, "nanokl's AdamW takes the optim keys only"),
    (_A + "loss_scale_factor", lambda v: v is not None, "nanokl scales the loss by loss_agg_mode alone"),
    (_R + "ignore_eos", lambda v: v, "nanokl ends a response at its EOS"),
    (_R + "over_sample_rate", lambda v: v > 0, "nanokl keeps every sampled response"),
    (_R + "skip_rollout", lambda v: v, "nanokl samples every step (data.offline_files draws logged responses)"),
    (_R + "quantization", lambda v: v, "nanokl samples with the policy's own weights"),
    (_R + "multi_turn", lambda v: v.get("enable"), "multi-turn rollout: nanokl's is single-turn"),
    (_RM + "model.override_config", bool, "nanokl loads the reward model as its config.json says"),
    ("algorithm.use_pf_ppo", lambda v: v, "nanokl trains on the whole batch, unresampled"),
    ("algorithm.rollout_correction.rollout_is_batch_normalize", lambda v: v, "nanokl's weights are min(pi_old/mu, C)"),
]
# naive: one score per response; prime: the same, in a process pool; dapo: the same, + reward_kwargs' overlong penalty
# batch: the custom function once per batch, with lists (harness/reward_fn.py `batched`)
REWARD_MANAGERS = ("naive", "prime", "dapo", "batch")

# model.override_config (verl: entries replacing config.json's; hf_format.read_config applies them). The fields
# nanokl's model reads and that may change without the weights changing shape are applied; these keep nanokl's
# model as it is at the value given (any other value refused); attn_implementation is noted (notes); the
# rest is refused, each naming its key
MODEL_OVERRIDES = ("max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps")
MODEL_OVERRIDES_SAME = {"attention_dropout": 0, "hidden_dropout": 0, "embd_pdrop": 0, "resid_pdrop": 0,
                        "hidden_act": "silu", "use_sliding_window": False}
_SHAPES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "attention_bias", "mlp_bias", "tie_word_embeddings")


def _check_model_overrides(key, overrides, fresh_head):
    """One model's override_config: applied, the same as nanokl's model, noted, or refused per key."""
    for name, value in overrides.items():
        k, why = f"{key}.{name}", None
        if name in MODEL_OVERRIDES or name == "attn_implementation" or (fresh_head and name == "initializer_range"):
            kind, shown = {"max_position_embeddings": (int, "int"), "rope_scaling": ((dict, type(None)), "a mapping or "
                           "null"), "rope_parameters": (dict, "a mapping"), "attn_implementation": (str, "a name")
                           }.get(name, ((int, float), "a number"))
            if not isinstance(value, kind) or isinstance(value, bool):
                why = f"expects {shown}"
        elif name in MODEL_OVERRIDES_SAME:
            if value != MODEL_OVERRIDES_SAME[name]:
                why = f"nanokl's model runs {name}={MODEL_OVERRIDES_SAME[name]!r} (no dropout, SiLU, full attention)"
        elif name in _SHAPES:
            why = "it changes the model's shapes: the checkpoint's weights are read as config.json gives them"
        else:
            why = (f"nanokl's model does not read it (it applies {', '.join(MODEL_OVERRIDES)}"
                   f"{', initializer_range' if fresh_head else ''}; attn_implementation is noted)")
        if why:
            raise ConfigError(f"{k}={value!r} is not supported: {why}", keys=k)


def check_verl_keys(cfg):
    """Refuse the verl values nanokl cannot honour without changing the result (part of `validate`)."""
    for key, bad, why in _VERL_REFUSED:
        value = get_key(cfg, key)
        if bad(value):
            raise ConfigError(f"{key}={value!r} is not supported: {why}", keys=key)
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    for key, opt in ((_A + "optim", a.optim), (_C + "optim", c.optim)):
        if opt.lr_scheduler_type == "cosine" and opt.num_cycles != 0.5:
            raise ConfigError(f"{key}.num_cycles must be 0.5 (nanokl's cosine falls once, from the peak to "
                              f"min_lr_ratio), got {opt.num_cycles!r}", keys=key + ".num_cycles")
    rm, RK = cfg.reward_model, "reward_model.reward_kwargs."
    if rm.reward_manager not in REWARD_MANAGERS:
        raise ConfigError(f"reward_model.reward_manager must be one of {', '.join(REWARD_MANAGERS)}; got "
                          f"{rm.reward_manager!r} (nanokl cannot give its scores)", keys="reward_model.reward_manager")
    ob, kw, R = rm.overlong_buffer, rm.reward_kwargs, cfg.actor_rollout_ref.rollout.response_length
    if ob != kw.overlong_buffer_cfg != type(ob)():  # (resolve copies the latter when the former is unset)
        raise ConfigError(f"set only one of reward_model.overlong_buffer (the DAPO recipe's) and "
                          f"{RK}overlong_buffer_cfg (verl's dapo reward manager's): they are the same buffer",
                          keys=("reward_model.overlong_buffer", RK + "overlong_buffer_cfg"))
    if kw != type(kw)() and rm.reward_manager != "dapo":
        raise ConfigError(f"{RK[:-1]} are the dapo reward manager's arguments (verl's {rm.reward_manager} takes "
                          f"none): set reward_model.reward_manager=dapo, or use reward_model.overlong_buffer",
                          keys=(RK[:-1], "reward_model.reward_manager"))
    if kw.max_resp_len not in (None, R):
        raise ConfigError(f"{RK}max_resp_len must be {_R}response_length ({R}), where nanokl's overlong buffer "
                          f"ends, or null; got {kw.max_resp_len!r}", keys=(RK + "max_resp_len", _R + "response_length"))
    d = cfg.data
    if d.gen_batch_size != d.train_batch_size and not cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"data.gen_batch_size ({d.gen_batch_size}) is the generation round of dynamic sampling: "
                          f"without algorithm.filter_groups.enable each step trains on data.train_batch_size "
                          f"({d.train_batch_size}) prompts; leave it unset or equal",
                          keys=("data.gen_batch_size", "algorithm.filter_groups.enable"))
    _check_model_overrides(_ARR + "model.override_config", cfg.actor_rollout_ref.model.override_config, False)
    _check_model_overrides(_C + "model.override_config", c.model.override_config, True)
    for old, new in ((_A + "ppo_micro_batch_size", _A + "ppo_micro_batch_size_per_gpu"),
                     (_ARR + "ref.log_prob_micro_batch_size", _ARR + "ref.log_prob_micro_batch_size_per_gpu"),
                     (_R + "log_prob_micro_batch_size", _R + "log_prob_micro_batch_size_per_gpu"),
                     (_C + "ppo_micro_batch_size", _C + "ppo_micro_batch_size_per_gpu"),
                     (_C + "forward_micro_batch_size", _C + "forward_micro_batch_size_per_gpu"),
                     (_RM + "micro_batch_size", _RM + "micro_batch_size_per_gpu")):
        if get_key(cfg, old) is not None and get_key(cfg, new) is not None:
            raise ConfigError(f"set only one of {old} (verl's older size over all GPUs) and {new}", keys=(old, new))
    if c.enable is not None and a.objective == "ppo":
        from nanokl.advantages import ESTIMATORS
        if c.enable != ESTIMATORS[cfg.algorithm.adv_estimator].needs_critic:
            raise ConfigError(f"critic.enable={c.enable} contradicts algorithm.adv_estimator="
                              f"{cfg.algorithm.adv_estimator}: nanokl trains a critic exactly when the estimator "
                              f"needs one", keys=("critic.enable", "algorithm.adv_estimator"))
