"""The KL monitor's remedies, applied to a run: turn a knob, or roll back by a recipe.

nanokl/harness/monitor.py decides (which check failed, which knob moves to which value, under
cooldowns and limits); this module acts on the run's state, the same explicit objects the PPO step
reads: the two KL controllers (run.kl_ctrl: beta in the reward and its target; run.kl_loss_ctrl:
the KL loss's weight), the actor's loss settings and the optimizers' learning rates.

    knob            what it is in the run                                   restored on resume by
    kl_weight       beta (run.kl_ctrl.value), and the KL loss's weight       the controllers' state
                    (run.kl_loss_ctrl.value) scaled by the same ratio
    target_kl       the adaptive controller's target (its `scale` times      the controller's state
                    the schedule's target)
    kl_type         the KL estimator in use: actor.kl_loss_type with a KL    the monitor's `adjusted`
                    loss, else algorithm.kl_penalty
    entropy_coeff   actor.entropy_coeff, the entropy bonus                   the monitor's `adjusted`
    actor_lr,       the optimizer's base learning rate (the LR schedule      the scheduler's and the
    critic_lr       still multiplies it)                                     optimizer's state

Rollback recipes (trainer.kl_monitor.rollback_recipe), what a "rollback" action does:
  healthy    reload the last healthy checkpoint (weights and optimizer states) and raise beta to
             max(beta now, beta then, rollback_min_beta) * rollback_beta_factor (the KL loss's
             weight likewise): back to where the run was fine, held tighter.
  reference  the offline-RLHF article's recipe for KL > 0.15: reload the reference (SFT) weights
             into the actor, drop the actor's Adam moments (they belong to the weights that
             drifted), and set the learning rates to rollback_actor_lr (and rollback_critic_lr):
             start over from the reference, more slowly. beta is left as it is.
  fixed_kl   the tuning article's fallback: reload the last healthy checkpoint, freeze beta at its
             current value with a fixed controller, and arm kl_stop to stop the run (whatever
             kl_stop_action says) the next time the KL runs away.
Escalation (monitor.py, trainer.kl_monitor.escalation): when beta is at its limit and the KL is still
above kl_high_act, the adjust cuts actor_lr (kl_high_escalate) and, under "reference", reloads the
reference weights as the reference recipe does (`reload_reference`): an lr cut alone leaves a policy
that has already drifted far where it is, only moving more slowly.
The articles also suggest falling back to GRPO (dropping the critic); nanokl does not: swapping the
advantage estimator mid-run changes what every later step computes, and a run that needs it is
better restarted with algorithm.adv_estimator=grpo.
"""

from nanokl.engine import shard
from nanokl.harness.checkpoint import checkpoint_dir
from nanokl.harness import lora_run
from nanokl.kl_ctrl import FixedKLController


def _actor_cfg(run):
    return run.cfg.actor_rollout_ref.actor


def knobs(run) -> dict:
    """The current value of each knob that exists in this run."""
    a, alg, out = _actor_cfg(run), run.cfg.algorithm, {}
    if alg.use_kl_in_reward or a.use_kl_loss:
        out["kl_weight"] = run.kl_ctrl.value if alg.use_kl_in_reward else run.kl_loss_ctrl.value
        out["kl_type"] = a.kl_loss_type if a.use_kl_loss else alg.kl_penalty
    if alg.use_kl_in_reward and run.kl_ctrl.type == "adaptive":
        out["target_kl"] = run.kl_ctrl.target
    out["entropy_coeff"] = float(a.entropy_coeff)
    out["actor_lr"] = float(run.actor_sched.base_lrs[0])
    if run.critic is not None:
        out["critic_lr"] = float(run.critic_sched.base_lrs[0])
    return out


def set_lr(opt, sched, lr):
    """A new base learning rate; the LR schedule keeps multiplying it (warm-up, cosine)."""
    sched.base_lrs = [lr] * len(sched.base_lrs)
    for group, f in zip(opt.param_groups, sched.lr_lambdas):
        group["initial_lr"], group["lr"] = lr, lr * f(sched.last_epoch)


def set_knob(run, knob, old, new):
    a, alg = _actor_cfg(run), run.cfg.algorithm
    if knob == "kl_weight":  # both KL weights by the same ratio: they live on different scales
        if alg.use_kl_in_reward:
            run.kl_ctrl.set_value(new)
        if a.use_kl_loss:
            scaled = alg.use_kl_in_reward and old  # from 0 there is no ratio: both take the new value
            run.kl_loss_ctrl.set_value(run.kl_loss_ctrl.value * new / old if scaled else new)
    elif knob == "target_kl":
        run.kl_ctrl.set_target(new, old)
    elif knob == "kl_type":
        if a.use_kl_loss:
            a.kl_loss_type = new
        else:
            alg.kl_penalty = new
    elif knob == "entropy_coeff":
        a.entropy_coeff = new
    elif knob == "actor_lr":
        set_lr(run.actor_opt, run.actor_sched, new)
    elif knob == "critic_lr":
        set_lr(run.critic_opt, run.critic_sched, new)
    else:
        raise ValueError(f"unknown knob {knob!r}")


def reload_reference(run):
    """The reference (SFT) weights back into the actor, and the actor's Adam moments dropped: they
    belong to the weights that drifted. Rank 0 reads, every rank loads; the rollout copy follows."""
    if lora_run.has_adapters(run.actor):  # LoRA: the reference is the base itself; B = 0 gives it back
        lora_run.restart_from_reference(run.actor)
    else:
        shard.load_full_state_dict(run.actor, shard.full_state_dict(run.ref))
    run.actor_opt.state.clear()
    if run.rollout_copy:
        shard.sync_rollout_weights(run.rollout_model, run.actor)


def apply(run, events):
    """Turn the knobs of this step's adjust events (every rank alike: the events are the same); an
    escalation under escalation=reference also starts the actor over from the reference."""
    for e in events:
        if e.change is not None:
            set_knob(run, *e.change)
        if e.reload:
            reload_reference(run)


def restore(run):
    """After a resume: the knobs that live in the config take their adjusted values again (the
    controllers and learning rates came back with their own state)."""
    for knob in ("kl_type", "entropy_coeff"):
        if knob in run.monitor.adjusted and knob in knobs(run):
            set_knob(run, knob, None, run.monitor.adjusted[knob])


def rollback(run, restore_checkpoint):
    """Roll back by trainer.kl_monitor.rollback_recipe; returns what it reloaded (a path, or
    "the reference weights"), or None when there is nothing to roll back to.
    `restore_checkpoint(run, path, weights=True)` reloads a checkpoint (nanokl/harness/run.py)."""
    km, alg, a = run.cfg.trainer.kl_monitor, run.cfg.algorithm, _actor_cfg(run)
    if km.rollback_recipe == "reference":
        reload_reference(run)
        set_lr(run.actor_opt, run.actor_sched, km.rollback_actor_lr)
        if km.rollback_critic_lr is not None and run.critic is not None:
            set_lr(run.critic_opt, run.critic_sched, km.rollback_critic_lr)
        run.monitor.rolled_back()
        return "the reference weights"
    path = checkpoint_dir(run.run_dir, run.healthy_step)  # verl's layout, or the old checkpoints/ one
    if run.healthy_step is None or not (path / "trainer_state.pt").is_file():
        return None
    _, state = restore_checkpoint(run, path, weights=True)
    if km.rollback_recipe == "fixed_kl":
        run.kl_ctrl = FixedKLController(run.kl_ctrl.value)  # beta frozen where it is now
        run.monitor.stop_armed = True
    else:
        if alg.use_kl_in_reward:  # beta as it is now or was then, whichever is larger, times the factor
            run.kl_ctrl.set_value(max(run.kl_ctrl.value, state["kl_ctrl"]["value"], km.rollback_min_beta) *
                                  km.rollback_beta_factor)
        if a.use_kl_loss:
            run.kl_loss_ctrl.set_value(max(run.kl_loss_ctrl.value, km.rollback_min_beta) * km.rollback_beta_factor)
    run.monitor.rolled_back()
    return path
