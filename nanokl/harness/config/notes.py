"""What start-up prints about a config: a note per verl key nanokl handles otherwise, a warning
per KL controller with nothing to steer.

A verl command carries keys for machinery nanokl does not have; config/verl_keys.py holds them as
fields, so that the command loads unchanged. Set to anything but verl's default, such a key
changes nothing in nanokl's run, and silence would let the user believe it did: `startup_notes`
gives its line of `VERL_NOTES` (what nanokl does instead), printed once, on rank 0, by
harness/run.py's setup. A value nanokl cannot honour without changing the result is not noted
but refused, by verl_keys.check_verl_keys (part of rules.validate). "Not the default"
is measured against config.py's dataclasses, so this module, unlike the checks, reads `Config`.
"""

import dataclasses

from nanokl.harness.config.schema import Config
from nanokl.harness.config.yaml_io import get_key
from nanokl.tasks.rows import UserError

_A, _R, _C = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic."
_ARR, _RM, _T = "actor_rollout_ref.", "reward_model.", "trainer."
_RAY = "nanokl runs under torchrun, without Ray"
_ONE_PROC = "nanokl runs the reward model in the trainer processes, beside the policy"
_NO_HOOKS = "nanokl has no tracing hooks (timing_s/* times each stage; global_profiler.steps traces whole steps)"
_PROFILER = ("nanokl's roles share one process: global_profiler.steps (or trainer.profile_steps) traces whole "
             "steps, every role in them, with torch.profiler (none without them, as in verl); of a role's profiler "
             "only ranks, all_ranks and tool_config.torch.contents count (nanokl/harness/profile.py)")
_FSDP = ("nanokl/engine/shard.py wraps each decoder block with FSDP2, fp32 master weights under bf16 autocast; "
         "only param_offload and optimizer_offload are its to set")
_SP = "nanokl has no sequence parallelism: each GPU holds whole sequences (use_dynamic_bsz bounds memory)"
_ENT = "nanokl's chunked kernel (use_fused_kernels) recomputes each chunk's logits in backward, always"
_FUSED = "nanokl has no Liger or Triton kernels; use_fused_kernels chunks the log-probs in plain torch (nanokl/engine/fused.py)"
_CKPT = "nanokl's checkpoints hold the model, the optimizer and the trainer state, always, written synchronously"
_VLLM = "nanokl's engine decodes each batch in lockstep; this vLLM scheduler setting has no counterpart"
_WEIGHTS = "nanokl's rollout takes the actor's weights in place after each update (nanokl/engine/shard.py)"
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
        "trust_remote_code": "nanokl builds Qwen2/Llama-format models with its own code (nanokl/engine/model.py)",
        "external_lib": "nanokl builds Qwen2/Llama-format models with its own code (nanokl/engine/model.py)",
        "enable_activation_offload": "nanokl keeps activations on the GPU (enable_gradient_checkpointing saves memory)",
        "lora_alpha": _UNUSED.format("lora_rank > 0"), "target_modules": _UNUSED.format("lora_rank > 0"),
        "exclude_modules": _UNUSED.format("lora_rank > 0"), "tiled_mlp": "nanokl's MLP runs untiled",
        "use_liger": _FUSED, "fused_kernel_options": _FUSED}.items()
       if m != "critic.model" or k not in ("exclude_modules", "use_liger", "fused_kernel_options")
       if m == "critic.model" or k not in ("lora_alpha", "target_modules", "exclude_modules")},
    **{f"{p}.fsdp_config.{k}": _FSDP for p in (_A[:-1], _ARR + "ref", "critic.model")
       for k in ("offload_policy", "reshard_after_forward", "fsdp_size", "forward_prefetch", "wrap_policy",
                 "model_dtype", "dtype", "use_orig_params", "use_torch_compile", "ulysses_sequence_parallel_size",
                 "seed", "full_determinism", "entropy_from_logits_with_chunking", "entropy_checkpointing",
                 "forward_only", "strategy")},
    **{f"{o}.optimizer_impl": "nanokl's optimizer is torch.optim.AdamW" for o in (_A + "optim", _C + "optim")},
    **{f"{p}{k}": v for p in (_A, _ARR + "ref.", _C) for k, v in {
        "ulysses_sequence_parallel_size": _SP,
        "entropy_from_logits_with_chunking": "the reference computes no entropy", "entropy_checkpointing": _ENT, "profiler": _PROFILER, "router_replay": "nanokl's models are dense (no MoE router)",
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
    **dict.fromkeys([_R + "trace", _R + "prometheus"], _NO_HOOKS),
    **dict.fromkeys([_R + "profiler", _RM + "profiler"], _PROFILER),
    _ARR + "hybrid_engine": "nanokl's actor and rollout share each GPU (verl's hybrid engine), always",
    **dict.fromkeys([_RM + k for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "strategy",
                                       "ulysses_sequence_parallel_size", "use_dynamic_bsz",
                                       "forward_max_token_len_per_gpu")] +
                    [f"{_RM}model.{k}" for k in ("external_lib", "trust_remote_code", "use_shm", "use_remove_padding",
                                                  "use_fused_kernels", "fsdp_config")], _ONE_PROC),
    _RM + "model.input_tokenizer": "nanokl's reward model reads the policy's token ids as they are (no decode and "
                                    "re-tokenize): its vocabulary must be the policy's, checked when it loads",
    **dict.fromkeys([_RM + k for k in ("reward_loop_source", "reward_loop_module_path", "reward_loop_class_name",
                                       "use_reward_loop", "num_workers", "launch_reward_fn_async")],
                    "nanokl scores each batch in the trainer processes, after sampling"),
    _RM + "sandbox_fusion": "nanokl has no code sandbox: the task's rule scores",
    _RM + "rollout": "nanokl's reward model is a sequence classifier (no generative reward model)",
    _RM + "reward_manager": "nanokl calls the scorer once per response in the trainer process, as verl's naive "
                            "manager (prime: the same scores, without its process pool; dapo: the same, with "
                            "reward_kwargs' overlong penalty; batch: a custom function once per batch, with lists, "
                            "as verl's)",
    "reward_manager": "nanokl's reward manager is reward_model.reward_manager",
    "algorithm.pf_ppo": _UNUSED.format("algorithm.use_pf_ppo"),
    _RM + "overlong_buffer.log": "nanokl logs critic/overlong_penalty/* and critic/overlong_fraction whenever "
                                 "overlong_buffer.enable",
    _T + "balance_batch": "nanokl gives each rank the same number of prompts, unbalanced by length (the same metrics)",
    _T + "esi_redundant_time": "nanokl saves a checkpoint on SIGTERM / SIGUSR1 instead (nanokl/harness/faults.py)",
    _T + "default_hdfs_dir": "nanokl saves under trainer.default_local_dir only",
    _T + "del_local_ckpt_after_load": "nanokl keeps the checkpoint it resumed from",
    _T + "max_critic_ckpt_to_keep": "nanokl's checkpoints hold actor and critic together: with a critic, the larger "
                                    "of max_actor_ckpt_to_keep and max_critic_ckpt_to_keep that are set counts the "
                                    "folders kept (without one, max_actor_ckpt_to_keep alone)",
    **dict.fromkeys([_T + "ray_wait_register_center_timeout", _T + "use_legacy_worker_impl", "ray_kwargs", "ray_init",
                     "transfer_queue"], _RAY),
}


LONG_CONTEXT = 2048  # the KL-tuning guide's "long context" (its section on risks and rollback)


def startup_notes(cfg) -> list[str]:
    """One line per verl key set to something nanokl does otherwise (VERL_NOTES), one per KL
    controller with nothing to steer, one for a run with no KL term or a KL loss weight that weighs
    nothing, one for a context past LONG_CONTEXT. Printed once, on rank 0, by harness/run.py's setup."""
    defaults, lines = Config(), []
    for key, note in VERL_NOTES.items():
        value = get_key(cfg, key)
        if _differs(value, get_key(defaults, key)):
            lines.append(f"note: {key}={value!r}: {note}")
    lines += profiler_notes(cfg)  # global_profiler's keys that nanokl does otherwise (harness/profile.py)
    lines += getattr(cfg, "resolve_notes", [])  # what rules.resolve set in verl's stead (GSPO's aggregation)
    for m in (_ARR + "model", "critic.model"):
        if "attn_implementation" in get_key(cfg, m).override_config:
            lines.append(f"note: {m}.override_config.attn_implementation="
                         f"{get_key(cfg, m).override_config['attn_implementation']!r}: nanokl's attention is its own "
                         f"(nanokl/engine/attention.py): the setting picks no kernel")
    m, dm = cfg.actor_rollout_ref.model, defaults.actor_rollout_ref.model
    for k in ("lora_alpha", "target_modules", "exclude_modules"):  # LoRA's own keys, set without LoRA
        if m.lora_rank == 0 and _differs(getattr(m, k), getattr(dm, k)):
            lines.append(f"note: {_ARR}model.{k}={getattr(m, k)!r}: used only with {_ARR}model.lora_rank > 0")
    if getattr(cfg, "kl_monitor_by_default", False):  # on, and neither a config nor the command said so
        lines.append(monitor_note(cfg.trainer.kl_monitor))
    alg, a = cfg.algorithm, cfg.actor_rollout_ref.actor
    if alg.kl_ctrl.type in ("adaptive", "pi") and not alg.use_kl_in_reward and a.objective == "ppo":
        fix = ("set algorithm.use_kl_in_reward=true to penalise KL in the reward" if not a.use_kl_loss else
               f"the KL loss's coefficient has its own, {_A}kl_loss_ctrl" if a.kl_loss_ctrl.type == "adaptive" else
               f"to steer the KL loss's coefficient set {_A}kl_loss_ctrl.type=adaptive")
        lines.append(f"warning: algorithm.kl_ctrl.type={alg.kl_ctrl.type} steers beta of the in-reward KL penalty, but "
                     f"algorithm.use_kl_in_reward is false: the controller has nothing to steer; {fix}")
    lines += kl_term_notes(cfg)
    if a.kl_loss_ctrl.type == "adaptive" and not a.use_kl_loss:
        lines.append(f"warning: {_A}kl_loss_ctrl.type=adaptive steers kl_loss_coef, but {_A}use_kl_loss is false: "
                     f"the controller has nothing to steer")
    return lines


def kl_term_notes(cfg) -> list[str]:
    """What the KL-tuning guide's reader should hear at start: a PPO run with no KL term (verl's
    defaults have none: both switches off), a KL-loss weight that weighs nothing, and a context past
    LONG_CONTEXT with the guide's advice for it."""
    alg, a, lines = cfg.algorithm, cfg.actor_rollout_ref.actor, []
    if a.objective == "ppo" and not alg.use_kl_in_reward and not a.use_kl_loss:
        lines.append(f"note: no KL term: neither algorithm.use_kl_in_reward nor {_A}use_kl_loss is on, so nothing "
                     f"holds the policy near the reference (DAPO's choice); algorithm.use_kl_in_reward=true or "
                     f"{_A}use_kl_loss=true adds one")
    if not a.use_kl_loss and a.kl_loss_coef not in (0, Config().actor_rollout_ref.actor.kl_loss_coef):
        lines.append(f"note: {_A}kl_loss_coef={a.kl_loss_coef} weighs nothing: {_A}use_kl_loss is false "
                     f"({_A}use_kl_loss=true turns the KL loss on)")
    length = cfg.data.max_prompt_length + cfg.data.max_response_length
    if length > LONG_CONTEXT and a.objective == "ppo":
        lines.append(f"note: prompt + response reach {length} tokens (> {LONG_CONTEXT}), where the KL-tuning guide "
                     f"sees the KL fail as reward hacking (high reward, garbled text); it advises a fixed beta "
                     f"(algorithm.kl_ctrl.type=fixed), an early stop (trainer.kl_monitor.kl_stop_action=stop: KL > "
                     f"0.2 on 5 steps in a row), and GRPO as the fallback (algorithm.adv_estimator=grpo)")
    return lines


def monitor_note(km) -> str:
    """The start-up line of a run whose KL monitor is on by default (trainer.kl_monitor.enable not set)."""
    acts = [f"{f.name}={getattr(km, f.name)}" for f in dataclasses.fields(km)
            if f.name.endswith("_action") and getattr(km, f.name) != "warn"]
    ref = f", rechecks the reference every {km.ref_check_freq} steps" if km.ref_check_freq else ""
    mode = (f"acting where set ({', '.join(acts)}), warning elsewhere" if acts else
            "in warn mode: it logs monitor/* and warns on stderr, changing no result")
    return (f"note: trainer.kl_monitor (the KL checklist, nanokl/harness/monitor.py) is on by default, {mode}{ref}; "
            f"trainer.kl_monitor.enable=false turns it off, an action makes it act "
            f"(e.g. trainer.kl_monitor.kl_stop_action=stop, kl_band_action=adjust)")


def _differs(value, default) -> bool:
    """`value` is not `default`; for a group of settings (a dict), only the entries the default names
    count (verl's files spell out many more, at values that ask nothing), unless it names none."""
    if isinstance(value, dict) and isinstance(default, dict):
        if not default:  # a group verl leaves empty (engine kwargs): any entry asks something
            return bool(value)
        return any(_differs(value.get(k, d), d) for k, d in default.items())
    return value != default


def chosen_steps(cfg) -> tuple[list[int], str | None]:
    """(the global steps to profile, the key that chose them): global_profiler.steps, else verl's
    older trainer.profile_steps; ([], None) when neither is set. A bad value is refused in one line."""
    g = cfg.global_profiler if isinstance(cfg.global_profiler, dict) else {}
    for key, value in (("global_profiler.steps", g.get("steps")),
                       ("trainer.profile_steps", getattr(cfg.trainer, "profile_steps", None))):
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                            for s in value):
            raise UserError(f"{key}={value!r}: expected a list of global steps, counted from 1 (e.g. {key}=[1,5])")
        return sorted(set(value)), key
    return [], None


def profiler_notes(cfg) -> list[str]:
    """Start-up notes for the profiler keys nanokl accepts but does not honour (startup_notes)."""
    g = cfg.global_profiler if isinstance(cfg.global_profiler, dict) else {}
    chosen_steps(cfg)  # a bad value: refused at start-up
    lines = []
    tool = g.get("tool")
    if tool not in (None, "torch"):
        lines.append(f"note: global_profiler.tool={tool!r}: nanokl records the chosen steps with torch.profiler "
                     "(a chrome trace per step, nanokl/harness/profile.py), not " + str(tool))
    if g.get("profile_continuous_steps"):
        lines.append("note: global_profiler.profile_continuous_steps=True: nanokl writes one trace per chosen step")
    return lines
