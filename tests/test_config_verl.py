"""verl's own commands, unchanged: every key they pass loads, and each does what it does in verl, maps to
nanokl's knob, prints one note (what nanokl does instead), or is refused in one line naming it.

How the tests prove it. verl's PPO quickstart and GRPO example commands (the argument lists of
docs/start/quickstart.rst and examples/grpo_trainer/run_qwen2-7b.sh, copied below) go through
`parse_cli` and the world-size checks of setup; each key of notes.VERL_NOTES is set to a
value other than its default and must print exactly its own note; each refusal is checked against
a config that asks for it; the base a command starts from is checked both ways.
"""

import dataclasses
import typing

import pytest
from config_helpers import error_of

from nanokl.harness.config.schema import Config
from nanokl.harness.config.yaml_io import ConfigError
from nanokl.harness.config.load import DEFAULT_CONFIG, load_config, parse_cli
from nanokl.harness.config.yaml_io import get_key
from nanokl.harness.config.notes import VERL_NOTES, kl_term_notes, monitor_note, startup_notes
from nanokl.harness.run import _check_world, _max_samples

MODEL, DATA = "/models/Qwen2.5-0.5B-Instruct", "/data/gsm8k"

QUICKSTART = [  # docs/start/quickstart.rst, `python3 -m verl.trainer.main_ppo` replaced by train_ppo.py
    f"data.train_files={DATA}/train.parquet", f"data.val_files={DATA}/test.parquet", "data.train_batch_size=256",
    "data.max_prompt_length=512", "data.max_response_length=512", f"actor_rollout_ref.model.path={MODEL}",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-5",
    f"critic.model.path={MODEL}", "critic.ppo_micro_batch_size_per_gpu=4", "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console", "trainer.val_before_train=False", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
    "trainer.save_freq=10", "trainer.test_freq=10", "trainer.total_epochs=15"]

GRPO = [  # examples/grpo_trainer/run_qwen2-7b.sh
    "algorithm.adv_estimator=grpo", f"data.train_files={DATA}/train.parquet", f"data.val_files={DATA}/test.parquet",
    "data.train_batch_size=1024", "data.max_prompt_length=512", "data.max_response_length=1024",
    "data.filter_overlong_prompts=True", "data.truncation='error'", f"actor_rollout_ref.model.path={MODEL}",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=[\"console\",\"wandb\"]",
    "trainer.project_name='verl_grpo_example_gsm8k'", "trainer.experiment_name='qwen2_7b_function_rm'",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
    "trainer.total_epochs=15"]


def test_verl_quickstart_command_loads_on_verls_defaults(capsys):
    cfg = parse_cli(QUICKSTART)
    assert capsys.readouterr().out.strip() == "config: verl's defaults (no --config, data files given)"
    assert cfg.trainer.logger == ["console"] and cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.4
    assert cfg.data.train_files == [f"{DATA}/train.parquet"] and cfg.algorithm.adv_estimator == "gae"
    # verl's defaults, not the CPU demo's file: e.g. verl's 30 epochs, verl's clip ratio, no arith warm start
    demo = load_config(DEFAULT_CONFIG)
    assert cfg.actor_rollout_ref.actor.clip_ratio == Config().actor_rollout_ref.actor.clip_ratio
    assert cfg.trainer.default_local_dir == Config().trainer.default_local_dir != demo.trainer.default_local_dir
    _check_world(cfg, 1, needs_critic=True)  # one GPU, as the command says
    notes = startup_notes(cfg)
    assert notes == [f"note: actor_rollout_ref.rollout.name='vllm': {VERL_NOTES['actor_rollout_ref.rollout.name']}",
                     monitor_note(cfg.trainer.kl_monitor),  # the KL checklist, on by default (warn only)
                     *kl_term_notes(cfg)]  # verl's defaults have no KL term: said
    assert notes[-1].startswith("note: no KL term")


def test_verl_grpo_example_loads_and_fits_eight_gpus():
    cfg = parse_cli(GRPO)
    a = cfg.actor_rollout_ref
    assert a.actor.fsdp_config.optimizer_offload is False and a.ref.fsdp_config.param_offload is True
    assert cfg.trainer.logger == ["console", "wandb"] and a.rollout.n == 5
    _check_world(cfg, 8, needs_critic=False)
    notes = [n for n in startup_notes(cfg) if n not in kl_term_notes(cfg)]
    assert notes[-1] == monitor_note(cfg.trainer.kl_monitor)  # the KL checklist, on by default (warn only)
    keys = [line.split("=")[0].removeprefix("note: ") for line in notes[:-1]]
    assert keys == ["actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.tensor_model_parallel_size"]
    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node x trainer.nnodes = 8 x 1 = 8, but the run "
                                          r"has 4 process\(es\)"):
        _check_world(parse_cli(GRPO), 4, needs_critic=False)


def test_the_demo_and_explicit_configs_keep_their_base(capsys):
    assert parse_cli([]) == load_config(DEFAULT_CONFIG)
    assert capsys.readouterr().out.strip() == "config: configs/arith_tiny.yaml (the CPU demo)"
    # a data file on top of an explicit --config keeps that file as the base
    cfg = parse_cli(["--config", str(DEFAULT_CONFIG), "data.task=gsm8k", "data.train_files=x.jsonl"])
    assert cfg.trainer.default_local_dir == load_config(DEFAULT_CONFIG).trainer.default_local_dir
    assert capsys.readouterr().out.strip() == "config: configs/arith_tiny.yaml (the CPU demo)"


def test_data_files_without_a_model_ask_for_one():
    msg = error_of(parse_cli, ["data.train_files=train.parquet"])
    assert "actor_rollout_ref.model.path" in msg and "verl's defaults" in msg and "\n" not in msg


def _other_value(cfg, key):
    """A value for `key` other than its default, of the type its field takes."""
    value = get_key(cfg, key)
    *path, name = key.split(".")
    owner = get_key(cfg, ".".join(path)) if path else cfg
    tp = typing.get_type_hints(type(owner))[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return "other"
    if isinstance(value, dict):
        return {k: "other" for k in value} or {"x": 1}
    return [1] if "list[int]" in str(tp) else "other"  # an Optional left at None


@pytest.mark.parametrize("key", sorted(VERL_NOTES))
def test_each_noted_key_loads_and_prints_its_own_note_once(key):
    value = _other_value(Config(), key)
    text = repr(value) if isinstance(value, str) else str(value).replace(" ", "")
    try:
        cfg = load_config(None, [f"{key}={text}"])
    except ConfigError as e:  # a key whose other values nanokl refuses (e.g. a dict with enable): said in one line
        assert key in str(e) and "\n" not in str(e)
        return
    notes = [n for n in startup_notes(cfg) if n not in kl_term_notes(cfg)]  # verl's defaults: no KL term, said
    assert notes == [f"note: {key}={get_key(cfg, key)!r}: {VERL_NOTES[key]}"]


def test_every_verl_only_field_has_a_note_or_a_rule():
    """config/verl_keys.py's fields (the base classes' own) are each noted, refused, or mapped."""
    from nanokl.harness.config import verl_keys
    handled = set(VERL_NOTES) | {k for k, _, _ in verl_keys._VERL_REFUSED}
    mapped = {"clip_grad", "ppo_micro_batch_size", "log_prob_micro_batch_size", "forward_micro_batch_size",
              "forward_micro_batch_size_per_gpu", "micro_batch_size", "enable", "optimizer", "num_cycles"}

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, prefix + f.name + ".")
            elif type(obj).__mro__[1].__module__ == verl_keys.__name__ and f.name in {
                    g.name for g in dataclasses.fields(type(obj).__mro__[1])}:
                yield prefix + f.name
    missing = [k for k in walk(Config(), "") if k not in handled and k.rsplit(".", 1)[-1] not in mapped]
    assert missing == []


@pytest.mark.parametrize("override,expected", [
    ("actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.ignore_eos=True is not supported"),
    ("critic.model.lora_rank=8", "critic.model.lora_rank=8 is not supported: LoRA on the critic"),
    ("actor_rollout_ref.model.lora_adapter_path=x", "actor_rollout_ref.model.lora_adapter_path='x' is not "
     "supported: pretrained LoRA adapters"),
    ("actor_rollout_ref.model.lora_rank=-1", "actor_rollout_ref.model.lora_rank must be >= 0, got -1"),
    ("actor_rollout_ref.model.lora_alpha=0", "actor_rollout_ref.model.lora_alpha must be > 0, got 0"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn="),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
     "actor_rollout_ref.actor.policy_loss.loss_mode must be one of vanilla, gspo, cispo"),
    ("reward_model.reward_manager=gdpo", "reward_model.reward_manager must be one of naive, prime, dapo, batch"),
    ("algorithm.use_pf_ppo=true", "algorithm.use_pf_ppo=True is not supported"),
    ("actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.optimizer must be one of AdamW"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=0",
     "actor_rollout_ref.rollout.tensor_model_parallel_size must be > 0"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5",
     "actor_rollout_ref.rollout.gpu_memory_utilization must be in (0, 1]"),
    ("critic.enable=true", "critic.enable=True contradicts algorithm.adv_estimator=reinforce_plus_plus"),
    ("data.train_max_samples=0", "data.train_max_samples must be -1 (off) or > 0"),
])
def test_refused_verl_values_name_the_key_and_where(override, expected):
    msg = error_of(load_config, DEFAULT_CONFIG, [override])
    assert msg.startswith(f"argument '{override}': ") and expected in msg and "\n" not in msg


def test_refusals_from_a_file_name_its_line(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(f"defaults: [{DEFAULT_CONFIG}]\nactor_rollout_ref:\n  actor:\n    optim:\n"
                    "      lr_scheduler_type: cosine\n      num_cycles: 1.0\n")
    assert error_of(load_config, path).startswith(f"{path}:6: actor_rollout_ref.actor.optim.num_cycles must be 0.5")


def test_world_size_checks_and_verls_global_micro_batch_sizes():
    def cfg(*extra):
        return load_config(DEFAULT_CONFIG, list(extra))
    with pytest.raises(ConfigError, match="tensor_model_parallel_size \\(2\\) must divide the 1 process"):
        _check_world(cfg("actor_rollout_ref.rollout.tensor_model_parallel_size=2"), 1, True)
    with pytest.raises(ConfigError, match="trainer.n_gpus_per_node x trainer.nnodes = 4 x 2 = 8, but the run "
                                          "has 2 process"):
        _check_world(cfg("trainer.n_gpus_per_node=4", "trainer.nnodes=2"), 2, True)
    with pytest.raises(ConfigError, match="trainer.nnodes \\(3\\) must divide the run's 2"):
        _check_world(cfg("trainer.nnodes=3", "actor_rollout_ref.actor.strategy=ddp", "critic.strategy=ddp"), 2, True)
    c = cfg("actor_rollout_ref.actor.ppo_micro_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
            "critic.forward_micro_batch_size=16",
            "actor_rollout_ref.actor.strategy=ddp")
    _check_world(c, 2, needs_critic=True)
    a = c.actor_rollout_ref.actor
    assert (a.ppo_micro_batch_size, a.ppo_micro_batch_size_per_gpu) == (None, 16)
    assert c.critic.forward_micro_batch_size_per_gpu == 8
    msg = error_of(load_config, DEFAULT_CONFIG, ["actor_rollout_ref.actor.ppo_micro_batch_size=8",
                                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    assert "set only one of actor_rollout_ref.actor.ppo_micro_batch_size" in msg


def test_verl_spellings_map_to_nanokls_knobs():
    c = load_config(DEFAULT_CONFIG, ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.rollout.enforce_eager=true",
                                     "actor_rollout_ref.actor.optim.clip_grad=0.5", "trainer.logger=wandb"])
    a = c.actor_rollout_ref
    assert a.actor.strategy == a.ref.strategy == "fsdp2" and a.rollout.use_cuda_graph is False
    assert a.actor.grad_clip == 0.5 and c.trainer.logger == ["wandb"]
    # verl's own files write `warmup_style: null` beside lr_scheduler_type
    assert load_config(DEFAULT_CONFIG, ["actor_rollout_ref.actor.optim.warmup_style=null"]) == load_config(DEFAULT_CONFIG)
    rows = list(range(10))
    assert _max_samples(rows, -1) == rows and _max_samples(rows, 3) == [0, 1, 2]
    picked = _max_samples(rows, 3, shuffle=True, seed=1)
    assert len(set(picked)) == 3 and picked == _max_samples(rows, 3, shuffle=True, seed=1)


def test_a_run_without_a_kl_term_a_weightless_kl_loss_coef_and_a_long_context_say_so():
    """The tuning guide's own YAML sets actor.kl_loss_coef=0.005 with neither KL switch on: it trains with no
    KL term, which the start says in one line naming both keys, and the coefficient in another; past 2048
    tokens of context the guide's advice for it. The CPU demo and GRPO (a KL in reward or loss) say none."""
    demo = str(DEFAULT_CONFIG)
    article = load_config(demo, ["algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=false",
                                 "actor_rollout_ref.actor.kl_loss_coef=0.005", "algorithm.kl_ctrl.type=fixed"])
    notes = [n for n in startup_notes(article) if "kl" in n.lower() and "kl_monitor (the KL" not in n]
    assert len(notes) == 2, notes
    assert notes[0].startswith("note: no KL term") and "algorithm.use_kl_in_reward" in notes[0]
    assert "actor_rollout_ref.actor.use_kl_loss" in notes[0]
    assert notes[1].startswith("note: actor_rollout_ref.actor.kl_loss_coef=0.005 weighs nothing")
    for cfg in (load_config(demo), load_config(str(DEFAULT_CONFIG.parent / "grpo_arith.yaml"))):
        assert not [n for n in startup_notes(cfg) if "no KL term" in n or "weighs nothing" in n or "2048" in n]
    long = load_config(demo, ["data.max_prompt_length=1024", "data.max_response_length=1025"])
    [line] = [n for n in startup_notes(long) if "2048" in n]
    assert "2049 tokens" in line and "algorithm.kl_ctrl.type=fixed" in line and "kl_stop_action=stop" in line
    assert not [n for n in startup_notes(load_config(demo, ["data.max_prompt_length=1024",
                                                            "data.max_response_length=1024"])) if "2048" in n]


def test_lora_keys_load_at_verls_defaults_and_alone_say_they_do_nothing():
    m = Config().actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules, m.exclude_modules) == (0, 16, "all-linear", None)
    cfg = load_config(None, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
                             "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    m = cfg.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules) == (8, 32, ["q_proj", "v_proj"])
    assert not [n for n in startup_notes(cfg) if "lora" in n]
    cfg = load_config(None, ["actor_rollout_ref.model.lora_alpha=32"])
    assert [n for n in startup_notes(cfg) if "lora" in n] == [
        "note: actor_rollout_ref.model.lora_alpha=32: used only with actor_rollout_ref.model.lora_rank > 0"]
