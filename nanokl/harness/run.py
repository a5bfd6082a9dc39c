"""The run around the PPO step: setup, resume, the steps; what follows each step is harness/after_step.py.

train_ppo.py's `ppo_step` is the lesson; this module and harness/after_step.py are what let it run
for real and survive. A PPO run needs more state than the step reads: models wrapped for torchrun,
optimizers and their schedules, the two KL coefficients, the data, a tracker, a monitor, where the
last healthy checkpoint is. All of it lives in one plain `Run` object that `setup` builds and the
functions below (and after_step.py's) read and update; no trainer class hierarchy.

    run = setup(cfg)               models (policy, frozen reference, critic when the advantage
                                   estimator needs one), a rollout copy where one is needed
                                   (nanokl/engine/shard.py), optimizers, KL controllers, the task's
                                   examples; the warm start / reward model trained first when
                                   missing; the reference's storage test and its probe
                                   (harness/ref_check.py); resume from the latest checkpoint
                                   (trainer.resume_mode), once it matches what this run starts
                                   with; the folder locked for this run, an earlier run's files
                                   set aside when it starts over (harness/run_state.py)
    for step in steps(run):
        metrics = ppo_step(run, step)
        if not end_step(run, step, metrics):     (harness/after_step.py) validation every test_freq,
            break                                the NaN guard, the KL monitor (warn, adjust, stop,
                                                 roll back), the reference check every
                                                 ref_check_freq steps, checkpoint every save_freq
                                                 (and on a preemption signal), one metrics.jsonl
                                                 row (written before that step's checkpoint
                                                 commits)
    finish(run)                    (harness/after_step.py) close the tracker; the run's summary,
                                   printed and written as summary.json beside metrics.jsonl
                                   (harness/summary.py); the folder's lock released

The two KL coefficients are controllers (nanokl/kl_ctrl.py): `run.kl_ctrl` is beta in the reward
(fixed or adaptive, algorithm.kl_ctrl, following a target_kl schedule when one is given),
`run.kl_loss_ctrl` the weight of the KL loss (actor.kl_loss_coef: fixed as in verl, or adaptive,
steered by ppo_step toward actor.kl_loss_ctrl.target_kl from the step's actor/kl_loss). Both are saved in every
checkpoint and restored on resume. The KL monitor's remedies act on them and on a few other knobs
(nanokl/harness/remedies.py): an `adjust` turns one knob, a rollback follows its recipe (by
default: reload the last healthy checkpoint and raise both coefficients).

Checkpoints (nanokl/harness/checkpoint.py) hold HF-format weights, the optimizer states keyed by
parameter name (any world size can load them), and the trainer state: step, both controllers,
the monitor, the NaN streak, the last healthy step and every RNG state. Batches and sampling seeds
are pure functions of the step, so "4 steps" and "2 steps, resume, 2 steps" are bit-identical
(tests/test_train_ppo.py).
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from nanokl.engine import dist, shard
from nanokl.advantages import ESTIMATORS
from nanokl.engine.batching import Batching
from nanokl.harness import lora_run, ref_check, variants
from nanokl.harness.checkpoint import verify_checkpoint
from nanokl.harness.config.build import config_to_dict
from nanokl.harness.config.schema import Config
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.config.notes import startup_notes
from nanokl.harness.data import check_loaded, drop_overlong, steps_per_epoch
from nanokl.tasks.rows import without
from nanokl.harness.after_step import validation
from nanokl.harness.faults import Preemption, catch_preemption, check_writable, inject
from nanokl.harness.fingerprint import fingerprint_of, ranks_agree, run_record
from nanokl.harness.hf_format import from_pretrained, load_value_model, require_model_dir
from nanokl.harness.logged import read_logged
from nanokl.harness.monitor import CHECKS, KLMonitor, warmup_steps
from nanokl.harness.optim import make_optimizer
from nanokl.harness.profile import StepProfiler
from nanokl.harness.reward_fn import check_sources
from nanokl.harness.scoring import load_rm
from nanokl.harness.run_state import checkpoint_to_resume, release_lock, resume, save, take_lock
from nanokl.harness.tokenizer import Tokenizer, load_tokenizer
from nanokl.harness.tracking import Tracker
from nanokl.harness.variants import Baselines, Correct, ReadKL, Respond
from nanokl.harness.world import check_world as _check_world, pick_device
from nanokl.kl_ctrl import AdaptiveKLController, FixedKLController, make_kl_controller, make_kl_loss_controller
from nanokl.engine.fused import fuse_for_rollout
from nanokl.engine.graphs import KVBudgetError, make_engine
from nanokl.engine.model import compile_layers
from nanokl.tasks import get_task
from nanokl.forwards import rollout_log_probs_are_old

GMU = "actor_rollout_ref.rollout.gpu_memory_utilization"


@dataclass
class Run:
    """Everything a step reads and the harness keeps between steps (built by `setup`)."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    run_dir: Path
    tok: Tokenizer
    train: list[dict]
    val: list[dict]
    actor: torch.nn.Module
    ref: torch.nn.Module
    critic: torch.nn.Module | None  # None when the estimator needs no critic
    rollout_model: torch.nn.Module  # the actor itself, or a copy refreshed in place after each update
    rollout_copy: bool
    actor_opt: torch.optim.Optimizer
    actor_sched: LambdaLR
    critic_opt: torch.optim.Optimizer | None
    critic_sched: LambdaLR | None
    kl_ctrl: FixedKLController | AdaptiveKLController  # beta in the reward
    kl_loss_ctrl: FixedKLController | AdaptiveKLController  # the KL loss's weight (adaptive: actor.kl_loss_ctrl)
    rm: torch.nn.Module | None  # the learned reward model (reward_model.enable)
    monitor: KLMonitor | None
    tracker: Tracker | None
    specs: dict[str, Batching]  # how each forward / update cuts its batch into micro-batches
    total_steps: int
    bypass: bool  # pi_old's log-probs are the rollout's own (forwards.rollout_log_probs_are_old)
    # the parts of ppo_step that really vary, chosen for this config once the rest is built
    # (harness/variants.py: each type names its choices)
    respond: Respond = field(init=False)
    rollout_correction: Correct = field(init=False)
    read_kl: ReadKL = field(init=False)
    baselines: Baselines = field(init=False)
    start: int = 0
    nan_streak: int = 0
    healthy_step: int | None = None  # the last checkpoint a rollback may return to
    preempt: Preemption | None = None  # set by steps(): a SIGTERM / SIGUSR1 ends the run after its step
    ref_probe: tuple | None = None  # (probe batch, the reference's log-probs on it at start): harness/ref_check.py
    ended: str | None = None  # how the run stopped early, for its summary (None: it ran to its last step)
    record: dict | None = None  # what the run was started with, kept in every checkpoint (fingerprint.run_record)
    profiler: StepProfiler | None = None  # set by steps(): global_profiler.steps traced (harness/profile.py)


def batching_specs(cfg) -> dict:
    """verl's micro-batch knobs of each forward and update -> how it cuts its batch (batching.py)."""
    arr, c = cfg.actor_rollout_ref, cfg.critic
    a, ro, packed, packed_c = arr.actor, arr.rollout, arr.model.use_remove_padding, c.model.use_remove_padding
    fused, size = arr.model.use_fused_kernels, arr.model.fused_chunk_size  # the LM head chunked (nanokl/engine/fused.py)
    actor_chunk = size if fused or a.entropy_from_logits_with_chunking else None

    def spec(micro_size, max_tokens, dynamic, packed, chunk=None):
        return Batching(micro_size, max_tokens if dynamic else None, packed, chunk)
    return {
        "old": spec(ro.log_prob_micro_batch_size_per_gpu, ro.log_prob_max_token_len_per_gpu,
                    ro.log_prob_use_dynamic_bsz, packed, actor_chunk),
        "ref": spec(arr.ref.log_prob_micro_batch_size_per_gpu, arr.ref.log_prob_max_token_len_per_gpu,
                    arr.ref.log_prob_use_dynamic_bsz, packed, size if fused else None),
        "actor": spec(a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu, a.use_dynamic_bsz, packed,
                      actor_chunk),
        "critic": spec(c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu, c.use_dynamic_bsz, packed_c),
        "values": spec(c.forward_micro_batch_size_per_gpu or c.ppo_micro_batch_size_per_gpu,
                       c.forward_max_token_len_per_gpu, c.use_dynamic_bsz, packed_c),
    }


def setup(cfg, stages=None) -> Run:
    """Everything before the first step (see the module docstring), in a folder that no other run is
    using: rank 0 holds its lock (run_state.take_lock) until finish(), or until setup fails; a second
    run there stops with one line (exit 2) naming the first's pid. `stages(cfg, rank)` makes what the
    config asks for and is missing, before any model loads (train_ppo.py passes
    nanokl/supervised/stages.py's train_missing_stages; None: nothing is made)."""
    for key in ("default_local_dir", "rollout_data_dir", "validation_data_dir"):  # one line now, not later
        if getattr(cfg.trainer, key):
            check_writable(getattr(cfg.trainer, key), f"trainer.{key}")
    rank, _, _ = dist.init(cfg.actor_rollout_ref.nccl_timeout)  # verl's key: every collective's limit
    run_dir, problem = Path(cfg.trainer.default_local_dir), None
    if rank == 0:  # the other ranks wait for its answer
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if (note := take_lock(run_dir)) is not None:
                print(note, file=sys.stderr)
        except (UserError, OSError) as e:  # said on every rank: none waits for rank 0 forever
            problem = str(e)
    if (problem := dist.broadcast_object(problem)) is not None:
        raise UserError(problem)
    try:
        return _setup(cfg, stages)
    except BaseException:
        if rank == 0:
            release_lock(run_dir)
        raise


def _setup(cfg, stages) -> Run:
    """setup's phases, in order."""
    rank, W, device, needs_critic = start(cfg)
    if stages is not None:
        stages(cfg, rank)
    require_model_dir(cfg.actor_rollout_ref.model.path)  # the stages check it too, before they read it
    record = run_record(cfg)
    ckpt = checkpoint_to_resume(cfg, rank, record)
    tok, train, val = load_data(cfg, rank)
    models = load_models(cfg, ckpt, device, needs_critic)
    run = build_run(cfg, rank, W, device, tok, train, val, models, record)
    run.respond, run.rollout_correction, run.read_kl, run.baselines = variants.choose(run)
    resume_and_open(run, ckpt)
    return run


def start(cfg):
    """(rank, world size, device, whether a critic trains): every rank's settings agreed (fingerprint.py),
    the device chosen, the world checked against the config, the start-up notes said (rank 0), a
    resume_from_path verified, before any work."""
    alg, t = cfg.algorithm, cfg.trainer
    rank, W, _ = dist.init()  # torchrun sets RANK / WORLD_SIZE; plain python is rank 0 of 1
    ranks_agree(fingerprint_of(cfg))  # before any check one rank could fail alone, leaving the others waiting
    device = pick_device(t.device)  # and says why, once, where auto finds a GPU it cannot use
    # DPO has no advantages to estimate
    needs_critic = ESTIMATORS[alg.adv_estimator].needs_critic and cfg.actor_rollout_ref.actor.objective == "ppo"
    _check_world(cfg, W, needs_critic)
    if rank == 0:  # verl keys set to what nanokl does otherwise, controllers with nothing to steer: once each
        for line in startup_notes(cfg):
            print(line, file=sys.stderr)
    if t.resume_mode != "disable" and t.resume_from_path is not None and \
            (problem := verify_checkpoint(t.resume_from_path)) is not None:
        raise UserError(f"trainer.resume_from_path={t.resume_from_path} does not verify: {problem}")
    return rank, W, device, needs_critic


def load_data(cfg, rank):
    """(tokenizer, training examples, validation examples): the task's examples (verl's rows, scored
    by data_source, when data.task is unset), as data.* filters them, each checked where it was read
    (file:line); offline, the training prompts are the logged rows'."""
    d, arr, t = cfg.data, cfg.actor_rollout_ref, cfg.trainer
    a, ro = arr.actor, arr.rollout
    # every fresh initialisation (warm start, RM head, value head) draws from its own generator; torch's
    # global one is seeded too, so that nothing else can make a run depend on what ran before it
    torch.manual_seed(t.seed)
    tok = load_tokenizer(arr.model.tokenizer_path)
    train, val = get_task(d.task).examples(d, seed=d.seed)  # data.task None: verl's rows, scored by data_source
    if not d.return_raw_chat:  # chat prompts as text in data.prompt_template, not the model's chat template
        train, val = ([without(ex, "messages") for ex in x] for x in (train, val))  # each keeps its file:line
    train, val = _max_samples(train, d.train_max_samples, d.shuffle, d.seed), _max_samples(val, d.val_max_samples)
    if d.filter_overlong_prompts:  # as verl's RLHFDataset does after max_samples: both splits, said once each
        say = (lambda line: print(line, file=sys.stderr)) if rank == 0 else (lambda line: None)
        train = drop_overlong(train, tok, d, "training", say)
        val = drop_overlong(val, tok, d, "validation", say) if val else val
    check_sources(cfg, train + val)  # a custom reward file that does not import, or an unknown data_source
    check_loaded(cfg, tok, train, val)  # the model's positions, each prompt's length, each ground truth: file:line
    if t.val_only and not val:
        raise UserError("trainer.val_only validates and stops, but there is no validation set (data.val_files)")
    if d.offline_files:  # offline: the prompts are the logged rows' (the task still gives the held-out set)
        train = read_logged(d.offline_files, tok, template=d.prompt_template,
                            max_prompt_length=d.max_prompt_length if d.truncation == "error" else None,
                            max_response_length=ro.response_length, need_ranking=a.objective != "ppo",
                            need_truth=a.objective == "ppo" and not cfg.reward_model.enable)
    return tok, train, val


def load_models(cfg, ckpt, device, needs_critic) -> dict:
    """The policy (actor; from the checkpoint when resuming), its frozen reference, the critic when one
    trains, and the rollout's copy where one is needed, each wrapped for torchrun (nanokl/engine/shard.py);
    with the offload settings the optimizers take. Under LoRA (model.lora_rank > 0) the actor is the base
    with adapters and the reference is the actor with its adapters off (harness/lora_run.py)."""
    arr, c, t = cfg.actor_rollout_ref, cfg.critic, cfg.trainer
    a, ro = arr.actor, arr.rollout
    model_path, lora = Path(arr.model.path), lora_run.lora_enabled(cfg)
    lora_run.refuse_unsupported(cfg)
    actor_path = ckpt / "actor" if ckpt else model_path  # under LoRA: the merged export (the rollout copy's)
    over = arr.model.override_config  # verl's model.override_config: entries replacing config.json's
    actor = from_pretrained(model_path if lora else actor_path, device=device, overrides=over).train()
    actor.model.gradient_checkpointing = arr.model.enable_gradient_checkpointing
    if lora:  # the base + adapters (the checkpoint's); the reference is the actor with its adapters off
        ref = lora_run.attach(actor, cfg, ckpt)
    else:
        ref = from_pretrained(model_path, device=device, overrides=over)  # fp32, under the actor's autocast
        ref.eval().requires_grad_(False)
    critic = None
    if needs_critic:
        critic = load_value_model(ckpt / "critic" if ckpt else c.model.path, device=device, seed=t.seed,
                                  overrides=c.model.override_config).train()
        critic.model.gradient_checkpointing = c.model.enable_gradient_checkpointing
    # Rollout reads the policy's whole weights. A plain CPU actor (or a DDP replica) is used as is;
    # otherwise (CUDA: bf16; FSDP2: the weights are sharded) rollout runs a copy that is refreshed
    # in place after every update, so that its captured CUDA graphs stay valid (nanokl/engine/shard.py).
    rollout_model = actor
    rollout_copy = device.type == "cuda" or shard.sharded(a.strategy)  # fsdp2 under torchrun, even at W=1
    if rollout_copy:
        dtype = getattr(torch, ro.dtype) if device.type == "cuda" else torch.float32
        rollout_model = fuse_for_rollout(from_pretrained(actor_path, device=device, dtype=dtype,
                                                         overrides=over).eval().requires_grad_(False))
    if device.type == "cuda":  # verl's use_torch_compile: each decoder layer compiled (model.py); CUDA only
        for model, on in ((actor, a.use_torch_compile), (None if lora else ref, arr.ref.use_torch_compile),
                          (critic, a.use_torch_compile)):
            if model is not None and on:
                compile_layers(model)
    # fsdp_config's CPU offload, each (the shards' CPUOffloadPolicy, the optimizer state alone): shard.py
    a_off = shard.offload_setting("actor_rollout_ref.actor", a.strategy, device, a.fsdp_config)
    c_off = shard.offload_setting("critic.model", c.strategy, device, c.model.fsdp_config) if needs_critic else (0, 0)
    ref_off = shard.offload_setting("actor_rollout_ref.ref", arr.ref.strategy, device, arr.ref.fsdp_config, False)
    actor = shard.wrap(actor, a.strategy, device, offload=a_off[0])
    ref = ref if lora else shard.wrap(ref, arr.ref.strategy, device, trainable=False, offload=ref_off[0])
    critic = shard.wrap(critic, c.strategy, device, offload=c_off[0]) if critic is not None else None
    return dict(actor=actor, ref=ref, critic=critic, rollout_model=rollout_model, rollout_copy=rollout_copy,
                actor_offload=a_off[1], critic_offload=c_off[1])


def build_run(cfg, rank, W, device, tok, train, val, models, record) -> Run:
    """The Run: the models, their optimizers and LR schedules, both KL controllers, the reward model,
    the KL monitor, how each pass cuts its batch, and whether pi_old is the rollout's (bypass)."""
    d, alg, t, c = cfg.data, cfg.algorithm, cfg.trainer, cfg.critic
    a, ro = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    actor, critic = models["actor"], models["critic"]
    total_steps = t.total_training_steps or t.total_epochs * steps_per_epoch(len(train), d.gen_batch_size)
    actor_opt, actor_sched = make_optimizer(actor, a.optim, total_steps, models["actor_offload"])
    critic_opt, critic_sched = (make_optimizer(critic, c.optim, total_steps, models["critic_offload"])
                                if critic is not None else (None, None))
    km = t.kl_monitor
    # chosen once, for every step: the rollout's log-probs stand in for pi_old's only when the actor
    # updates every step (critic_warmup 0), since the update is what then records the entropy
    bypass = not d.offline_files and t.critic_warmup == 0 and rollout_log_probs_are_old(
        alg.rollout_correction.bypass_mode, same_numerics=not models["rollout_copy"] and device.type == "cpu",
        do_sample=ro.do_sample, temperature=ro.temperature)
    return Run(cfg=cfg, rank=rank, world=W, device=device, run_dir=Path(t.default_local_dir), tok=tok, train=train,
               val=val, actor=actor, ref=models["ref"], critic=critic, rollout_model=models["rollout_model"],
               rollout_copy=models["rollout_copy"], actor_opt=actor_opt, actor_sched=actor_sched,
               critic_opt=critic_opt, critic_sched=critic_sched, kl_ctrl=make_kl_controller(alg.kl_ctrl),
               kl_loss_ctrl=make_kl_loss_controller(a), rm=load_rm(cfg, device) if cfg.reward_model.enable else None,
               monitor=KLMonitor(km, warmup_steps(cfg)) if km.enable else None, tracker=None,
               specs=batching_specs(cfg), total_steps=total_steps, bypass=bypass, record=record)


def resume_and_open(run, ckpt) -> None:
    """The run's last phase: the reference checked (harness/ref_check.py), the checkpoint resumed, a
    healthy start saved when the monitor may roll back, the tracker opened, the CUDA-graph engine
    sized, the first validation when asked."""
    cfg, rank, W, device = run.cfg, run.rank, run.world, run.device
    d, ro, t, km = cfg.data, cfg.actor_rollout_ref.rollout, cfg.trainer, cfg.trainer.kl_monitor
    ref_check.check_setup(run)  # a reference sharing the actor's memory, or trainable: stop before any step
    run.ref_probe = ref_check.record_probe(run)  # at every start: a resumed run reloads the reference
    if ckpt:
        resume(run, ckpt)
    rollback_on = run.monitor is not None and "rollback" in {getattr(km, f"{k}_action") for k in CHECKS}
    if rollback_on and run.healthy_step is None:
        save(run, run.start)  # the starting point is healthy by definition: something to roll back to
    run.tracker = Tracker(run.run_dir, t.logger, config_to_dict(cfg), enabled=rank == 0, project=t.project_name,
                          experiment=t.experiment_name, resume_step=run.start if ckpt else None)
    if ro.use_cuda_graph:  # size the rollout's CUDA-graph engine once, for every call of the run (a no-op on CPU)
        val_rows = min(d.val_batch_size, len(run.val[rank::W])) * ro.val_kwargs.n if run.val else 0
        try:  # its cache within gpu_memory_utilization of the GPU (nanokl/engine/graphs.py: refused, not capped)
            make_engine(shard.unwrap(run.rollout_model), ro.max_batch_size or max(d.train_batch_size // W * ro.n,
                                                                                  val_rows),
                        d.max_prompt_length + ro.response_length, ro.gpu_memory_utilization, GMU)
        except KVBudgetError as e:
            raise UserError(str(e)) from None
    # said when set (verl's default is 0.5) where nothing sizes a static cache
    if rank == 0 and ro.gpu_memory_utilization != 0.5 and (device.type != "cuda" or not ro.use_cuda_graph):
        print(f"note: {GMU}={ro.gpu_memory_utilization} bounds the CUDA-graph engine's KV cache; eager decoding "
              "(CPU, use_cuda_graph=false) sizes its cache per call, unchecked", file=sys.stderr)
    if run.val and (t.val_only or (t.val_before_train and run.start == 0)):
        run.tracker.log(validation(run, run.start), step=run.start)
    if t.val_only:  # verl's trainer.val_only: the validation above is the whole run
        run.total_steps = run.start


def _max_samples(rows, n, shuffle=False, seed=0):
    """verl's data.train_max_samples / val_max_samples: n of the rows (-1: all); a seeded random
    choice when the data are shuffled, else the first n, as verl's RLHFDataset picks them."""
    if n < 0 or n >= len(rows):
        return rows
    if not shuffle:
        return rows[:n]
    picked = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n]
    return [rows[i] for i in sorted(picked.tolist())]


def steps(run):
    """The remaining global steps, with a progress bar on rank 0. While they run, SIGTERM / SIGUSR1 / SIGHUP
    (a scheduler's preemption notice, a closed terminal) and Ctrl-C only raise a flag that end_step honours
    (nanokl/harness/faults.py)."""
    run.profiler = StepProfiler(run.cfg, run.rank, run.device, run.run_dir)
    with catch_preemption(run.cfg.trainer.signal_grace_s) as run.preempt:
        for step in tqdm(range(run.start, run.total_steps), desc="ppo", initial=run.start, total=run.total_steps,
                         file=sys.stderr, disable=run.rank != 0):
            inject(step, run.rank)  # test-only faults (NANOKL_FAULT); nothing when unset
            run.kl_ctrl.follow(step / run.total_steps)  # a target_kl schedule's target for this step
            run.kl_loss_ctrl.follow(step / run.total_steps)
            with run.profiler.step(step + 1):  # verl's global step: traced when global_profiler.steps names it
                yield step

