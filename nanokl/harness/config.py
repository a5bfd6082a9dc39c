"""The config tree: every knob of nanokl, with verl's key names and defaults.

A verl user should recognize every key: `data.train_batch_size`, `actor_rollout_ref.actor.
use_kl_loss`, `algorithm.kl_ctrl.target_kl`, ... The tree is plain dataclasses (no registry,
no factory, no OmegaConf): read a field's line below to learn what it does. Where a field
has a verl counterpart it has verl's default, so the dataclass defaults *are* verl's
defaults; the runnable settings live in YAML files under `configs/`:

    configs/arith_tiny.yaml            the CPU default (built-in arithmetic task, tiny model)
    configs/presets/conservative.yaml  arith_tiny with a tighter KL target
    configs/presets/aggressive.yaml    arith_tiny with a looser KL target

Loading a config is four steps (the machinery is in `config_io.py`):

    cfg = load_config("configs/presets/conservative.yaml", ["algorithm.kl_ctrl.target_kl=0.02"])
      1. YAML files, following `defaults:` chains, deep-merged        (config_io.load_yaml_chain)
      2. `key.sub=value` overrides on top                             (config_io.apply_override)
      3. keys and types checked against the dataclasses below         (config_io.build)
      4. `resolve`: None -> derived defaults, then `validate`: impossible values rejected
                                                                       (config_rules.py)

Derived defaults. In verl, `clip_ratio_low: ${actor.clip_ratio}`-style interpolations fill
some keys from others. Here such a key is `Optional` with a `None` default, and `resolve`
fills it once, at load time, so that downstream code reads `actor.clip_ratio_low` and never
re-derives it. After `resolve`, none of those keys is None (the list is `resolve`'s body,
in config_rules.py).

Batch sizes count what verl counts: `data.train_batch_size` and `ppo_mini_batch_size` count
*prompts* (each sampled `rollout.n` times), `*_micro_batch_size_per_gpu` counts *responses*
on one GPU, `*_max_token_len_per_gpu` counts tokens on one GPU.

Every mistake (unknown key, wrong type, impossible value) is a one-line `ConfigError` that
names the dotted key and, when a file or argument set it, where: tests/test_config.py checks
each kind against the files themselves.
"""

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional, Union

import yaml

from nanokl.harness.config_io import (ConfigError, UserError, all_keys, apply_override, build,
                              load_yaml_chain, run_cli, to_dict)
from nanokl.harness.config_rules import resolve, validate

__all__ = ["Config", "ConfigError", "UserError", "run_cli", "load_config", "parse_cli", "resolve",
           "validate", "config_to_dict", "save_config", "DEFAULT_CONFIG"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "arith_tiny.yaml"

# Names owned by a lesson module (a KL estimator, a loss aggregation, an advantage estimator, a
# task) are typed `str` here; config_rules.validate checks them against the owner's list.
Strategy = Literal["none", "ddp", "fsdp2"]  # verl says fsdp/fsdp2; nanokl has one plain, one DDP, one FSDP2 path
MonitorAction = Literal["warn", "adjust", "stop", "rollback"]  # what a failing KL-monitor check does (monitor.py)


@dataclass
class DataConfig:
    train_files: Union[str, list[str], None] = None  # JSONL/Parquet prompt file(s) of a file task (gsm8k)
    val_files: Union[str, list[str], None] = None  # validation prompt file(s); None or "": no validation set
    prompt_key: str = "prompt"  # field holding the prompt (a string, or a list of chat messages)
    reward_fn_key: str = "data_source"  # field naming the rule-based scorer for that row
    max_prompt_length: int = 512  # longest prompt in tokens; longer ones follow `truncation`
    max_response_length: int = 512  # most tokens generated per response
    train_batch_size: int = 1024  # prompts per PPO step (each sampled rollout.n times)
    val_batch_size: Optional[int] = None  # prompts per validation batch; None -> train_batch_size
    shuffle: bool = True  # reshuffle the training prompts every epoch
    seed: Optional[int] = None  # shuffling seed; None -> trainer.seed
    truncation: Literal["error", "left", "right"] = "error"  # over-long prompt: raise, cut its start, cut its end
    filter_overlong_prompts: bool = False  # drop over-long prompts when loading instead
    task: str = "arith"  # the task (nanokl/tasks/): its examples, prompt, score and warm-start demonstrations
    num_train: int = 4096  # synthetic task: number of training prompts
    num_val: int = 256  # synthetic task: number of validation prompts (0: no validation)
    arith_num_operands: int = 3  # synthetic task: numbers per problem (one reasoning step per operator)
    arith_max_operand: int = 99  # synthetic task: operands are drawn from 0..arith_max_operand
    arith_ops: str = "+-"  # synthetic task: operators to draw from, any of "+-*"
    prompt_template: Literal["plain", "chatml"] = "plain"  # how a prompt is wrapped before tokenizing
    # nanokl-only: offline training. Logged-response file(s) (nanokl/harness/logged.py): step 1 draws
    # rollout.n logged responses per prompt from them instead of sampling (nanokl/offline.py)
    offline_files: Union[str, list[str], None] = None


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF-format checkpoint dir (config.json + *.safetensors); None -> sft.output_dir
    tokenizer_path: Optional[str] = None  # dir holding tokenizer.json; None -> path
    use_remove_padding: bool = False  # pack sequences without pad tokens in training forwards
    enable_gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    override_config: dict = field(default_factory=dict)  # entries replacing the checkpoint's config.json ones


@dataclass
class OptimConfig:
    RENAMED: ClassVar[dict] = {"warmup_style": "lr_scheduler_type"}  # verl's older name still accepted
    lr: float = 1e-6  # AdamW peak learning rate
    lr_warmup_steps: int = -1  # linear warm-up steps; -1 -> lr_warmup_steps_ratio * total_training_steps
    lr_warmup_steps_ratio: float = 0.0  # warm-up length as a fraction of total_training_steps
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"  # after warm-up: hold, or cosine decay
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decay rates
    total_training_steps: int = -1  # optimizer steps in the run; -1: the trainer fills it in


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = 1e-5  # the value head learns faster than the policy may move


@dataclass
class ActorConfig:
    strategy: Strategy = "none"  # none: one process; ddp: replicate; fsdp2: shard (verl: fsdp/fsdp2)
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n responses)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per forward/backward; None -> whole mini-batch
    use_dynamic_bsz: bool = False  # micro-batch by a token budget instead of a response count
    ppo_max_token_len_per_gpu: int = 16384  # that token budget, per GPU, when use_dynamic_bsz
    grad_clip: float = 1.0  # clip the global gradient norm to this
    clip_ratio: float = 0.2  # PPO's epsilon: ratio clipped to [1 - eps, 1 + eps]
    clip_ratio_low: Optional[float] = None  # lower epsilon; None -> clip_ratio
    clip_ratio_high: Optional[float] = None  # upper epsilon; None -> clip_ratio (DAPO raises it)
    clip_ratio_c: float = 3.0  # dual-clip: a negative advantage's loss is capped at c * |A|
    loss_agg_mode: str = "token-mean"  # how per-token losses become one number (ppo.LOSS_AGG_MODES)
    # nanokl-only: "ppo" (the clipped policy loss), or a pairwise preference loss on logged ranked pairs,
    # "dpo" (sigmoid) / "ipo", whose beta is algorithm.kl_ctrl's (nanokl/dpo.py; needs data.offline_files)
    loss_mode: Literal["ppo", "dpo", "ipo"] = "ppo"
    entropy_coeff: float = 0.0  # entropy bonus weight (subtracted from the loss)
    use_kl_loss: bool = False  # add kl_loss_coef * KL(pi || pi_ref) to the loss (GRPO-style)
    kl_loss_coef: float = 0.001  # weight of that KL loss
    kl_loss_type: str = "low_var_kl"  # estimator for that KL loss (kl.KL_KINDS)
    ppo_epochs: int = 1  # passes over each batch of rollouts
    shuffle: bool = False  # reshuffle responses between those passes
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class RefConfig:
    strategy: Optional[Strategy] = None  # None -> actor.strategy
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses per reference forward; None -> all
    log_prob_use_dynamic_bsz: bool = False  # micro-batch the reference forward by tokens
    log_prob_max_token_len_per_gpu: int = 16384  # that token budget, per GPU


@dataclass
class ValKwargsConfig:
    top_k: int = -1  # sample only among the k likeliest tokens; -1: off
    top_p: float = 1.0  # nucleus sampling mass; 1.0: off
    temperature: float = 0.0  # 0 with do_sample false: greedy
    n: int = 1  # responses per validation prompt
    do_sample: bool = False  # false: greedy decoding


@dataclass
class RolloutConfig:
    temperature: float = 1.0  # logits are divided by it, when sampling and in every log-prob alike
    top_k: int = -1  # sample only among the k likeliest tokens; -1: off
    top_p: float = 1.0  # nucleus sampling mass; 1.0: off
    do_sample: bool = True  # false: greedy decoding
    n: int = 1  # responses sampled per prompt (GRPO needs > 1)
    prompt_length: Optional[int] = None  # None -> data.max_prompt_length
    response_length: Optional[int] = None  # None -> data.max_response_length
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # rollout dtype on CUDA (CPU runs float32)
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses per old-log-prob forward; None -> all
    log_prob_use_dynamic_bsz: bool = False  # micro-batch that forward by tokens
    log_prob_max_token_len_per_gpu: int = 16384  # that token budget, per GPU
    use_cuda_graph: bool = True  # capture the decode step in CUDA graphs (verl: enforce_eager=False)
    max_batch_size: Optional[int] = None  # rows the CUDA-graph engine holds; None: per-rank rows x n or val chunk
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # one checkpoint serves actor, rollout and ref
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # checkpoint the value model starts from; None -> actor_rollout_ref.model.path
    tokenizer_path: Optional[str] = None  # None -> actor_rollout_ref.model.tokenizer_path
    use_remove_padding: bool = False  # pack sequences without pad tokens
    enable_gradient_checkpointing: bool = False  # recompute activations in backward
    override_config: dict = field(default_factory=dict)  # entries replacing the checkpoint's config.json ones


@dataclass
class CriticConfig:
    strategy: Optional[Strategy] = None  # None -> actor_rollout_ref.actor.strategy
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    ppo_mini_batch_size: Optional[int] = None  # prompts per critic step; None -> actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per forward/backward; None -> whole mini-batch
    use_dynamic_bsz: bool = False  # micro-batch by a token budget
    ppo_max_token_len_per_gpu: int = 32768  # that token budget in training, per GPU
    forward_max_token_len_per_gpu: int = 32768  # that token budget when computing values, per GPU
    ppo_epochs: Optional[int] = None  # passes over each batch; None -> actor's
    shuffle: bool = False  # reshuffle between passes
    grad_clip: float = 1.0  # clip the global gradient norm to this
    cliprange_value: float = 0.5  # new values are clipped to old +- this (PPO value clipping)
    loss_agg_mode: str = "token-mean"  # how per-token value losses become one number (ppo.LOSS_AGG_MODES)


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # reward model dir (HF ...ForSequenceClassification); nanokl.supervised.reward_model writes it


@dataclass
class RewardModelTrainConfig:
    """nanokl-only: how `python -m nanokl.supervised.reward_model` builds ranking data and trains the RM."""
    data_path: Optional[str] = None  # ranking JSONL to train on; built from the warm start when the file is missing
    val_data_path: Optional[str] = None  # held-out rankings (other prompts) for pairwise accuracy; built with data_path
    num_prompts: int = 2048  # built data: training prompts, n sampled responses each
    num_val_prompts: int = 256  # built data: held-out prompts (the task's validation problems)
    n: int = 4  # built data: responses sampled per prompt (temperature = rollout.temperature)
    steps: int = 300  # optimizer steps
    batch_size: int = 32  # rankings (prompts) per step; all responses of a prompt share the batch
    lr: float = 1e-4  # AdamW peak learning rate (warm-up, then cosine to 10%)
    loss: Literal["bt", "pl"] = "bt"  # Bradley-Terry over implied pairs, or listwise Plackett-Luce
    seed: int = 42  # data sampling, head init and batch order
    norm_samples: int = 512  # reference-policy samples the reward mean/std are fitted on


@dataclass
class RewardModelConfig:
    enable: bool = False  # score with a learned reward model instead of the rule-based score
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    train: RewardModelTrainConfig = field(default_factory=RewardModelTrainConfig)  # python -m nanokl.supervised.reward_model
    micro_batch_size_per_gpu: Optional[int] = None  # responses per reward-model forward; None -> all
    max_length: Optional[int] = None  # PPO scoring: the RM sees each sequence's last this-many tokens; None: all
    missing_eos_penalty: float = 0.0  # subtracted from the score of a response cut off before its EOS
    score_method: Literal["strict", "flexible"] = "strict"  # GSM8K: last '#### N' (strict) or last number


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"  # fixed beta, or beta steered toward target_kl
    kl_coef: float = 0.001  # beta: the (initial) weight of the KL penalty in the reward
    horizon: int = 10000  # adaptive: responses over which beta may move by ~20%
    # adaptive: per-token KL the controller steers toward; or a schedule [[fraction of training, target], ...]
    target_kl: Union[float, list[list[float]]] = 0.1
    target_kl_interp: Literal["step", "linear"] = "step"  # a schedule: piecewise constant, or linear between points


@dataclass
class RolloutCorrectionConfig:
    # verl's key, and verl's meaning: take pi_old's log-probs from the rollout instead of a forward of
    # the actor. verl's default is false; nanokl's "auto" turns it on only where the two are the same
    # numbers up to float error (the fp32 actor itself samples, on CPU, at the training temperature):
    # one forward fewer per step. workers.rollout_log_probs_are_old states the rule.
    bypass_mode: Union[bool, Literal["auto"]] = "auto"  # true | false | auto
    # verl's truncated importance sampling (TIS): weigh each token's policy loss by min(pi_old / mu, threshold),
    # mu = the policy that sampled it (the rollout engine; offline, the logged behaviour policy). null: off
    rollout_is: Optional[Literal["token"]] = None
    rollout_is_threshold: float = 2.0  # C, the truncation of those weights (>= 1)


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0  # discount per token
    lam: float = 1.0  # GAE lambda: 0 one-step TD, 1 Monte-Carlo
    adv_estimator: str = "gae"  # advantages.ESTIMATORS: gae (critic), grpo / rloo (group baselines, no critic)
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's std (false: Dr. GRPO)
    use_kl_in_reward: bool = False  # subtract beta * KL(pi || pi_ref) from each token's reward
    kl_penalty: str = "kl"  # estimator for that in-reward KL (kl.KL_KINDS)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class AdjustRule:
    """A KL-monitor remedy (monitor.py): when its check fails, set `knob` to knob * factor (or to `value`),
    never past `limit`, at most once per `cooldown` steps. Knobs: kl_coef, target_kl, kl_type,
    entropy_coeff, actor_lr, critic_lr (monitor.KNOBS)."""
    # setting one of these in a config drops the default rule's others: a value replaces its factor,
    # a new knob its limit (nanokl.harness.config_io.build)
    DROPS: ClassVar[dict] = {"factor": ("value",), "value": ("factor",), "knob": ("limit",)}
    knob: str = "kl_coef"
    factor: Optional[float] = None  # multiply the knob by this ...
    value: Optional[Union[float, str]] = None  # ... or set it to this (kl_type: a kl.KL_KINDS name)
    limit: Optional[float] = None  # a factor never takes the knob past this (above for > 1, below for < 1)
    cooldown: int = 10  # steps after a change of this knob before the next one


def _rule(knob, factor=None, value=None, limit=None, cooldown=10):
    return field(default_factory=lambda: AdjustRule(knob, factor, value, limit, cooldown))


@dataclass
class KLMonitorConfig:
    """nanokl-only: the KL health checks of nanokl/harness/monitor.py (the verl KL-tuning checklist), run
    on each PPO step's metrics. An action is "warn" (log it), "stop" (save and end the run cleanly)
    or "rollback" (reload the last healthy checkpoint, multiply beta by rollback_beta_factor, go on)."""
    enable: bool = False  # run the checks each step and log monitor/* metrics
    kl_low: float = 0.02  # healthy band of the mean per-token KL: below it the policy is barely moving
    kl_high: float = 0.08  # above it the policy drifts from the reference faster than beta holds it
    kl_var_max: float = 0.05  # KL variance across responses must stay below this (else a few responses carry it)
    entropy_min: float = 0.2  # mean token entropy must stay above this (else the policy is collapsing)
    reward_var_max: float = 2.0  # score variance across responses must stay below this (else suspect reward hacking)
    kl_stop: float = 0.2  # a step whose KL exceeds this counts toward the stop check
    kl_stop_patience: int = 5  # that many consecutive such steps fire the stop check
    kl_band_action: MonitorAction = "warn"  # when KL leaves [kl_low, kl_high] (expected early: KL starts at 0)
    kl_var_action: MonitorAction = "warn"  # when the KL variance check fails
    entropy_action: MonitorAction = "warn"  # when the entropy check fails
    reward_var_action: MonitorAction = "warn"  # when the reward variance check fails
    kl_stop_action: MonitorAction = "stop"  # when KL > kl_stop for kl_stop_patience steps in a row
    collapse_kl: float = 0.15  # collapse: KL above this ...
    collapse_entropy: float = 0.1  # ... while the entropy is below this
    collapse_action: MonitorAction = "warn"
    # the critic's explained variance of the returns must stay at or above this. The article says 0.8;
    # that fits dense rewards. Here the return is mostly one 0/1 score per sample, and with p(correct)
    # near 0.5 most of its variance is the sample's luck, which no value of the prompt can explain:
    # nanokl's small critic holds 0.03-0.09 on the default task, and below 0 (worse than the mean
    # return) is the failure worth a warning (3% of a healthy run's steps after the first 30)
    critic_ev_min: float = 0.0
    critic_action: MonitorAction = "warn"
    score_window: int = 5  # "the score rises": the mean of the last this-many steps beats the mean of those before
    # the remedies of `adjust` (the KL-tuning article's third column); kl_band has one per side
    kl_high_adjust: AdjustRule = _rule("kl_coef", factor=1.5, limit=1.0, cooldown=5)
    kl_low_adjust: AdjustRule = _rule("target_kl", factor=0.7, limit=0.005, cooldown=20)
    kl_var_adjust: AdjustRule = _rule("kl_type", value="low_var_kl+")
    entropy_adjust: AdjustRule = _rule("entropy_coeff", value=0.01)
    reward_var_adjust: AdjustRule = _rule("kl_coef", factor=1.5, limit=1.0, cooldown=5)
    collapse_adjust: AdjustRule = _rule("kl_coef", factor=1.2, limit=1.0, cooldown=5)
    critic_adjust: AdjustRule = _rule("critic_lr", factor=2.0, limit=1e-3, cooldown=20)
    kl_stop_adjust: AdjustRule = _rule("kl_coef", factor=2.0, limit=1.0, cooldown=5)
    # what a rollback does: reload the last healthy checkpoint and raise beta ("healthy"); reload the
    # reference weights into the actor and lower the learning rates ("reference"); or reload the last
    # healthy checkpoint, freeze beta and switch the controller to fixed, with kl_stop armed to stop ("fixed_kl")
    rollback_recipe: Literal["healthy", "reference", "fixed_kl"] = "healthy"
    rollback_actor_lr: float = 1e-6  # reference: the actor's learning rate after it
    rollback_critic_lr: Optional[float] = None  # reference: the critic's (null: unchanged)
    rollback_beta_factor: float = 2.0  # rollback: beta is multiplied by this after reloading
    rollback_min_beta: float = 0.01  # rollback: beta is first raised to at least this (0 times a factor is 0)
    max_rollbacks: int = 3  # a rollback beyond this many becomes a stop (no endless reload loop)


@dataclass
class TrainerConfig:
    project_name: str = "nanokl"  # groups runs in the logger
    experiment_name: str = "default"  # this run's name in the logger
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = field(default_factory=lambda: ["console"])
    total_epochs: int = 30  # passes over the training prompts
    total_training_steps: Optional[int] = None  # stop after this many PPO steps; None -> from total_epochs
    save_freq: int = -1  # checkpoint every this many steps and at the end; -1: never (a preemption still saves), as verl
    test_freq: int = -1  # validate every this many steps; -1: never during training
    val_before_train: bool = True  # validate once before the first step
    critic_warmup: int = 0  # steps training only the critic before the actor moves
    default_local_dir: str = "runs/nanokl"  # where checkpoints and logs go
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"  # latest checkpoint, none, or resume_from_path
    resume_from_path: Optional[str] = None  # checkpoint dir for resume_mode: resume_path
    max_actor_ckpt_to_keep: Optional[int] = None  # delete older checkpoints beyond this many; None: keep all
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    seed: int = 42  # seeds torch, numpy and python's random
    log_freq: int = 1  # print/log metrics every this many steps
    # nanokl-only: held-out prompts sampled at each validation for the on-policy KL (val-aux/kl_on_policy), the
    # check on offline runs' importance-weighted estimate (harness/scoring.py); 0: off
    val_kl_prompts: int = 0
    kl_monitor: KLMonitorConfig = field(default_factory=KLMonitorConfig)


@dataclass
class SFTConfig:
    """nanokl-only: the supervised warm start that produces the reference policy for `task`."""
    output_dir: str = "runs/arith_tiny/sft"  # where the HF-format checkpoint + tokenizer are written
    steps: int = 600  # optimizer steps
    batch_size: int = 64  # examples per step
    lr: float = 1e-3  # AdamW learning rate
    num_examples: int = 20000  # synthetic (prompt, answer) pairs to train on
    alt_answer_share: float = 0.0  # share of demonstrations ending "Answer: N", not the graded "#### N"
    vocab_size: int = 64  # must cover the synthetic task's tokenizer
    hidden_size: int = 64  # model width
    num_hidden_layers: int = 2  # decoder blocks
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 256  # SwiGLU hidden width
    max_position_embeddings: int = 64  # longest prompt + response the model is built for


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


# ---------------------------------------------------------------------------------------------
# Loading, the command line, saving
# ---------------------------------------------------------------------------------------------

def load_config(path=None, overrides=()) -> Config:
    """YAML file `path` (None: the dataclass defaults) + `key=value` overrides -> resolved Config."""
    tree, origins = ({}, {}) if path is None else load_yaml_chain(str(path))
    try:
        for arg in overrides:
            apply_override(tree, origins, arg)
        return validate(resolve(build(Config, tree, universe=all_keys(Config))))
    except ConfigError as e:
        raise e.locate(origins) from None


USAGE = "usage: [--config PATH] [key.sub=value ...]   e.g. algorithm.kl_ctrl.target_kl=0.03"


def parse_cli(argv=None, default_path=DEFAULT_CONFIG) -> Config:
    """`--config PATH` (default: configs/arith_tiny.yaml) and `key.sub=value` overrides -> Config."""
    argv = sys.argv[1:] if argv is None else list(argv)
    path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(USAGE + "\nsections: " + ", ".join(f.name for f in dataclasses.fields(Config)))
            sys.exit(0)
        if arg in ("--config", "-c"):
            if i + 1 == len(argv):
                raise ConfigError(f"{arg} needs a path; {USAGE}")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; {USAGE}")
        else:
            overrides.append(arg)
        i += 1
    return load_config(default_path if path is None else path, overrides)


def config_to_dict(cfg: Config) -> dict:
    """The config as plain dicts, lists and scalars (what save_config writes, what loggers record)."""
    return to_dict(cfg)


def save_config(cfg: Config, path) -> None:
    """Write `cfg` as YAML; `load_config(path)` gives back an equal Config."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("# nanokl config, resolved (written by nanokl.harness.config.save_config)\n")
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=None)
