"""Around each step: a reward function that fails inside it; after it, validation, the NaN guard,
the KL monitor's actions, the reference check, checkpoint and log; and the end of the run.

`take_step(step_fn, run, step)` runs train_ppo's step; a reward function that fails in it
(reward_fn.RewardError, on every rank) puts back the RNG and both KL controllers as they were
when the step started, saves a checkpoint of the steps done, and stops the run with one line
naming the function, the row and the checkpoint (exit 1): the resume runs the step again.

ppo_step (train_ppo.py) returns the step's metrics; `end_step(run, step, metrics)` decides what the
run does with them before the next step, in this order, and says whether the run goes on:

    validation        every trainer.test_freq steps and after the last one: held-out accuracy
                      (harness/scoring.py), its samples kept as trainer.log_val_generations and
                      trainer.validation_data_dir ask (harness/generations.py)
    the NaN guard     a step whose update was skipped (a non-finite loss or gradient) adds one to
                      run.nan_streak, a healthy one resets it; MAX_NAN_STEPS in a row: checkpoint
                      (not healthy), finish, TrainingStopped
    the KL monitor    (harness/monitor.py) warns, adjusts a knob, stops, or rolls back; the remedies
                      (harness/remedies.py) act from the next step on; a rollback with no healthy
                      checkpoint to return to stops instead
    reference check   every ref_check_freq steps, the reference's log-probs on its probe batch
                      compared with those recorded at setup (harness/ref_check.py); a change stops
    checkpoint, log   every trainer.save_freq steps and after the last (-1: never), and on a
                      preemption signal (harness/faults.py); otherwise the row alone. With a
                      checkpoint the metrics.jsonl row is logged first, then the checkpoint commits
                      (`_log_row`, run_state.save's before_commit): a crash in between leaves a row
                      without its checkpoint, which the resume drops and redoes, never a checkpoint
                      without its row. A stop (monitor, reference) saves an unhealthy checkpoint the
                      same way and ends the run; a preemption ends it after its save

A reward function that fails in validation stops the run the same way, its step done and logged.
`finish(run)` is the end of every run, however it ended: train_ppo's last line, and the NaN stop
above before it raises; it returns the run's exit status. Messages go through tqdm.write on rank 0 (`_say`), under the progress bar.
"""

import sys
import time

import torch
from tqdm import tqdm

from nanokl.harness import ref_check, remedies, summary
from nanokl.harness.checkpoint import rng_state, set_rng_state
from nanokl.harness.config.build import config_to_dict
from nanokl.harness.faults import INTERRUPTED
from nanokl.harness.generations import dump_rollout, gather, pick_val_generations
from nanokl.harness.metrics import timer
from nanokl.harness.reward_fn import RewardError
from nanokl.harness.run_state import TrainingStopped, _restore, release_lock, save
from nanokl.harness.scoring import evaluate

MAX_NAN_STEPS = 3  # consecutive steps with a skipped (non-finite) update before the run stops


def take_step(step_fn, run, step) -> dict:
    """step_fn(run, step), the step's metrics; a reward function that fails in it stops the run
    (reward_stop) with the state as the step found it, so that the resume runs the step again."""
    rng, ctrls = rng_state(), (run.kl_ctrl.state_dict(), run.kl_loss_ctrl.state_dict())
    try:
        return step_fn(run, step)
    except RewardError as e:  # no update happened (ReMax scores again after beta moved)
        set_rng_state(rng)
        run.kl_ctrl.load_state_dict(ctrls[0])
        run.kl_loss_ctrl.load_state_dict(ctrls[1])
        reward_stop(run, step, e)


def reward_stop(run, done, error, before_commit=None):
    """A reward function failed (reward_fn.RewardError, on every rank): checkpoint the `done` steps,
    as the NaN stop does, and stop with one line naming the function, the row and the checkpoint."""
    path = save(run, done, healthy=False, before_commit=before_commit)
    run.ended = (f"reward function error in step {done + 1}" if before_commit is None else
                 f"reward function error in the validation after step {done}")
    finish(run)
    if before_commit is None:  # in the step: its update had not happened, and the resume redoes it
        raise TrainingStopped(f"stopped in step {done + 1}: {error}; checkpoint saved to {path} (the "
                              f"{done} steps done: the same command resumes there and runs step "
                              f"{done + 1} again)") from None
    raise TrainingStopped(f"stopped in the validation after step {done}: {error}; checkpoint saved to "
                          f"{path} (the same command resumes after that step)") from None


def validation(run, step) -> dict:
    """scoring.evaluate() at global step `step`, keeping what it wrote as the config asks (harness/generations.py):
    trainer.log_val_generations samples to the tracker, all of them to trainer.validation_data_dir."""
    t = run.cfg.trainer
    samples = [] if t.log_val_generations > 0 or t.validation_data_dir else None
    metrics = evaluate(run.rollout_model, run.tok, run.val, run.cfg, run.device, run.ref, samples=samples)
    if samples is not None:  # every rank takes part in the gathers; rank 0 writes
        if t.log_val_generations > 0:
            run.tracker.log_generations(pick_val_generations(gather(samples), t.log_val_generations), step)
        if t.validation_data_dir:
            inputs, outputs, scores, truths = zip(*samples) if samples else ((),) * 4
            dump_rollout(t.validation_data_dir, step, inputs, outputs, truths, scores)
    return metrics


def _say(run, message):
    if run.rank == 0:
        tqdm.write(message, file=sys.stderr)


def _log_row(run, metrics, step, timed=None):
    """The step's metrics row, to be logged before its checkpoint commits (save's before_commit): a crash
    between the two then leaves a row without its checkpoint, which the resume drops and redoes, never a
    checkpoint without its row. `timed`: the row also holds timing_s/<timed>, the save's time until then."""
    if timed and run.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()

    def log():
        if timed:
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            metrics[f"timing_s/{timed}"] = time.perf_counter() - t0
        run.tracker.log(metrics, step=step)
    return log


def end_step(run, step, metrics) -> bool:
    """After step `step`: validation, the NaN guard, the KL monitor, the reference check, checkpoint and
    log (the row first, then the checkpoint commits). False ends the run."""
    t = run.cfg.trainer
    done = step + 1
    last = done == run.total_steps
    if run.profiler is not None:
        run.profiler.saw(metrics)  # its summary reads the step's timing_s/* once the step is over
    if run.val and t.test_freq > 0 and (done % t.test_freq == 0 or last):
        try:
            with timer(metrics, "testing", run.device):
                metrics.update(validation(run, done))
        except RewardError as e:  # after the update: the step is done, its row logged with it
            reward_stop(run, done, e, before_commit=lambda: run.tracker.log(metrics, step=done))
    if run.kl_ctrl.type == "adaptive" and run.cfg.algorithm.use_kl_in_reward:
        metrics["actor/target_kl"] = run.kl_ctrl.target  # moves with a schedule or an adjust
    run.nan_streak = run.nan_streak + 1 if metrics["actor/nan_skipped"] else 0
    if run.nan_streak >= MAX_NAN_STEPS:
        path = save(run, done, healthy=False, before_commit=_log_row(run, metrics, done))
        run.ended = f"NaN stop at step {done}"
        finish(run)
        raise TrainingStopped(f"stopped at step {done}: {MAX_NAN_STEPS} steps in a row had a non-finite loss "
                              f"or gradient (updates skipped); checkpoint saved to {path}")
    actions, events = set(), []
    if run.monitor:  # KL health (nanokl/harness/monitor.py): warn, adjust a knob, stop cleanly, or roll back
        events = run.monitor.check(done, metrics, remedies.knobs(run))
        metrics.update(run.monitor.metrics(), **{"monitor/health": run.monitor.health})
        actions = {e.action for e in events}
        for e in events:
            _say(run, e.message)
        remedies.apply(run, events)  # the adjusted knobs act from the next step on
        if "rollback" in actions and "stop" not in actions:
            back = remedies.rollback(run, _restore)
            if back is None:
                actions.add("stop")
                _say(run, "kl_monitor: no healthy checkpoint to roll back to; stopping")
            else:
                _say(run, f"kl_monitor: rolled back to {back} ({run.cfg.trainer.kl_monitor.rollback_recipe}); beta is "
                          f"now {run.kl_ctrl.value:.4g} ({run.kl_ctrl.type})")
    changed = ref_check.recheck(run, done, metrics)  # every ref_check_freq steps: is the reference unchanged?
    if "stop" in actions or changed:
        path = save(run, done, healthy=False, before_commit=_log_row(run, metrics, done))
        which = ", ".join(e.check for e in events if e.action == "stop") or "rollback impossible"
        run.ended = f"reference check stop at step {done}" if changed else f"kl_monitor stop at step {done} ({which})"
        if run.rank == 0 and "stop" in actions:
            print(f"kl_monitor stopped the run at step {done} (check: {which}); checkpoint saved to {path}",
                  file=sys.stderr)
        if changed:
            _say(run, f"{changed}; checkpoint saved to {path}")
        return False
    preempted = run.preempt is not None and run.preempt.requested()  # the same answer on every rank
    if (t.save_freq > 0 and (done % t.save_freq == 0 or last)) or preempted:  # save_freq -1: none, as verl
        path = save(run, done, healthy=run.monitor is None or run.monitor.rollback_safe,
                    before_commit=_log_row(run, metrics, done, timed="save_checkpoint"))
    else:
        run.tracker.log(metrics, step=done)
    if preempted and not last:
        run.ended = f"preempted after step {done}"
        _say(run, f"preempted ({run.preempt.signal or 'another rank was signalled'}): step {done} finished and "
                  f"checkpoint saved to {path}; exiting. The same command resumes from it")
        return False
    return True


def finish(run) -> int:
    """The end of a run, however it ended (main's last line; a NaN stop calls it before raising): close
    the tracker, then rank 0 writes summary.json beside metrics.jsonl and prints the summary
    (nanokl/harness/summary.py). Returns the exit status: 0, or 130 when Ctrl-C ended the run after a
    step and its checkpoint."""
    if run.profiler is not None:
        run.profiler.close()  # a trace still open: the run stopped inside a profiled step
    run.tracker.close()
    if run.rank == 0:
        summary.report(run.run_dir, config_to_dict(run.cfg), run.ended or "finished")
        release_lock(run.run_dir)  # the folder is free for the next run
    interrupted = run.ended is not None and run.preempt is not None and run.preempt.signal == "SIGINT"
    return INTERRUPTED if interrupted else 0
