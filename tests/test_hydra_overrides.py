"""Hydra's override grammar as verl's scripts write it, `${a.b}` interpolation, `~` in paths, and the keys of
verl's DAPO and GSPO scripts (issue 41, items 1 and 2, and item 7's `~`).

Each test parses a command line (or a file and a command line) and checks the resolved config, or the one
line a mistake gets. The last tests run the three scripts' argument lists verbatim (shell variables filled
in, as bash would) through `parse_cli`, and check which keys print a start-up note.
"""

import json
import os

import pytest
from config_helpers import error_of, write

from nanokl.harness.config.schema import Config
from nanokl.harness.config.yaml_io import run_cli
from nanokl.harness.config.load import DEFAULT_CONFIG, load_config, parse_cli
from nanokl.harness.config.notes import kl_term_notes, startup_notes

A, RK = "actor_rollout_ref.actor.", "reward_model.reward_kwargs."
VERL = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m"]  # a verl command: verl's defaults


# --------------------------------------------------------------------------- +key, ++key, ~key

def test_plus_adds_a_known_key_that_nothing_set():
    cfg = parse_cli(VERL + ["+actor_rollout_ref.actor.optim.lr=2e-6", "+data.gen_batch_size=1024",
                            "+actor_rollout_ref.model.override_config.max_position_embeddings=32768"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 2e-6 and cfg.data.gen_batch_size == 1024
    assert cfg.actor_rollout_ref.model.override_config == {"max_position_embeddings": 32768}
    # a verl command is recognised through + as well
    assert parse_cli(["+data.train_files=/d/t.parquet", "+actor_rollout_ref.model.path=/m"]).data.train_files == \
        ["/d/t.parquet"]


def test_plus_on_a_key_already_set_is_refused_naming_where():
    msg = error_of(load_config, DEFAULT_CONFIG, ["+data.train_batch_size=64"])
    assert msg.startswith("argument '+data.train_batch_size=64': +data.train_batch_size adds a key that is not set")
    assert "configs/arith_tiny.yaml:20" in msg and "++data.train_batch_size" in msg
    msg = error_of(load_config, None, ["+trainer.seed=1", "+trainer.seed=2"])
    assert "already set at argument '+trainer.seed=1'" in msg


def test_plus_on_an_unknown_key_is_refused_as_today():
    msg = error_of(load_config, None, ["+actor_rollout_ref.actor.optim.lrr=1e-6"])
    assert "unknown key 'actor_rollout_ref.actor.optim.lrr'; did you mean actor_rollout_ref.actor.optim.lr" in msg
    assert msg.startswith("argument '+actor_rollout_ref.actor.optim.lrr=1e-6'")


def test_double_plus_sets_whether_or_not_the_key_is_set():
    assert load_config(DEFAULT_CONFIG, ["++data.train_batch_size=64"]).data.train_batch_size == 64
    assert load_config(None, ["++trainer.seed=3"]).trainer.seed == 3


def test_tilde_deletes_a_key_back_to_nanokls_default(tmp_path):
    path = write(tmp_path, "c.yaml", f"""
        defaults: [{DEFAULT_CONFIG}]
        trainer: {{seed: 7}}
        actor_rollout_ref:
          model:
            override_config: {{max_position_embeddings: 64, rope_theta: 10000.0}}
        """)
    cfg = load_config(path, ["~trainer.seed", "~data.train_batch_size=128",
                             "~actor_rollout_ref.model.override_config.rope_theta"])
    assert cfg.trainer.seed == 42 == Config().trainer.seed
    assert cfg.data.train_batch_size == Config().data.train_batch_size == 1024
    assert cfg.actor_rollout_ref.model.override_config == {"max_position_embeddings": 64}
    # a whole section, and a key already at its default
    assert load_config(path, ["~trainer"]).trainer.project_name == "verl_examples"  # verl's default
    assert load_config(None, ["~trainer.seed"]) == load_config(None)


def test_tilde_with_the_wrong_value_or_an_unknown_key_is_refused():
    msg = error_of(load_config, DEFAULT_CONFIG, ["~data.train_batch_size=64"])
    assert msg == ("argument '~data.train_batch_size=64': ~data.train_batch_size=64: data.train_batch_size is 128, "
                   "not 64 (nothing deleted)")
    msg = error_of(load_config, None, ["~trainer.experiment_nam"])
    assert "no such key to delete; did you mean trainer.experiment_name" in msg


def test_a_bad_override_names_hydras_forms():
    assert "Hydra's +key=value, ++key=value, ~key" in error_of(load_config, None, ["+data.seed"])


# --------------------------------------------------------------------------- ${a.b}

def test_interpolation_against_the_final_config_in_any_order():
    cfg = parse_cli(VERL + ["trainer.default_local_dir='checkpoints/${trainer.project_name}/${trainer.experiment_name}'",
                            "trainer.project_name=p", "trainer.experiment_name=e",
                            "trainer.rollout_data_dir=${trainer.default_local_dir}/rollouts",
                            "data.val_batch_size=${data.train_batch_size}", "trainer.validation_data_dir=${.rollout_data_dir}"])
    t = cfg.trainer
    assert t.default_local_dir == "checkpoints/p/e" and t.rollout_data_dir == "checkpoints/p/e/rollouts"
    assert t.validation_data_dir == t.rollout_data_dir
    assert cfg.data.val_batch_size == 1024 and type(cfg.data.val_batch_size) is int  # the value, typed
    # a default that is itself an interpolation resolves against the run's own names
    assert load_config(None, ["trainer.project_name=q", "trainer.rollout_data_dir=${trainer.default_local_dir}"]) \
        .trainer.rollout_data_dir == "checkpoints/q/gsm8k"
    assert load_config(None, [r"trainer.project_name=a\${b}"]).trainer.project_name == "a${b}"  # escaped


def test_interpolation_in_a_file_sees_the_command_line(tmp_path):
    path = write(tmp_path, "c.yaml", f"""
        defaults: [{DEFAULT_CONFIG}]
        trainer:
          default_local_dir: runs/${{trainer.experiment_name}}/seed${{trainer.seed}}
        """)
    assert load_config(path, ["trainer.seed=3"]).trainer.default_local_dir == "runs/arith_tiny/seed3"


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.default_local_dir=x/${trainer.nope}"],
     "argument 'trainer.default_local_dir=x/${trainer.nope}': trainer.default_local_dir: ${trainer.nope} refers to no "
     "key"),
    (["trainer.project_name=${trainer.experiment_name}", "trainer.experiment_name=${trainer.project_name}"],
     "interpolation cycle: trainer.project_name -> trainer.experiment_name -> trainer.project_name"),
    (["data.seed=${data.seed}"], "interpolation cycle: data.seed -> data.seed"),
    (["trainer.project_name=${oc.env:HOME}"], "resolvers such as oc.env are not supported"),
])
def test_a_reference_to_no_key_or_a_cycle_is_one_line(overrides, expected):
    assert expected in error_of(load_config, None, overrides)


def test_a_bad_reference_on_the_command_line_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        run_cli(parse_cli, VERL + ["trainer.default_local_dir=${trainer.projectname}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "${trainer.projectname} refers to no key" in err


# --------------------------------------------------------------------------- ~ in paths

def test_tilde_in_every_path_is_the_users_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["data.train_files=~/gsm8k/train.parquet", "data.val_files=[~/gsm8k/test.parquet, /x]",
                             "actor_rollout_ref.model.path=~/models/q", "critic.model.path=~/models/c",
                             "trainer.default_local_dir=~/ckpt/${trainer.project_name}",
                             "custom_reward_function.path=~/rf.py", "reward_model.model.path=~/rm",
                             "data.offline_files=~/logged.jsonl", "trainer.resume_from_path=~/ckpt/global_step_1"])
    h = str(tmp_path)
    assert cfg.data.train_files == [f"{h}/gsm8k/train.parquet"] and cfg.data.val_files == [f"{h}/gsm8k/test.parquet", "/x"]
    assert cfg.actor_rollout_ref.model.path == cfg.actor_rollout_ref.model.tokenizer_path == f"{h}/models/q"
    assert cfg.critic.model.path == f"{h}/models/c" and cfg.trainer.default_local_dir == f"{h}/ckpt/verl_examples"
    assert cfg.custom_reward_function.path == f"{h}/rf.py" and cfg.reward_model.model.path == f"{h}/rm"
    assert cfg.data.offline_files == [f"{h}/logged.jsonl"] and cfg.trainer.resume_from_path.startswith(h)
    assert load_config(None, ["data.prompt_key=~x"]).data.prompt_key == "~x"  # not a path: kept


def test_every_path_key_exists():
    from nanokl.harness.config.yaml_io import get_key
    from nanokl.harness.config.rules import PATH_KEYS
    for key in PATH_KEYS:
        get_key(Config(), key)


# --------------------------------------------------------------------------- DAPO's and GSPO's keys

def test_dapo_reward_manager_and_its_reward_kwargs_map_to_the_overlong_buffer():
    cfg = load_config(DEFAULT_CONFIG, ["reward_model.reward_manager=dapo",
                                       f"+{RK}overlong_buffer_cfg.enable=True", f"+{RK}overlong_buffer_cfg.len=8",
                                       f"+{RK}overlong_buffer_cfg.penalty_factor=1.0",
                                       f"+{RK}overlong_buffer_cfg.log=False", f"+{RK}max_resp_len=32"])
    ob = cfg.reward_model.overlong_buffer
    assert cfg.reward_model.reward_manager == "dapo" and (ob.enable, ob.len, ob.penalty_factor) == (True, 8, 1.0)
    # the DAPO recipe's own spelling is unchanged, and dapo alone scores as naive does
    assert load_config(DEFAULT_CONFIG, ["reward_model.reward_manager=dapo"]).reward_model.overlong_buffer.enable is False


@pytest.mark.parametrize("overrides, expected", [
    (["reward_model.reward_manager=dapo", f"{RK}max_resp_len=64"],
     f"{RK}max_resp_len must be actor_rollout_ref.rollout.response_length (32)"),
    ([f"{RK}overlong_buffer_cfg.enable=true", f"{RK}overlong_buffer_cfg.len=8"],
     "reward_model.reward_kwargs are the dapo reward manager's arguments (verl's naive takes none)"),
    (["reward_model.reward_manager=dapo", f"{RK}overlong_buffer_cfg.len=8", "reward_model.overlong_buffer.len=4"],
     "set only one of reward_model.overlong_buffer (the DAPO recipe's) and reward_model.reward_kwargs"),
    (["reward_model.reward_manager=dapo", f"{RK}overlong_buffer_cfg.enable=true"],
     "reward_model.overlong_buffer.len must be in (0, 32]"),
    (["data.gen_batch_size=384"], "data.gen_batch_size (384) is the generation round of dynamic sampling"),
    (["data.gen_batch_size=0"], "data.gen_batch_size must be > 0"),
])
def test_dapo_keys_nanokl_cannot_honour_are_refused_in_one_line(overrides, expected):
    assert expected in error_of(load_config, DEFAULT_CONFIG, overrides)


def test_gen_batch_size_defaults_to_the_batch_and_goes_with_dynamic_sampling():
    assert load_config(DEFAULT_CONFIG).data.gen_batch_size == 128
    cfg = load_config(DEFAULT_CONFIG, ["data.gen_batch_size=384", "algorithm.filter_groups.enable=true",
                                       "algorithm.filter_groups.metric=acc", "actor_rollout_ref.rollout.n=4"])
    assert (cfg.data.gen_batch_size, cfg.data.train_batch_size) == (384, 128)


def test_gspo_under_verls_default_aggregation_runs_with_a_note():
    cfg = load_config(DEFAULT_CONFIG, [f"{A}policy_loss.loss_mode=gspo"])
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-mean"
    assert f"note: {A}policy_loss.loss_mode='gspo' with {A}loss_agg_mode='token-mean': the GSPO loss is aggregated " \
           f"seq-mean-token-mean whatever loss_agg_mode says, as verl's compute_policy_loss_gspo does" in startup_notes(cfg)
    assert load_config(DEFAULT_CONFIG, [f"{A}policy_loss.loss_mode=gspo", f"{A}loss_agg_mode=seq-mean-token-mean"]) \
        == cfg
    # with a KL loss verl would aggregate that by loss_agg_mode and GSPO's otherwise: nanokl cannot, and says so
    msg = error_of(load_config, DEFAULT_CONFIG, [f"{A}policy_loss.loss_mode=gspo", f"{A}use_kl_loss=true"])
    assert "gspo aggregates seq-mean-token-mean (as verl does) and, with" in msg


def _model_dir(tmp_path, **fields):
    path = tmp_path / "model"
    path.mkdir()
    hf = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=64, hidden_size=32,
              intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rope_theta=10000.0, **fields)
    (path / "config.json").write_text(json.dumps(hf))
    return path


def test_override_config_is_applied_to_the_model_config(tmp_path):
    from nanokl.harness.hf_format import read_config
    path = _model_dir(tmp_path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = load_config(DEFAULT_CONFIG, ["+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
                                       "+actor_rollout_ref.model.override_config.rope_scaling={factor: 4.0}",
                                       "+actor_rollout_ref.model.override_config.attention_dropout=0.0"])
    kw, _ = read_config(path, cfg.actor_rollout_ref.model.override_config)
    assert kw["max_position_embeddings"] == 32768 and kw["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert read_config(path)[0]["max_position_embeddings"] == 64  # the file itself untouched


@pytest.mark.parametrize("entry, expected", [
    ("vocab_size=10", "override_config.vocab_size=10 is not supported: it changes the model's shapes"),
    ("attention_dropout=0.1", "override_config.attention_dropout=0.1 is not supported: nanokl's model runs "
                              "attention_dropout=0"),
    ("sliding_window=4096", "override_config.sliding_window=4096 is not supported: nanokl's model does not read it"),
    ("max_position_embeddings=big", "override_config.max_position_embeddings='big' is not supported: expects int"),
])
def test_override_config_entries_nanokl_would_ignore_are_refused_per_key(entry, expected):
    arg = f"+actor_rollout_ref.model.override_config.{entry}"
    msg = error_of(load_config, DEFAULT_CONFIG, [arg])
    assert msg.startswith(f"argument '{arg}': actor_rollout_ref.model.") and expected in msg


def test_attn_implementation_is_noted():
    cfg = load_config(DEFAULT_CONFIG, ["+actor_rollout_ref.model.override_config.attn_implementation=eager"])
    assert ("note: actor_rollout_ref.model.override_config.attn_implementation='eager': nanokl's attention is its "
            "own (nanokl/engine/attention.py): the setting picks no kernel") in startup_notes(cfg)


# --------------------------------------------------------------------------- the scripts, verbatim

def _dapo_common(response, extra):  # recipe/dapo/*.sh's shared arguments, their shell variables filled in
    tokens = 2048 + response
    return [
        "data.train_files=/home/u/verl/data/dapo-math-17k.parquet", "data.val_files=/home/u/verl/data/aime-2024.parquet",
        "data.prompt_key=prompt", "data.truncation=left", "data.max_prompt_length=2048",
        f"data.max_response_length={response}", *extra["data"], "data.train_batch_size=512",
        "actor_rollout_ref.rollout.n=16", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "algorithm.kl_ctrl.kl_coef=0.0", f"{A}use_kl_loss=False", f"{A}kl_loss_coef=0.0", f"{A}clip_ratio_low=0.2",
        f"{A}clip_ratio_high=0.28", f"{A}clip_ratio_c=10.0", *extra["algorithm"],
        "actor_rollout_ref.model.use_remove_padding=True", *extra["model"], f"{A}use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"{A}ppo_max_token_len_per_gpu={tokens * extra['actor_x']}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={tokens * extra['infer_x']}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={tokens * extra['infer_x']}",
        *extra["before_path"], f"actor_rollout_ref.model.path={extra['model_path']}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True", f"{A}optim.lr=1e-6",
        f"{A}optim.lr_warmup_steps=10", f"{A}optim.weight_decay=0.1", f"{A}ppo_mini_batch_size=32",
        f"{A}fsdp_config.param_offload=True", f"{A}fsdp_config.optimizer_offload=True", f"{A}entropy_coeff=0",
        f"{A}grad_clip=1.0", f"{A}loss_agg_mode=token-mean", f"{A}ulysses_sequence_parallel_size={extra['sp']}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.80", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "actor_rollout_ref.rollout.enable_chunked_prefill=True", f"actor_rollout_ref.rollout.max_num_batched_tokens={tokens}",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.7", "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.n=1",
        *extra["after_n"], "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={extra['sp']}",
        f"{A}fsdp_config.fsdp_size={extra['fsdp']}", "reward_model.reward_manager=dapo", *extra["reward"],
        'trainer.logger=["console","wandb"]', "trainer.project_name=DAPO", f"trainer.experiment_name={extra['exp']}",
        *extra["trainer"]]


DAPO_32B = _dapo_common(20480, dict(  # recipe/dapo/run_dapo_qwen2.5_32b.sh
    data=["data.gen_batch_size=1536"], algorithm=["algorithm.filter_groups.enable=True",
                                                   "algorithm.filter_groups.max_num_gen_batches=10",
                                                   "algorithm.filter_groups.metric=acc"],
    model=[], actor_x=1, infer_x=1, before_path=[], model_path="/home/u/verl/models/Qwen2.5-32B", sp=8,
    after_n=["actor_rollout_ref.rollout.name=vllm"], fsdp=-1, exp="DAPO-Qwen2.5-32B",
    reward=["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4096",
            "reward_model.overlong_buffer.penalty_factor=1.0"],
    trainer=["trainer.n_gpus_per_node=8", "trainer.nnodes=16", "trainer.val_before_train=True", "trainer.test_freq=5",
             "trainer.save_freq=5", "trainer.total_epochs=1",
             "trainer.default_local_dir=/home/u/verl/ckpts/DAPO/DAPO-Qwen2.5-32B", "trainer.resume_mode=auto"]))

DAPO_7B = _dapo_common(8192, dict(  # recipe/dapo/test_dapo_7b_math.sh
    data=[], algorithm=[], model=["+actor_rollout_ref.model.override_config.max_position_embeddings=32768"],
    actor_x=2, infer_x=3, before_path=["actor_rollout_ref.rollout.name=vllm"],
    model_path="/home/u/verl/models/Qwen2.5-Math-7B", sp=4, after_n=[], fsdp=32, exp="DAPO-Qwen2.5-7b-MATH-0527a1",
    reward=[f"+{RK}overlong_buffer_cfg.enable=True", f"+{RK}overlong_buffer_cfg.len=4096",
            f"+{RK}overlong_buffer_cfg.penalty_factor=1.0", f"+{RK}overlong_buffer_cfg.log=False",
            f"+{RK}max_resp_len=8192"],
    trainer=["trainer.n_gpus_per_node=8", "trainer.nnodes=8", "trainer.val_before_train=True", "trainer.test_freq=10",
             "trainer.save_freq=10", "trainer.total_epochs=10", "trainer.total_training_steps=200",
             "trainer.default_local_dir=/home/u/verl/ckpts/DAPO/DAPO-Qwen2.5-7b-MATH-0527a1",
             "trainer.resume_mode=auto", "trainer.log_val_generations=10"]))

GSPO = [  # examples/gspo_trainer/test_gspo_3b_math.sh (one node)
    "algorithm.adv_estimator=grpo", f"{A}policy_loss.loss_mode=gspo", "data.train_files=['/data/gsm8k/train.parquet']",
    "data.val_files=['/data/gsm8k/test.parquet']", "data.shuffle=true", "data.prompt_key=prompt", "data.truncation=error",
    "data.filter_overlong_prompts=true", "data.return_raw_chat=True", "data.train_batch_size=512",
    "data.max_prompt_length=2048", "data.max_response_length=8192", "actor_rollout_ref.rollout.n=16",
    "algorithm.use_kl_in_reward=false", "algorithm.kl_ctrl.kl_coef=0.0", f"{A}use_kl_loss=false", f"{A}kl_loss_coef=0.0",
    f"{A}clip_ratio_low=0.0003", f"{A}clip_ratio_high=0.0004", "actor_rollout_ref.model.use_remove_padding=true",
    f"{A}use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true", f"{A}ppo_max_token_len_per_gpu=20480",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true", f"{A}optim.lr=1e-6",
    f"{A}optim.lr_warmup_steps_ratio=0.05", f"{A}optim.weight_decay=0.1", f"{A}ppo_mini_batch_size=128",
    f"{A}ppo_micro_batch_size_per_gpu=8", f"{A}fsdp_config.param_offload=true", f"{A}fsdp_config.optimizer_offload=true",
    f"{A}entropy_coeff=0", f"{A}grad_clip=1.0", f"{A}loss_agg_mode=seq-mean-token-mean",
    f"{A}ulysses_sequence_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.enable_chunked_prefill=true",
    "actor_rollout_ref.rollout.max_num_batched_tokens=10240", "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.ref.fsdp_config.param_offload=true",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1", f"{A}entropy_checkpointing=true",
    "reward_model.reward_manager=dapo", f"+{RK}overlong_buffer_cfg.enable=false", f"+{RK}overlong_buffer_cfg.len=4096",
    f"+{RK}overlong_buffer_cfg.penalty_factor=1.0", f"+{RK}overlong_buffer_cfg.log=false", f"+{RK}max_resp_len=8192",
    'trainer.logger=["console","wandb"]', "trainer.project_name=RL-GSPO",
    "trainer.experiment_name=gspo-epslow-0.0003-epshigh-0.0004-Qwen2.5-3B-Instruct-RL", "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1", "trainer.val_before_train=false", "trainer.test_freq=10", "trainer.save_freq=10",
    "trainer.total_epochs=10", "trainer.total_training_steps=500",
    "trainer.default_local_dir=/rl/checkpoints/experimental/4b/gspo/gspo-epslow-0.0003-epshigh-0.0004-Qwen2.5-3B-Instruct-RL",
    "trainer.resume_mode=auto", "trainer.log_val_generations=2"]

_R = "actor_rollout_ref.rollout."
NOTED = {  # the keys each script sets that nanokl does otherwise: one start-up note each
    "gspo": [f"{A}entropy_checkpointing", f"{_R}name", f"{_R}max_num_batched_tokens", "reward_model.reward_manager"],
    "dapo_32b": [f"{A}ulysses_sequence_parallel_size", "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
                 f"{_R}name", f"{_R}tensor_model_parallel_size", f"{_R}max_num_batched_tokens",
                 "reward_model.reward_manager"],
}
NOTED["dapo_7b"] = [f"{A}fsdp_config.fsdp_size"] + NOTED["dapo_32b"]


@pytest.mark.parametrize("name, argv", [("gspo", GSPO), ("dapo_32b", DAPO_32B), ("dapo_7b", DAPO_7B)])
def test_verls_dapo_and_gspo_scripts_load_verbatim(name, argv):
    cfg = parse_cli(argv)
    keys = [line.split("=")[0].removeprefix("note: ") for line in startup_notes(cfg) if line not in kl_term_notes(cfg)]
    assert any(line.startswith("note: prompt + response reach") for line in kl_term_notes(cfg))  # 2k + 20k tokens
    monitor = [k for k in keys if k.startswith("trainer.kl_monitor")]  # the checklist, on by default: said once
    assert len(monitor) == 1 and [k for k in keys if k not in monitor] == NOTED[name]
    a, ob = cfg.actor_rollout_ref.actor, cfg.reward_model.overlong_buffer
    assert a.loss_agg_mode == ("seq-mean-token-mean" if name == "gspo" else "token-mean")
    assert (ob.enable, ob.len, ob.penalty_factor) == (name != "gspo", 4096, 1.0)
    assert cfg.data.gen_batch_size == (1536 if name == "dapo_32b" else 512) and cfg.data.train_batch_size == 512
    assert cfg.algorithm.filter_groups.enable is (name == "dapo_32b")
    if name == "dapo_7b":
        assert cfg.actor_rollout_ref.model.override_config == {"max_position_embeddings": 32768}
        assert cfg.trainer.default_local_dir == os.path.normpath("/home/u/verl/ckpts/DAPO/DAPO-Qwen2.5-7b-MATH-0527a1")
