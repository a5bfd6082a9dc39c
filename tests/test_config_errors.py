"""Config errors (nanokl/harness/config/yaml_io.py, config/rules.py): every bad input is one line naming the key.

Unknown keys name the closest valid ones; wrong types name the key and the type; a bad choice
lists the valid ones; an impossible value names the key and the bound it breaks; YAML errors point
at file and line. The expected messages are written by hand here.
"""

from pathlib import Path

import pytest

from config_helpers import error_of, write
from nanokl.harness.config.schema import Config
from nanokl.harness.config.yaml_io import ConfigError, UserError
from nanokl.harness.config.load import load_config
from nanokl.harness.config.rules import resolve, validate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "arith_tiny.yaml"


@pytest.mark.parametrize("override, expected", [
    ("algorithm.kl_ctrl.target_kll=0.1", "did you mean algorithm.kl_ctrl.target_kl"),
    ("algorithm.use_kl_loss=true", "did you mean actor_rollout_ref.actor.use_kl_loss"),
    ("critc.optim.lr=1", "unknown key 'critc'; did you mean critic"),
    ("actor_rollout_ref.actor.lr=1", "actor_rollout_ref.actor.optim.lr"),
    ("nothing_like_it=1", "valid keys in the top level: data, actor_rollout_ref"),
])
def test_unknown_key_names_the_closest_valid_ones(override, expected):
    msg = error_of(load_config, None, [override])
    assert "unknown key '" in msg
    assert expected in msg and f"argument '{override}'" in msg


@pytest.mark.parametrize("override, expected", [
    ("data.train_batch_size=abc", "data.train_batch_size expects int, got 'abc'"),
    ("data.train_batch_size=true", "data.train_batch_size expects int, got True (bool)"),  # bool is not int
    ("data.train_batch_size=64.0", "data.train_batch_size expects int"),
    ("data.shuffle=1", "data.shuffle expects bool, got 1 (int)"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr expects float"),
    ("trainer.experiment_name=2024", "trainer.experiment_name expects str"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "actor_rollout_ref.actor.optim.betas expects a list of 2"),
    ("actor_rollout_ref.actor.optim.betas=0.9", "actor_rollout_ref.actor.optim.betas expects a list of 2 float"),
    ("trainer.logger=3", "trainer.logger expects one of console, jsonl, tensorboard, wandb, mlflow, swanlab, file, clearml or a list of"),
    ("trainer.logger=consol", "trainer.logger must be one of console, jsonl, tensorboard, wandb, mlflow, swanlab, file, clearml; got 'consol'"),
    ("data.train_files=[1, 2]", "data.train_files[0] expects str, got 1 (int)"),
    ("data.train_files=3", "data.train_files expects str or a list of str or null"),
    ("actor_rollout_ref.model.override_config=[1]", "actor_rollout_ref.model.override_config expects a mapping"),
    ("algorithm=3", "algorithm is a section"),
])
def test_wrong_type_names_the_key_and_the_type(override, expected):
    assert expected in error_of(load_config, None, [override])


@pytest.mark.parametrize("override, expected", [
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator must be one of gae, grpo"),  # ... and every later estimator
    ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type must be one of fixed, adaptive"),
    ("algorithm.kl_penalty=k9", "algorithm.kl_penalty must be one of kl, k1, abs, mse, k2, low_var_kl, k3, full"),
    ("actor_rollout_ref.actor.kl_loss_type=kl++", "actor_rollout_ref.actor.kl_loss_type must be one of"),
    ("actor_rollout_ref.actor.loss_agg_mode=mean", "seq-mean-token-sum-norm"),
    ("critic.loss_agg_mode=sum", "critic.loss_agg_mode must be one of token-mean"),
    ("actor_rollout_ref.actor.strategy=megatron",
     "actor_rollout_ref.actor.strategy must be one of none, ddp, fsdp, fsdp2"),
    ("trainer.logger=[console,wandbb]", "trainer.logger[1] must be one of console, jsonl, tensorboard, wandb, mlflow, swanlab, file, clearml"),
    ("trainer.kl_monitor.kl_stop_action=panic", "trainer.kl_monitor.kl_stop_action must be one of warn, adjust, stop, rollback"),
    ("reward_model.train.loss=listnet", "reward_model.train.loss must be one of bt, pl"),
    ("data.truncation=middle", "data.truncation must be one of error, left, right"),
    ("algorithm.rollout_correction.bypass_mode=sometimes",
     "algorithm.rollout_correction.bypass_mode expects bool or one of auto, got 'sometimes'"),
])
def test_bad_choice_lists_the_valid_ones(override, expected):
    assert expected in error_of(load_config, None, [override])


@pytest.mark.parametrize("override, key", [
    ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon"),
    ("algorithm.kl_ctrl.horizon=-5", "algorithm.kl_ctrl.horizon"),
    ("algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.target_kl"),
    ("algorithm.kl_ctrl.kl_coef=-0.1", "algorithm.kl_ctrl.kl_coef"),
    ("actor_rollout_ref.actor.clip_ratio=1.2", "actor_rollout_ref.actor.clip_ratio"),
    ("actor_rollout_ref.actor.clip_ratio_low=0", "actor_rollout_ref.actor.clip_ratio_low"),
    ("actor_rollout_ref.actor.clip_ratio_high=1", "actor_rollout_ref.actor.clip_ratio_high"),
    ("actor_rollout_ref.actor.clip_ratio_c=1", "actor_rollout_ref.actor.clip_ratio_c"),
    ("algorithm.gamma=1.01", "algorithm.gamma"),
    ("algorithm.lam=-0.1", "algorithm.lam"),
    ("data.train_batch_size=0", "data.train_batch_size"),
    ("data.max_response_length=-1", "data.max_response_length"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=0", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("critic.ppo_micro_batch_size_per_gpu=0", "critic.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.temperature"),
    ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p"),
    ("actor_rollout_ref.rollout.top_k=0", "actor_rollout_ref.rollout.top_k"),
    ("actor_rollout_ref.actor.optim.lr=-1e-5", "actor_rollout_ref.actor.optim.lr"),
    ("actor_rollout_ref.actor.optim.betas=[0.9, 1.0]", "actor_rollout_ref.actor.optim.betas"),
    ("trainer.save_freq=0", "trainer.save_freq"),
    ("trainer.kl_monitor.kl_low=0.12", "trainer.kl_monitor.kl_low (0.12) must be below kl_high (0.11)"),
    ("trainer.kl_monitor.kl_high=0.03", "trainer.kl_monitor.kl_low (0.03) must be below kl_high (0.03)"),
    ("trainer.kl_monitor.kl_high_act=0.1", "kl_high_act (0.1) >= kl_high (0.11): the remedies act outside the band"),
    ("trainer.kl_monitor.kl_low_act=0.05", "kl_low_act (0.05) must be <= kl_low (0.03)"),
    ("trainer.kl_monitor.warmup_steps=-1", "trainer.kl_monitor.warmup_steps must be >= 0, got -1"),
    ("trainer.kl_monitor.ratio_out_band_max=0", "trainer.kl_monitor.ratio_out_band_max must be > 0, got 0.0"),
    ("trainer.kl_monitor.kl_low=-0.01", "trainer.kl_monitor.kl_low"),
    ("trainer.kl_monitor.kl_stop=0", "trainer.kl_monitor.kl_stop"),
    ("trainer.kl_monitor.kl_stop_patience=0", "trainer.kl_monitor.kl_stop_patience"),
    ("trainer.kl_monitor.max_rollbacks=-1", "trainer.kl_monitor.max_rollbacks"),
    ("trainer.kl_monitor.rollback_beta_factor=0.5", "trainer.kl_monitor.rollback_beta_factor"),
    ("trainer.kl_monitor.rollback_min_beta=-0.1", "trainer.kl_monitor.rollback_min_beta"),
    ("data.train_batch_size=60", "actor_rollout_ref.actor.ppo_mini_batch_size (64) must divide data.train_batch_size (60)"),
    ("critic.ppo_mini_batch_size=48", "critic.ppo_mini_batch_size (48) must divide data.train_batch_size (128)"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (5)"),
    ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n must be > 1 with algorithm.adv_estimator=grpo"),
    ("actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature"),
    ("trainer.resume_mode=resume_path", "trainer.resume_from_path must be set"),
    ("reward_model.train.n=1", "reward_model.train.n must be >= 2"),
    ("reward_model.train.steps=0", "reward_model.train.steps"),
    ("reward_model.train.lr=0", "reward_model.train.lr"),
    ("reward_model.train.num_val_prompts=-1", "reward_model.train.num_val_prompts"),
    ("sft.num_key_value_heads=3", "sft.num_key_value_heads"),
    ("sft.hidden_size=60", "sft.hidden_size"),
])
def test_impossible_value_names_the_key_and_the_argument(override, key):
    msg = error_of(load_config, TINY, [override])
    assert key in msg and f"argument '{override}'" in msg


FG, RC, OB = "algorithm.filter_groups.", "algorithm.rollout_correction.", "reward_model.overlong_buffer."


@pytest.mark.parametrize("overrides, expected", [
    ([f"{FG}enable=true", f"{FG}metric=acc"], "algorithm.filter_groups.enable keeps the prompts whose rollout.n >= 2"),
    ([f"{FG}enable=true", "actor_rollout_ref.rollout.n=2"], "algorithm.filter_groups.metric must be one of acc, score, "
                                                            "seq_reward when algorithm.filter_groups.enable"),
    ([f"{FG}enable=true", f"{FG}metric=seq_final_reward", "actor_rollout_ref.rollout.n=2"],
     "got 'seq_final_reward'"),
    ([f"{RC}rollout_rs=token_k1"], "algorithm.rollout_correction.rollout_rs_threshold must be set with"),
    ([f"{RC}rollout_rs=token_k4", f"{RC}rollout_rs_threshold=2.0"],
     "algorithm.rollout_correction.rollout_rs must list options among token_k1"),
    ([f"{RC}rollout_rs=seq_max_k2", f"{RC}rollout_rs_threshold='0.5_2.0'"],
     "algorithm.rollout_correction.rollout_rs_threshold '0.5_2.0' for seq_max_k2: k2/k3 take an upper bound only"),
    ([f"{RC}rollout_rs=token_k1,seq_max_k2", f"{RC}rollout_rs_threshold='2.0,3.0,4.0'"],
     "rollout_rs_threshold needs one spec or one per option (2)"),
    ([f"{RC}rollout_is=tokens"], "algorithm.rollout_correction.rollout_is expects one of token, sequence or null"),
    ([f"{OB}enable=true"], "reward_model.overlong_buffer.len must be in (0, 32] (the response length limit)"),
    ([f"{OB}enable=true", f"{OB}len=40", f"{OB}penalty_factor=1.0"], "got len=40"),
    ([f"{OB}enable=true", f"{OB}len=8", f"{OB}penalty_factor=-1.0"], "penalty_factor=-1.0"),
])
def test_dapo_and_rollout_correction_rules_are_one_line(overrides, expected):
    msg = error_of(load_config, TINY, overrides)
    assert expected in msg and "\n" not in msg


def test_dapo_and_rollout_correction_values_that_load():
    c = load_config(TINY, [f"{FG}enable=true", f"{FG}metric=acc", "actor_rollout_ref.rollout.n=2",
                           f"{RC}rollout_rs=token_k1,seq_max_k2", f"{RC}rollout_rs_threshold='0.5_2.0,3.0'",
                           f"{RC}rollout_is=sequence", f"{OB}enable=true", f"{OB}len=32", f"{OB}penalty_factor=1.0"])
    assert c.algorithm.rollout_correction.rollout_rs_threshold == "0.5_2.0,3.0"
    c = load_config(TINY, [f"{RC}rollout_rs=token_k2", f"{RC}rollout_rs_threshold=2"])
    assert c.algorithm.rollout_correction.rollout_rs_threshold == 2.0  # a number stays a number (str(2.0) parses)


def test_bypass_mode_true_needs_log_probs_at_the_training_temperature():
    """A greedy rollout records temperature-1 log-probs: explicit bypass is refused at another temperature,
    accepted at temperature 1 or when sampling; auto and false are always accepted (auto then recomputes)."""
    greedy = ["actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.temperature=0.7"]
    msg = error_of(load_config, TINY, ["algorithm.rollout_correction.bypass_mode=true", *greedy])
    assert "algorithm.rollout_correction.bypass_mode=true" in msg and "temperature (0.7)" in msg
    for ok in (["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.do_sample=false",
                "actor_rollout_ref.rollout.temperature=1.0"],
               ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.temperature=0.7"],
               ["algorithm.rollout_correction.bypass_mode=auto", *greedy],
               ["algorithm.rollout_correction.bypass_mode=false", *greedy]):
        load_config(TINY, ok)


@pytest.mark.parametrize("key", ["type", "target_kl"])  # a Literal field and a float field
def test_an_int_too_long_to_print_is_a_one_line_error(tmp_path, key):
    """YAML reads a hex int of any length, and Python refuses to turn one of over 4300 decimal digits into
    text: the error that names the key must not be that ValueError (found by tests/test_fuzz_config.py)."""
    path = write(tmp_path, "huge.yaml", f"""
        algorithm:
          kl_ctrl:
            {key}: 0x{"f" * 4000}
        """)
    msg = error_of(load_config, path)
    assert f"algorithm.kl_ctrl.{key}" in msg and "an integer of 16000 bits" in msg


def test_an_enabled_reward_model_needs_a_path():
    # arith_tiny names where nanokl.supervised.reward_model writes the RM, so enabling it is enough there...
    assert load_config(TINY, ["reward_model.enable=true"]).reward_model.model.path == "runs/arith_tiny/rm"
    # ...but with no path at all there is nothing to load
    msg = error_of(load_config, TINY, ["reward_model.enable=true", "reward_model.model.path=null"])
    assert "reward_model.model.path must be set when reward_model.enable is true" in msg


def test_micro_batch_must_divide_the_mini_batch_responses():
    # mini 32 prompts x n 4 = 128 responses: a micro-batch of 64 divides them, 48 does not.
    load_config(TINY, ["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"])
    error_of(load_config, TINY, ["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=48"])
    # With a token budget the count is unused, so it is not checked.
    load_config(TINY, ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"])


def test_validate_checks_a_config_built_in_code():
    cfg = resolve(Config())
    assert validate(cfg) is cfg
    cfg.algorithm.kl_ctrl.target_kl = -1.0
    assert "algorithm.kl_ctrl.target_kl must be > 0, got -1.0" in error_of(validate, cfg)


def test_yaml_errors_point_at_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths in messages are shown relative to the working directory
    path = write(tmp_path, "conf/bad.yaml", """
        defaults: [base.yaml]
        algorithm:
          gamma: 0.99
          kl_ctrl:
            target_kll: 0.05
        """)
    write(tmp_path, "conf/base.yaml", "trainer:\n  seed: 1\n  log_freq: 0\n")
    msg = error_of(load_config, path)
    assert msg.startswith("conf/bad.yaml:5: unknown key 'algorithm.kl_ctrl.target_kll'")
    assert "did you mean algorithm.kl_ctrl.target_kl" in msg
    path.write_text(path.read_text().replace("target_kll: 0.05", "target_kl: -0.05"))
    assert error_of(load_config, path).startswith("conf/bad.yaml:5: algorithm.kl_ctrl.target_kl must be > 0")
    path.write_text(path.read_text().replace("target_kl: -0.05", "type: pid"))
    assert error_of(load_config, path).startswith("conf/bad.yaml:5: algorithm.kl_ctrl.type must be one of")
    path.write_text(path.read_text().replace("type: pid", "type: fixed"))
    # The bad value sits in the file named by `defaults`, line 3.
    assert error_of(load_config, path).startswith("conf/base.yaml:3: trainer.log_freq must be > 0")
    # An override of a file's key moves the blame to the argument.
    msg = error_of(load_config, path, ["trainer.log_freq=-2"])
    assert msg.startswith("argument 'trainer.log_freq=-2': trainer.log_freq must be > 0")


def test_yaml_syntax_and_file_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = write(tmp_path, "syntax.yaml", "trainer:\n  seed: 1: 2\n  log_freq: 1\n")
    assert error_of(load_config, bad).startswith("syntax.yaml:2: YAML syntax error")
    assert "cannot read config file" in error_of(load_config, tmp_path / "missing.yaml")
    top = write(tmp_path, "top.yaml", "defaults: [nope.yaml]\n")
    assert "defaults entry 'nope.yaml' not found" in error_of(load_config, top)
    scalar = write(tmp_path, "scalar.yaml", "just a string\n")
    assert "top level must be a mapping" in error_of(load_config, scalar)
    nonstr = write(tmp_path, "nonstr.yaml", "trainer:\n  1: 2\n")
    assert "nonstr.yaml:2: keys must be strings" in error_of(load_config, nonstr)


def test_cycle_in_defaults(tmp_path):
    a = write(tmp_path, "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path, "b.yaml", "defaults: [sub/../a.yaml]\n")
    msg = error_of(load_config, a)
    assert "cycle in defaults" in msg and "a.yaml -> " in msg and "b.yaml" in msg
    me = write(tmp_path, "me.yaml", "defaults: [me.yaml]\n")
    assert "cycle in defaults" in error_of(load_config, me)


@pytest.mark.parametrize("arg", ["foo", "=3", "a..b=1", "trainer.seed"])
def test_bad_override_syntax(arg):
    msg = error_of(load_config, None, [arg])
    assert f"bad override {arg!r}: expected key.sub=value" in msg


def test_unparsable_override_value():
    assert "bad override 'trainer.logger=[console': cannot parse" in error_of(
        load_config, None, ["trainer.logger=[console"])


def test_config_error_is_a_user_error_and_a_value_error():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.kl_monitor.kl_high_adjust.knob=kl_weigth"],
     "trainer.kl_monitor.kl_high_adjust.knob must be one of kl_weight, target_kl, kl_type, entropy_coeff, actor_lr, "
     "critic_lr; got 'kl_weigth' (did you mean 'kl_weight'?)"),
    (["trainer.kl_monitor.kl_high_adjust.knob=kl_coef"],
     "trainer.kl_monitor.kl_high_adjust.knob=kl_coef is now kl_weight (beta in the reward and/or the KL loss's weight; "
     "algorithm.kl_ctrl.kl_coef is beta's start)"),
    (["actor_rollout_ref.actor.loss_mode=dpo"],
     "actor_rollout_ref.actor.loss_mode is now actor_rollout_ref.actor.objective (ppo, dpo or ipo; verl's policy loss "
     "is actor_rollout_ref.actor.policy_loss.loss_mode)"),
    (["trainer.kl_monitor.entropy_adjust.factor=2", "trainer.kl_monitor.entropy_adjust.value=0.1"],
     "trainer.kl_monitor.entropy_adjust: give exactly one of factor (multiply the knob) and value (set it)"),
    (["trainer.kl_monitor.kl_var_adjust.value=low_var"], "trainer.kl_monitor.kl_var_adjust.value must be one of"),
    (["trainer.kl_monitor.collapse_adjust.factor=-1"], "trainer.kl_monitor.collapse_adjust.factor must be > 0"),
    (["trainer.kl_monitor.critic_adjust.cooldown=-2"], "trainer.kl_monitor.critic_adjust.cooldown must be >= 0"),
    (["algorithm.kl_ctrl.target_kl=[[0.1, 0.1], [0.5, 0.03]]"], "algorithm.kl_ctrl.target_kl must be a number > 0 or a"),
    (["algorithm.kl_ctrl.target_kl=[[0, 0.1], [0.5, 0.03], [0.4, 0.02]]"], "fractions rising from 0"),
    (["algorithm.kl_ctrl.target_kl=[[0, 0.1], [0.5, 0]]"], "targets > 0"),
    (["algorithm.kl_ctrl.target_kl=-0.1"], "algorithm.kl_ctrl.target_kl must be > 0"),
])
def test_bad_remedy_rules_and_target_schedules_name_the_key(overrides, expected):
    assert expected in error_of(load_config, None, overrides)


def test_a_rule_override_keeps_the_rest_of_its_default_rule():
    mon = load_config(None, ["trainer.kl_monitor.kl_high_adjust.cooldown=2",
                             "trainer.kl_monitor.kl_low_adjust={value: 0.02}",
                             "trainer.kl_monitor.entropy_adjust={knob: kl_weight, factor: 2}"]).trainer.kl_monitor
    assert (mon.kl_high_adjust.knob, mon.kl_high_adjust.factor, mon.kl_high_adjust.limit,
            mon.kl_high_adjust.cooldown) == ("kl_weight", 1.5, 1.0, 2)
    assert (mon.kl_low_adjust.knob, mon.kl_low_adjust.factor, mon.kl_low_adjust.value) == ("target_kl", None, 0.02)
    assert (mon.entropy_adjust.knob, mon.entropy_adjust.factor, mon.entropy_adjust.value,
            mon.entropy_adjust.limit) == ("kl_weight", 2.0, None, None)
    sched = load_config(None, ["algorithm.kl_ctrl.target_kl=[[0, 0.1], [0.5, 0.03]]"]).algorithm.kl_ctrl.target_kl
    assert sched == [[0.0, 0.1], [0.5, 0.03]]
