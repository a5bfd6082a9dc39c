"""nanokl.harness.remedies on a stand-in run: what each knob is, how a change lands in the run's state
objects, the learning-rate schedule after a new base lr (against LambdaLR's own formula), and the
config knobs restored from the monitor's record after a resume."""

from types import SimpleNamespace

import pytest
import torch

from nanokl.harness import remedies
from nanokl.kl_ctrl import AdaptiveKLController, FixedKLController


def fake_run(use_kl_in_reward=True, use_kl_loss=False):
    actor = SimpleNamespace(kl_loss_type="low_var_kl", use_kl_loss=use_kl_loss, entropy_coeff=0.0)
    alg = SimpleNamespace(use_kl_in_reward=use_kl_in_reward, kl_penalty="kl")
    cfg = SimpleNamespace(actor_rollout_ref=SimpleNamespace(actor=actor), algorithm=alg)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1e-3)
    warm = 4
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm))
    return SimpleNamespace(cfg=cfg, kl_ctrl=AdaptiveKLController(0.05, [[0, 0.1], [0.5, 0.03]], 640),
                           kl_loss_ctrl=FixedKLController(0.001), actor_opt=opt, actor_sched=sched, critic=None,
                           monitor=SimpleNamespace(adjusted={}))


def test_knobs_are_the_run_state():
    run = fake_run()
    assert remedies.knobs(run) == {"kl_weight": 0.05, "kl_type": "kl", "target_kl": 0.1, "entropy_coeff": 0.0,
                                   "actor_lr": 1e-3}
    loss_only = fake_run(use_kl_in_reward=False, use_kl_loss=True)
    assert remedies.knobs(loss_only)["kl_weight"] == 0.001 and remedies.knobs(loss_only)["kl_type"] == "low_var_kl"
    assert "target_kl" not in remedies.knobs(loss_only)  # no controller target without a KL in the reward


def test_changes_land_in_the_state_objects():
    run = fake_run(use_kl_loss=True)
    remedies.set_knob(run, "kl_weight", 0.05, 0.075)
    assert run.kl_ctrl.value == 0.075 and run.kl_loss_ctrl.value == pytest.approx(0.0015)  # the same ratio
    remedies.set_knob(run, "target_kl", 0.1, 0.07)
    run.kl_ctrl.follow(0.6)  # the scale carries into the schedule's next phase
    assert run.kl_ctrl.target == pytest.approx(0.7 * 0.03)
    remedies.set_knob(run, "kl_type", "low_var_kl", "low_var_kl+")
    remedies.set_knob(run, "entropy_coeff", 0.0, 0.01)
    assert run.cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl+"  # the KL loss's, as it is in use
    assert run.cfg.actor_rollout_ref.actor.entropy_coeff == 0.01
    zero = fake_run(use_kl_loss=True)
    zero.kl_ctrl.value = 0.0
    remedies.set_knob(zero, "kl_weight", 0.0, 0.02)  # from 0: no ratio to keep
    assert zero.kl_loss_ctrl.value == 0.02


def test_a_new_base_lr_keeps_the_schedule():
    run = fake_run()
    for _ in range(2):
        run.actor_opt.step()
        run.actor_sched.step()
    remedies.set_lr(run.actor_opt, run.actor_sched, 4e-4)
    assert run.actor_opt.param_groups[0]["lr"] == pytest.approx(4e-4 * 3 / 4)  # step 2 of a 4-step warm-up
    run.actor_opt.step()
    run.actor_sched.step()
    assert run.actor_opt.param_groups[0]["lr"] == pytest.approx(4e-4)
    assert run.actor_sched.state_dict()["base_lrs"] == [4e-4]  # saved with the checkpoint


def test_restore_reapplies_the_config_knobs():
    run = fake_run()
    run.monitor.adjusted = {"kl_type": "low_var_kl+", "entropy_coeff": 0.01, "kl_weight": 0.3}
    remedies.restore(run)
    assert run.cfg.algorithm.kl_penalty == "low_var_kl+"  # no KL loss: the in-reward estimator
    assert run.cfg.actor_rollout_ref.actor.entropy_coeff == 0.01
    assert run.kl_ctrl.value == 0.05  # beta comes back with the controller's own state, not from here
