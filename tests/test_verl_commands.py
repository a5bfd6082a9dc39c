"""verl's own commands run as they are: the quickstart PPO command (verl docs, "Quickstart: PPO training
on GSM8K") and the argument list of examples/grpo_trainer/run_qwen2-7b.sh, copied verbatim from verl at
b178a3c except the program (`python train_ppo.py` for `python3 -m verl.trainer.main_ppo`) and the paths
(a tiny Qwen2 with a chat-templated tokenizer, GSM8K rows written as verl's
examples/data_preprocess/gsm8k.py writes them, as Parquet). CPU-sized settings are appended at the
end, as a user would on a laptop: batch and mini-batch sizes, response length, steps, and for the
GRPO example the GPU counts it was written for (8 GPUs, tensor parallel 2: one process here).

Checked for each: exit 0 (no exception), finite metrics for both steps, the start-up notes for the
keys nanokl does not act on listed, and every prompt of step 1 (trainer.rollout_data_dir) equal to
transformers' apply_chat_template rendering of its row with the model's own template."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import train_ppo
from chat_templates import LLAMA3_1, QWEN2_5
from nanokl.harness.hf_format import save_pretrained
from nanokl.harness.tracking import read_metrics
from nanokl.engine.model import CausalLM, ModelConfig, init_weights
from verl_data import verl_row, write_rows

transformers = pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

QUICKSTART = """data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=512
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    critic.optim.lr=1e-5
    critic.model.path=Qwen/Qwen2.5-0.5B-Instruct
    critic.ppo_micro_batch_size_per_gpu=4
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.logger=console
    trainer.val_before_train=False
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=10
    trainer.test_freq=10
    trainer.total_epochs=15"""

GRPO_EXAMPLE = """algorithm.adv_estimator=grpo
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.train_batch_size=1024
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console","wandb"]'
    trainer.project_name='verl_grpo_example_gsm8k'
    trainer.experiment_name='qwen2_7b_function_rm'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15"""


def shell_words(script):
    """The arguments a shell passes for the lines above (one argument per line; quotes removed)."""
    out = []
    for line in script.split("\n"):
        key, value = line.strip().split("=", 1)
        if value[:1] == value[-1:] and value[:1] in "'\"" and len(value) > 1:
            value = value[1:-1]
        out.append(f"{key}={value}")
    return out


def with_paths(args, data, model):
    """Only the paths change: the data files and the model directories."""
    swap = {"$HOME/data/gsm8k/train.parquet": str(data / "train.parquet"),
            "$HOME/data/gsm8k/test.parquet": str(data / "test.parquet"),
            "Qwen/Qwen2.5-0.5B-Instruct": str(model), "Qwen/Qwen2-7B-Instruct": str(model)}
    return [a.split("=", 1)[0] + "=" + swap.get(a.split("=", 1)[1], a.split("=", 1)[1]) for a in args]


def gsm8k_rows(split, n):
    """The first n GSM8K problems of a split in verl's preprocessed format (the shared data set when
    present, else a few made-up problems of the same shape)."""
    path = GSM8K / f"{split}.jsonl"
    if path.is_file():
        raw = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    else:
        raw = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?",
                "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"} for i in range(n)]
    return [verl_row(r["question"], r["answer"], split, i) for i, r in enumerate(raw)]


def tiny_chat_model(path, template, specials, texts):
    """A random 2-layer Qwen2 whose tokenizer (a byte-level BPE trained on `texts`) carries a real chat
    template in its tokenizer_config.json, as a Hub checkpoint does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    extra = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    # Qwen2's own pre-tokenizer (each digit alone), which transformers also imposes on a qwen2 checkpoint
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(vocab_size=512, special_tokens=extra, show_progress=False,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **specials}))
    cfg = ModelConfig(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    init_weights(model)
    save_pretrained(model, path)
    return path


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

CPU = ["data.train_batch_size=4", "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
       "trainer.total_training_steps=2"]


@pytest.mark.parametrize("name, script, template, specials, extra, notes", [
    ("quickstart", QUICKSTART, QWEN2_5, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, [],
     ["note: actor_rollout_ref.rollout.name='vllm'", "note: actor_rollout_ref.rollout.gpu_memory_utilization=0.4"]),
    ("grpo_example", GRPO_EXAMPLE, LLAMA3_1, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                              "pad_token": "<|endoftext|>"},
     ["actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=1",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=1"],
     ["note: actor_rollout_ref.rollout.name='vllm'", "note: actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
      "note: actor_rollout_ref.ref.fsdp_config.param_offload", "data.filter_overlong_prompts: dropped 0 of 12",
      "tracking: wandb is not installed"]),
])
def test_verl_commands_run_as_they_are(tmp_path, capfd, monkeypatch, name, script, template, specials, extra, notes):
    data = tmp_path / "data"
    train, test = gsm8k_rows("train", 12), gsm8k_rows("test", 4)
    write_rows(data / "train.parquet", train)
    write_rows(data / "test.parquet", test)
    model = tiny_chat_model(tmp_path / "model", template, specials,
                            [m["content"] for r in train + test for m in r["prompt"]] * 2)
    run_dir, dump = tmp_path / "run", tmp_path / "rollouts"
    args = with_paths(shell_words(script), data, model) + CPU + extra + [
        f"trainer.default_local_dir={run_dir}", f"trainer.rollout_data_dir={dump}"]
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the GRPO example logs to wandb: never to the network from a test
    seen = []  # each step's prompt ids and examples, as the step scores them

    def spy(tok, out, examples, *a, **kw):
        seen.append((out.sequences[:, :out.prompt_length], out.attention_mask[:, :out.prompt_length], examples))
        return score_batch(tok, out, examples, *a, **kw)
    score_batch = train_ppo.score_batch
    monkeypatch.setattr(train_ppo, "score_batch", spy)
    train_ppo.main(args)
    err = capfd.readouterr()
    said = err.out + err.err
    assert "config: verl's defaults" in said  # data files, no --config: verl's base, not the CPU demo's
    if importlib.util.find_spec("wandb") is not None:  # installed here: it ran (disabled below), nothing to say
        notes = [n for n in notes if "wandb" not in n]
    for note in notes:  # one start-up line for each key nanokl does not act on as verl would
        assert sum(line.startswith(note) for line in said.splitlines()) == 1, note
    rows = [r for r in read_metrics(run_dir) if "actor/pg_loss" in r]
    assert [r["training/global_step"] for r in rows] == [1, 2]
    for r in rows:
        for k, v in r.items():
            if k != "monitor/health":
                assert isinstance(v, (int, float)) and math.isfinite(v), f"{name}: {k}={v}"
    # step 1's prompts are the rows rendered by the model's own chat template: token for token what
    # transformers' apply_chat_template gives for that row's messages
    hf = transformers.AutoTokenizer.from_pretrained(str(model))
    ids, mask, examples = seen[0]
    assert len(examples) == 4 * (2 if name == "grpo_example" else 1)
    for i, ex in enumerate(examples):
        want = hf.apply_chat_template(ex["messages"], tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids[i][mask[i].bool()].tolist() == want
    assert {ex["extra_info"]["index"] for ex in examples} <= set(range(len(train)))
    # trainer.rollout_data_dir: the same prompts, as verl dumps them (special tokens skipped)
    step1 = [json.loads(line) for line in (dump / "1.jsonl").read_text().splitlines()]
    assert [line["input"] for line in step1] == [hf.decode(ids[i][mask[i].bool()].tolist(), skip_special_tokens=True)
                                                for i in range(len(examples))]
