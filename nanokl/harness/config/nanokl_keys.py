"""The nanokl-only config sections, which verl does not have: the KL monitor (trainer.kl_monitor; its
checks and remedies are nanokl/harness/monitor.py), the warm start (sft), the reward model's training
(reward_model.train), the KL loss's controller (actor_rollout_ref.actor.kl_loss_ctrl) and the
on-policy KL probe (algorithm.kl_probe). config.py's sections hold them as fields, at those paths."""

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Union

MonitorAction = Literal["warn", "adjust", "stop", "rollback"]  # what a failing KL-monitor check does (monitor.py)
HACKING_CHECKS = ("length_drift", "degenerate", "garbled", "ratio_band")  # the reward-hacking checks (harness/hacking.py)
CHECKS = ("kl_band", "kl_var", "entropy", "reward_var", "collapse", "critic", *HACKING_CHECKS,
          "kl_critical", "kl_stop")  # every check of the KL monitor, each with its `<check>_action` below; the order events come in
KNOBS = ("kl_weight", "target_kl", "kl_type", "entropy_coeff", "actor_lr", "critic_lr")  # what `adjust` may turn
RENAMED_KNOBS = {"kl_coef": "kl_weight"}  # refused by their old name, naming the new (config/rules.py)

@dataclass
class AdjustRule:
    """A KL-monitor remedy (monitor.py): when its check fails, set `knob` to knob * factor (or to `value`),
    never past `limit`, at most once per `cooldown` steps. Knobs: kl_weight, target_kl, kl_type,
    entropy_coeff, actor_lr, critic_lr (monitor.KNOBS)."""
    # setting one of these in a config drops the default rule's others: a value replaces its factor,
    # a new knob its limit (nanokl.harness.config.yaml_io.build)
    DROPS: ClassVar[dict] = {"factor": ("value",), "value": ("factor",), "knob": ("limit",)}
    knob: str = "kl_weight"
    factor: Optional[float] = None  # multiply the knob by this ...
    value: Optional[Union[float, str]] = None  # ... or set it to this (kl_type: a kl.KL_KINDS name)
    limit: Optional[float] = None  # a factor never takes the knob past this (above for > 1, below for < 1)
    cooldown: int = 10  # steps after a change of this knob before the next one


def _rule(knob, factor=None, value=None, limit=None, cooldown=10):
    return field(default_factory=lambda: AdjustRule(knob, factor, value, limit, cooldown))


@dataclass
class KLMonitorConfig:
    """nanokl-only: the KL health checks of nanokl/harness/monitor.py (the verl KL-tuning checklist), run
    on each PPO step's metrics. An action is "warn" (log it), "adjust" (turn a knob), "stop" (save and end
    the run cleanly) or "rollback" (reload the last healthy checkpoint, multiply beta by rollback_beta_factor,
    go on). On by default, every action "warn": the checks log and print but change no result; acting is
    opt-in (a config or the command sets an action)."""
    enable: bool = True  # run the checks each step and log monitor/* metrics (false: none, and no reference check)
    kl_low: float = 0.02  # healthy band of the mean per-token KL: below it the policy is barely moving
    kl_high: float = 0.08  # above it the policy drifts from the reference faster than beta holds it
    # kl_band's adjust/rollback act only beyond these (the article acts at KL > 0.15 and < 0.01); between a
    # band edge and its act threshold the band only warns. Set them to kl_high / kl_low for a band acting at its edges
    kl_high_act: float = 0.15
    kl_low_act: float = 0.01
    # quiet start: the band's low side and the critic check stay silent on steps 1..warmup_steps (the KL starts
    # at 0 and the critic untrained, by design); null: the steps an adaptive beta needs to halve or double at
    # its fastest, ceil(ln 2 / ln(1 + 0.2 N / horizon)) with N responses a step (monitor.warmup_steps)
    warmup_steps: Optional[int] = None
    kl_var_max: float = 0.05  # KL variance across responses must stay below this (else a few responses carry it)
    entropy_min: float = 0.2  # mean token entropy must stay above this (else the policy is collapsing)
    reward_var_max: float = 2.0  # score variance across responses must stay below this (else suspect reward hacking)
    kl_stop: float = 0.2  # a step whose KL exceeds this counts toward the stop check
    kl_stop_patience: int = 5  # that many consecutive such steps fire the stop check
    # one step's KL at or above this fires kl_critical at once: the level the KL-tuning guide ties to OOM and NaN
    # losses (no patience: a single step there is already the damage kl_stop waits 5 steps to confirm)
    kl_critical: float = 0.3
    kl_band_action: MonitorAction = "warn"  # when KL leaves [kl_low, kl_high] (expected early: KL starts at 0)
    kl_var_action: MonitorAction = "warn"  # when the KL variance check fails
    entropy_action: MonitorAction = "warn"  # when the entropy check fails
    reward_var_action: MonitorAction = "warn"  # when the reward variance check fails
    kl_stop_action: MonitorAction = "warn"  # when KL > kl_stop for kl_stop_patience steps in a row ("stop": early stop)
    kl_critical_action: MonitorAction = "warn"  # when KL >= kl_critical ("stop": save and end; the acting presets')
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
    # reward hacking (nanokl/harness/hacking.py)
    length_drift_min: float = 0.1  # mean response length up more than this (relative, window over window) ...
    length_drift_action: MonitorAction = "warn"  # ... while the score rises and the truth does not
    repetition_max: float = 0.5  # degenerate: mean share of repeated 3-grams per response above this ...
    length_limit_max: float = 0.5  # ... or the share of responses hitting the length limit above this
    degenerate_action: MonitorAction = "warn"
    # garbled: "reward up, text garbled" (the KL-tuning guide): the repeated-3-gram share up by more than this
    # (absolute; the mean of the last score_window steps over those before) while the score rises
    garbled_rise_min: float = 0.1
    garbled_action: MonitorAction = "warn"
    ratio_out_band_max: float = 0.2  # share of tokens whose pi/pi_old leaves [0.8, 1.2] must stay at most this
    ratio_band_action: MonitorAction = "warn"
    score_window: int = 5  # "the score rises": the mean of the last this-many steps beats the mean of those before
    # the remedies of `adjust` (the KL-tuning article's third column); kl_band has one per side
    kl_high_adjust: AdjustRule = _rule("kl_weight", factor=1.5, limit=1.0, cooldown=5)
    # escalation when KL > kl_high_act and kl_high_adjust's knob sits at its limit: "lr" cuts the actor's
    # learning rate by kl_high_escalate; "reference" (the offline article's remedy for KL > 0.15) also reloads
    # the reference weights into the actor and drops its Adam moments at each cut; "none" never escalates
    escalation: Literal["none", "lr", "reference"] = "reference"
    kl_high_escalate: AdjustRule = _rule("actor_lr", factor=0.5, limit=1e-6, cooldown=5)
    kl_low_adjust: AdjustRule = _rule("target_kl", factor=0.7, limit=0.005, cooldown=20)
    kl_var_adjust: AdjustRule = _rule("kl_type", value="low_var_kl+")
    entropy_adjust: AdjustRule = _rule("entropy_coeff", value=0.01)
    reward_var_adjust: AdjustRule = _rule("kl_weight", factor=1.5, limit=1.0, cooldown=5)
    collapse_adjust: AdjustRule = _rule("kl_weight", factor=1.2, limit=1.0, cooldown=5)
    critic_adjust: AdjustRule = _rule("critic_lr", factor=2.0, limit=1e-3, cooldown=20)
    length_drift_adjust: AdjustRule = _rule("kl_weight", factor=1.5, limit=1.0, cooldown=5)
    degenerate_adjust: AdjustRule = _rule("kl_weight", factor=1.5, limit=1.0, cooldown=5)
    garbled_adjust: AdjustRule = _rule("kl_weight", factor=1.5, limit=1.0, cooldown=5)
    ratio_band_adjust: AdjustRule = _rule("actor_lr", factor=0.5, limit=1e-6, cooldown=10)
    kl_critical_adjust: AdjustRule = _rule("kl_weight", factor=2.0, limit=1.0, cooldown=5)
    kl_stop_adjust: AdjustRule = _rule("kl_weight", factor=2.0, limit=1.0, cooldown=5)
    # what a rollback does: reload the last healthy checkpoint and raise beta ("healthy"); reload the
    # reference weights into the actor and lower the learning rates ("reference"); or reload the last
    # healthy checkpoint, freeze beta and switch the controller to fixed, with kl_stop armed to stop ("fixed_kl")
    rollback_recipe: Literal["healthy", "reference", "fixed_kl"] = "healthy"
    rollback_actor_lr: float = 1e-6  # reference: the actor's learning rate after it
    rollback_critic_lr: Optional[float] = None  # reference: the critic's (null: unchanged)
    rollback_beta_factor: float = 2.0  # rollback: beta is multiplied by this after reloading
    rollback_min_beta: float = 0.01  # rollback: beta is first raised to at least this (0 times a factor is 0)
    max_rollbacks: int = 3  # a rollback beyond this many becomes a stop (no endless reload loop)
    # the reference's consistency (nanokl/harness/ref_check.py): its log-probs on a fixed probe batch, recorded at
    # start, are recomputed every this-many steps and must be bit-equal, else the run stops naming the likely cause
    # (0: never; only with enable; the storage test at setup runs regardless). One forward of 8 short rows: on the
    # default run ~1% of a step's time, so every 10 steps ~0.1%; a shared reference is caught within 10 steps
    ref_check_freq: int = 10


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
class KLLossCtrlConfig:
    """nanokl-only: actor.kl_loss_coef fixed (verl), or steered toward target_kl by the KL loss's mean (kl_ctrl.py)."""
    type: Literal["fixed", "adaptive"] = "fixed"  # adaptive: the coefficient starts at kl_loss_coef and moves
    horizon: int = 10000  # responses over which the coefficient may move by ~20%
    target_kl: Union[float, list[list[float]]] = 0.1  # per-token KL loss (actor/kl_loss) to steer toward, or a schedule
    target_kl_interp: Literal["step", "linear"] = "step"  # a schedule: piecewise constant, or linear between points


@dataclass
class KLProbeConfig:
    """nanokl-only: the on-policy KL probe (nanokl/kl_probe.py). Every `every` steps the policy samples
    `prompts` of the step's training prompts; the reward's KL controller and the KL monitor then read the
    step's KL estimate plus the smoothed gap probe - estimate (meant for offline runs: data.offline_files)."""
    enable: bool = False
    every: int = 1  # probe every this many steps (the gap is held in between)
    prompts: int = 16  # prompts sampled per probe, one response each (at most data.train_batch_size)
    ema: float = 0.3  # alpha: the weight of the newest gap in its moving average, in (0, 1]
