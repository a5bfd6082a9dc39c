"""verl's math scripts run as they are (issue 41's acceptance): GSPO (examples/gspo_trainer/test_gspo_3b_math.sh),
DAPO (the recipe's run_dapo_qwen2.5_32b.sh and test_dapo_7b_math.sh), GRPO on GSM8K + MATH
(examples/grpo_trainer/run_qwen2-7b_math.sh) and REINFORCE++ (examples/reinforce_plus_plus_trainer/
run_qwen2-7b_math_rf.sh and run_qwen2-7b_math_rf_baseline.sh), from verl b178a3c and the verl-recipe commit it
pins (21892b9; the two DAPO scripts are unchanged from there to verl-recipe 48ea0a7); and GRPO with LoRA on GSM8K
(examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh, issue 48: reconstructed from memory, see GRPO_LORA).

The argument lists: GSPO's and DAPO's come from tests/test_hydra_overrides.py (written there with the scripts'
shell variables filled in, as bash fills them); the other three are below as the scripts write them, variables
and all, and bash itself expands them (`$HOME` the test's folder, so `$HOME/data/gsm8k/train.parquet` is a file
the test writes). Only the program (`train_ppo.main` for `python3 -m verl.trainer.main_ppo`), the paths (data
under the test's folder, the model path swapped for a tiny model) and a CPU-size tail appended at the end change:
batch, mini- and micro-batch sizes, the response length (and with it DAPO's max_resp_len and overlong buffer,
which must fit in it), the generation batch of DAPO's dynamic sampling (3x the batch, as the recipe has it), n,
2 steps, one GPU and tensor parallel 1 (trainer.device=cpu, so the notes are the CPU's on any machine), no
validation before training (the last step still validates, as verl does at its last step).

The data are rows as verl's preprocessing writes them: GSM8K (examples/data_preprocess/gsm8k.py; the shared
GSM8K files when present), MATH (examples/data_preprocess/math_dataset.py: data_source
"DigitalLearningGmbH/MATH-lighteval", or "lighteval/MATH" as verl wrote it before the mirror; the boxed answer
as ground truth) and DAPO-Math-17k / AIME-2024 (data_source "math_dapo", the DAPO prompt asking for an
"Answer:" line). The problems are simple made-up ones whose answers are 1 or 2.

The model: a 2-layer Qwen2 whose weights are set by hand to a bigram table (attention and MLP outputs zero, so
the logits depend on the last token only): after the prompt it writes "Answer: \\boxed{d}" or "\\boxed{d}"
(each with probability 1/2), d = 1 or 2 (1/2 each), then <|im_end|>. So the rule-based scorers see right and
wrong answers in both formats (MATH reads the box, DAPO the "Answer:" line), DAPO's overlong penalty falls on the
longer one, DAPO's dynamic sampling (filter_groups, metric acc) finds groups that disagree, and each dumped score
can be checked against what verl's rule gives.

Checked for each script: train_ppo.main returns 0; two steps logged, every metric finite; the last step's
val-core/<source>/acc for each validation source; one start-up line for each key nanokl does not act on as verl
would, and no note for any other key; every response's score in trainer.rollout_data_dir (and, without an
overlong buffer, in trainer.validation_data_dir) equal to verl's; and DAPO's validation scores carry the
overlong penalty verl gives them (test_dapo_validation_scores_carry_the_overlong_penalty)."""

import importlib.util
import json
import math
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

import train_ppo
from chat_templates import QWEN2_5
from nanokl.harness.config.load import parse_cli
from nanokl.harness.hf_format import save_pretrained
from nanokl.harness.tracking import read_metrics
from nanokl.engine.model import CausalLM, ModelConfig
from test_hydra_overrides import DAPO_7B, DAPO_32B, GSPO
from test_verl_commands import gsm8k_rows, tiny_chat_model
from verl_data import write_rows

pytest.importorskip("pyarrow")
if shutil.which("bash") is None:
    pytest.skip("the scripts' variables are expanded by bash", allow_module_level=True)

# examples/grpo_trainer/run_qwen2-7b_math.sh at verl b178a3c, from its first variable to the end
GRPO_MATH = r"""gsm8k_train_path=$HOME/data/gsm8k/train.parquet
gsm8k_test_path=$HOME/data/gsm8k/test.parquet
math_train_path=$HOME/data/math/train.parquet
math_test_path=$HOME/data/math/test.parquet

train_files="['$gsm8k_train_path', '$math_train_path']"
test_files="['$gsm8k_test_path', '$math_test_path']"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$train_files" \
    data.val_files="$test_files" \
    data.train_batch_size=1024 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k_math' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@"""

# examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh at verl b178a3c, from its first variable to the end
RF = r"""gsm8k_train_path=$HOME/data/gsm8k/train.parquet
gsm8k_test_path=$HOME/data/gsm8k/test.parquet
math_train_path=$HOME/data/math/train.parquet
math_test_path=$HOME/data/math/test.parquet

train_files="['$gsm8k_train_path', '$math_train_path']"
test_files="['$gsm8k_test_path', '$math_test_path']"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=reinforce_plus_plus \
    data.train_files="$train_files" \
    data.val_files="$test_files" \
    data.train_batch_size=1024 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=1024 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=mse \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=True \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=16 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@"""

# run_qwen2-7b_math_rf_baseline.sh differs from run_qwen2-7b_math_rf.sh in this one line alone (diff at b178a3c)
RF_BASELINE = RF.replace("adv_estimator=reinforce_plus_plus \\", "adv_estimator=reinforce_plus_plus_baseline \\")
assert RF_BASELINE.count("reinforce_plus_plus_baseline") == 1

# examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh (issue 48's LoRA acceptance), from its program line to the
# end. Reconstructed from verl's tree from memory (verl could not be fetched here to confirm it line by line): the
# GRPO GSM8K example with LoRA rank 64 / alpha 32, use_shm, layered_summon and safetensors loading
GRPO_LORA = r"""python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    trainer.val_before_train=False \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=16 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.shuffle=False \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.model.use_shm=True \
    actor_rollout_ref.model.lora_rank=64 \
    actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.load_format=safetensors \
    actor_rollout_ref.rollout.layered_summon=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2.5_3b_grpo_lora' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@"""


def bash_args(script, home):
    """The arguments bash passes to the program of `script`, with HOME=home."""
    text = script.replace("python3 -m verl.trainer.main_ppo", "printf '%s\\0'")
    out = subprocess.run(["bash", "-c", text], env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def with_model(args, model, home, paths=()):
    """The model path swapped for the tiny model; each (prefix, replacement) of `paths` applied to the values."""
    out = []
    for a in args:
        key, value = a.split("=", 1)
        if key.endswith("actor_rollout_ref.model.path"):
            value = str(model)
        for old, new in paths:
            value = value.replace(old, new.format(home=home))
        out.append(f"{key}={value}")
    return out


# --------------------------------------------------------------------------- the rows

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put "
               "your answer on its own line after \"Answer:\".")


def problems(n, seed):
    """n simple made-up problems (question, answer) whose answers are "1" or "2", in a few MATH-like forms."""
    g = torch.Generator().manual_seed(seed)
    forms = [lambda a: (f"What is ${a + 1} - {a}$?", "1"), lambda a: (f"Compute $\\frac{{{2 * a}}}{{{a}}}$.", "2"),
             lambda a: (f"If $x + {a} = {a + 2}$, what is $x$?", "2"), lambda a: (f"What is ${a}^0$?", "1")]
    picks = torch.randint(0, len(forms), (n,), generator=g).tolist()
    sizes = torch.randint(2, 50, (n,), generator=g).tolist()
    return [forms[f](a) for f, a in zip(picks, sizes)]


def math_rows(split, n, source):
    """verl's examples/data_preprocess/math_dataset.py's rows (its process_fn) for made-up problems."""
    return [{"data_source": source, "prompt": [{"role": "user", "content": q + " " + MATH_INSTRUCTION}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i}}
            for i, (q, a) in enumerate(problems(n, seed=0 if split == "train" else 1))]


def dapo_rows(split, n):
    """Rows as BytedTsinghua-SIA/DAPO-Math-17k and AIME-2024 hold them (the recipe's prepare_dapo_data.sh
    downloads them as they are): data_source math_dapo, the DAPO instruction around the problem."""
    return [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_PROMPT.format(q)}],
             "ability": "MATH", "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": a},
             "extra_info": {"index": f"{split}-{i:04d}"}}
            for i, (q, a) in enumerate(problems(n, seed=2 if split == "train" else 3))]


# --------------------------------------------------------------------------- the model

ANSWERS = ("1", "2")
RESPONSES = [f"Answer: \\boxed{{{d}}}" for d in ANSWERS] + [f"\\boxed{{{d}}}" for d in ANSWERS]


def answering_model(path, texts, logit=25.0):
    """tiny_chat_model's Qwen2 (a BPE tokenizer trained on `texts`, Qwen2.5's chat template), its weights then set
    by hand: each token's embedding a one-hot of its slot, attention and MLP outputs zero, the LM head a bigram
    table, so that after the generation prompt ("...<|im_start|>assistant\\n") the model writes one of RESPONSES,
    each with probability 1/4, then <|im_end|>; any other token leads to <|im_end|>."""
    from tokenizers import Tokenizer
    tiny_chat_model(path, QWEN2_5, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    texts + RESPONSES * 50)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    start, eos = tok.encode("<|im_start|>assistant\n").ids[-1], tok.token_to_id("<|im_end|>")
    counts = {}  # token -> {next token: count}
    for text in RESPONSES:
        ids = [start] + tok.encode(text).ids + [eos]
        for a, b in zip(ids, ids[1:]):
            counts.setdefault(a, {}).setdefault(b, 0)
            counts[a][b] += 1
    # a bigram model writes RESPONSES only if each token is followed the same way wherever it occurs: the branches
    # are the start (an "Answer:" line or not) and the digit; everything else has one successor
    branching = {a for a, nxt in counts.items() if len(nxt) > 1}
    assert branching == {start, tok.token_to_id("{")}, [tok.id_to_token(a) for a in branching]
    hidden = 32
    slots = {a: i for i, a in enumerate(counts)}
    rest = len(slots)
    assert rest < hidden
    cfg = ModelConfig(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, rest] = 1.0  # every token not in the table: the rest slot
        scale = hidden ** -0.5  # the final RMSNorm turns a one-hot into sqrt(hidden) times it
        for a, slot in slots.items():
            emb[a, rest] = 0.0
            emb[a, slot] = 1.0
            total = sum(counts[a].values())
            for b, c in counts[a].items():
                head[b, slot] = (logit + math.log(c / total)) * scale
        head[eos, rest] = logit * scale
    save_pretrained(model, path)
    return path


# --------------------------------------------------------------------------- verl's rules, for these responses

def expected_score(output, prompt, gt, overlong=None):
    """What verl gives one of RESPONSES to a prompt of these rows (default_compute_score, by data_source): MATH
    (math_reward) reads the last box; DAPO (math_dapo, Minerva) the "Answer:" line, whose "\\boxed{d}"
    normalize_final_answer unwraps, and no such line reads "[INVALID]": +1 right, -1 wrong; GSM8K (strict) wants a
    "#### N" line, absent here: 0. overlong: (length in tokens with the EOS, max_resp_len, buffer len), verl's DAPO
    reward manager's soft penalty min(-(length - (max_resp_len - len)) / len * penalty_factor, 0), factor 1.0."""
    boxed = output.rsplit("\\boxed{", 1)[1].split("}")[0]
    if "the form Answer: $Answer" in prompt:  # math_dapo
        score = 1.0 if output.startswith("Answer: ") and boxed == gt else -1.0
    elif MATH_INSTRUCTION in prompt:  # MATH
        score = 1.0 if boxed == gt else 0.0
    else:  # GSM8K
        score = 0.0
    if overlong is not None:
        length, max_resp_len, buffer_len = overlong
        score += min(-(length - (max_resp_len - buffer_len)) / buffer_len * 1.0, 0.0)
    return score


# --------------------------------------------------------------------------- the scripts

RESPONSE_LENGTH, BUFFER = 10, 4  # "Answer: \\boxed{d}" is 8 tokens with the EOS: 2 past DAPO's 10 - 4, -0.5
CPU = ["data.train_batch_size=2", f"data.max_response_length={RESPONSE_LENGTH}", "actor_rollout_ref.rollout.n=2",
       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=2", "trainer.n_gpus_per_node=1",
       "trainer.nnodes=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.device=cpu",
       "trainer.val_before_train=False"]
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # verl too refuses 16 for a mini-batch of 2x2
RK = "reward_model.reward_kwargs."
_A, _R, _REF = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
_OFFLOAD = [_A + "fsdp_config.param_offload", _A + "fsdp_config.optimizer_offload", _REF + "fsdp_config.param_offload"]
_DAPO_FILES = {"verl/data/dapo-math-17k.parquet": "dapo", "verl/data/aime-2024.parquet": "dapo"}

# name: (argument list (of the home folder), path rewrites, CPU tail, data files, the keys a start-up note names).
# The notes: each key the script sets to other than verl's default that nanokl does not act on as verl would:
# the rollout engine (vllm) and its settings (gpu_memory_utilization: eager decoding on the CPU sizes its own
# cache; max_num_batched_tokens: vLLM's scheduler), FSDP offload (nothing to offload in one process), sequence
# parallelism, fsdp_size, entropy_checkpointing, and reward_manager=dapo (the same scores as verl's, said once);
# in the LoRA script also model.use_shm (the model is read from its path), rollout.load_format and layered_summon
# (how verl's rollout receives the weights: nanokl's takes the actor's in place). Its LoRA keys act: not noted.
# Not noted, as verl's defaults: rollout.mode=async, enable_chunked_prefill, use_remove_padding, return_raw_chat.
SCRIPTS = {
    "gspo": (lambda home: GSPO, [("/data/gsm8k/", "{home}/data/gsm8k/"), ("/rl/", "{home}/rl/")],
             [f"{RK}max_resp_len={RESPONSE_LENGTH}"], {"data/gsm8k": "gsm8k"},
             [_A + "entropy_checkpointing", _R + "name", _R + "max_num_batched_tokens", "reward_model.reward_manager",
              *_OFFLOAD, _R + "gpu_memory_utilization"]),
    "dapo_32b": (lambda home: DAPO_32B, [("/home/u/", "{home}/")],
                 ["data.gen_batch_size=6", f"reward_model.overlong_buffer.len={BUFFER}"], _DAPO_FILES,
                 [_A + "ulysses_sequence_parallel_size", _REF + "ulysses_sequence_parallel_size", _R + "name",
                  _R + "max_num_batched_tokens", "reward_model.reward_manager", *_OFFLOAD,
                  _R + "gpu_memory_utilization"]),
    "dapo_7b": (lambda home: DAPO_7B, [("/home/u/", "{home}/")],
                [f"{RK}max_resp_len={RESPONSE_LENGTH}", f"{RK}overlong_buffer_cfg.len={BUFFER}"], _DAPO_FILES,
                [_A + "fsdp_config.fsdp_size", _A + "ulysses_sequence_parallel_size",
                 _REF + "ulysses_sequence_parallel_size", _R + "name", _R + "max_num_batched_tokens",
                 "reward_model.reward_manager", *_OFFLOAD, _R + "gpu_memory_utilization"]),
    "grpo_math": (lambda home: bash_args(GRPO_MATH, home), [], MICRO,
                  {"data/gsm8k": "gsm8k", "data/math": "DigitalLearningGmbH/MATH-lighteval"},
                  [_R + "name", _REF + "fsdp_config.param_offload", _R + "gpu_memory_utilization"]),
    "rf": (lambda home: bash_args(RF, home), [], MICRO, {"data/gsm8k": "gsm8k", "data/math": "lighteval/MATH"},
           [_R + "name", _REF + "fsdp_config.param_offload", _R + "gpu_memory_utilization"]),
    "rf_baseline": (lambda home: bash_args(RF_BASELINE, home), [], MICRO,
                    {"data/gsm8k": "gsm8k", "data/math": "DigitalLearningGmbH/MATH-lighteval"},
                    [_R + "name", _REF + "fsdp_config.param_offload", _R + "gpu_memory_utilization"]),
    "grpo_lora": (lambda home: bash_args(GRPO_LORA, home), [], MICRO, {"data/gsm8k": "gsm8k"},
                  ["actor_rollout_ref.model.use_shm", _R + "name", _R + "load_format", _R + "layered_summon",
                   _REF + "fsdp_config.param_offload", _R + "gpu_memory_utilization"]),
}


def write_data(home, files):
    """Each script's files (a folder: train.parquet and test.parquet; a .parquet name: one file, aime the test
    split); returns the data sources of the validation rows and every prompt's text."""
    texts, val_sources = [], set()
    for where, kind in files.items():
        for split, n in (("train", 12), ("test", 4)):
            if where.endswith(".parquet") and ("aime" in where) != (split == "test"):
                continue
            rows = gsm8k_rows(split, n) if kind == "gsm8k" else dapo_rows(split, n) if kind == "dapo" else \
                math_rows(split, n, kind)
            write_rows(home / where if where.endswith(".parquet") else home / where / f"{split}.parquet", rows)
            texts += [m["content"] for r in rows for m in r["prompt"]]
            val_sources |= {r["data_source"] for r in rows} if split == "test" else set()
    return val_sources, texts


NOTE = re.compile(r"note: ([\w.]+(?: / [\w.]+)*)")
KL_TERM = re.compile(r"^note: no KL term|^note: prompt \+ response reach|weighs nothing: ")  # notes.kl_term_notes


def run_script(name, tmp_path, monkeypatch, capfd):
    """Write the script's data and the model, run its arguments through train_ppo.main (exit status 0); returns
    the resolved config, what the run printed (lines), its logged rows, each dump's rows ("train" 1 and 2,
    "val" 2: {"input", "output", "gts", "score"}), and the tokenizer."""
    from tokenizers import Tokenizer
    argv_of, paths, tail, files, _ = SCRIPTS[name]
    home = tmp_path / "home"
    val_sources, texts = write_data(home, files)
    model = answering_model(tmp_path / "model", texts * 2)
    dumps = {"train": tmp_path / "rollouts", "val": tmp_path / "validation"}
    monkeypatch.chdir(tmp_path)  # a script without trainer.default_local_dir writes to checkpoints/<project>/<name>
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the scripts log to wandb: never to the network from a test
    args = with_model(argv_of(home), model, home, paths) + CPU + tail + [
        f"trainer.rollout_data_dir={dumps['train']}", f"trainer.validation_data_dir={dumps['val']}"]
    cfg = parse_cli(args)
    assert train_ppo.main(args) == 0
    said = capfd.readouterr()
    rows = [r for r in read_metrics(tmp_path / cfg.trainer.default_local_dir) if "actor/pg_loss" in r]
    dumped = {(kind, step): [json.loads(line) for line in (dumps[kind] / f"{step}.jsonl").read_text().splitlines()]
              for kind, step in (("train", 1), ("train", 2), ("val", 2))}
    return SimpleNamespace(cfg=cfg, lines=(said.out + said.err).splitlines(), rows=rows, dumped=dumped,
                           val_sources=val_sources, tok=Tokenizer.from_file(str(model / "tokenizer.json")))


def source_of(prompt, sources):
    """The data source of a dumped prompt of these rows (the dumps do not carry it), among `sources`."""
    if "the form Answer: $Answer" in prompt:
        return "math_dapo"
    if MATH_INSTRUCTION in prompt:
        return next(s for s in sources if s not in ("math_dapo", "openai/gsm8k"))
    return "openai/gsm8k"


def verl_score(run, g):
    """verl's reward for one dumped response of `run` (expected_score, DAPO's overlong penalty where it is on)."""
    ob = run.cfg.reward_model.overlong_buffer
    length = len(run.tok.encode(g["output"]).ids) + 1  # and the EOS
    return expected_score(g["output"], g["input"], g["gts"], (length, RESPONSE_LENGTH, ob.len) if ob.enable else None)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_verl_scripts_run_as_they_are(tmp_path, capfd, monkeypatch, name):
    run = run_script(name, tmp_path, monkeypatch, capfd)
    assert any(line.startswith("config: verl's defaults") for line in run.lines)  # data files, no --config

    # one start-up line for each key nanokl does not act on as verl would, and none for any other key (the KL
    # checklist's own line says it is on by default: not a key of the script)
    keys = [k for line in run.lines if line.startswith("note: ") and not line.startswith("note: trainer.kl_monitor")
            and not KL_TERM.search(line) for k in NOTE.match(line).group(1).split(" / ")]
    assert sorted(keys) == sorted(SCRIPTS[name][-1]), name
    if name == "grpo_lora":  # the adapters are on: rank and alpha as the script sets them
        assert sum(line.startswith("LoRA: rank 64, alpha 32 on ") for line in run.lines) == 1
    if importlib.util.find_spec("wandb") is None:  # trainer.logger names wandb: said once, then skipped
        assert sum(line.startswith("tracking: wandb is not installed") for line in run.lines) == 1

    # two steps, every metric finite; the last step validated (test_freq, as verl does) per data source
    assert [r["training/global_step"] for r in run.rows] == [1, 2]
    for r in run.rows:
        for k, v in r.items():
            if k != "monitor/health":
                assert isinstance(v, (int, float)) and math.isfinite(v), f"{name}: {k}={v}"
    assert {k for k in run.rows[1] if k.startswith("val-core/")} == \
        {f"val-core/{s}/acc/mean@1" for s in run.val_sources}
    for src in run.val_sources:  # the accuracy of each source by its own rule (DAPO's +-1 read as right or wrong)
        accs = [expected_score(g["output"], g["input"], g["gts"]) > 0 for g in run.dumped["val", 2]
                if source_of(g["input"], run.val_sources) == src]
        assert run.rows[1][f"val-core/{src}/acc/mean@1"] == pytest.approx(sum(accs) / len(accs)), src

    # every response one of RESPONSES; each training response scored as verl's rule scores it (with DAPO's
    # overlong penalty where it is on: test_dapo_validation_scores_carry_the_overlong_penalty for validation's)
    for (kind, _), got in run.dumped.items():
        assert len(got) == (4 if kind == "train" else 4 * len(run.val_sources))
        for g in got:
            assert g["output"] in RESPONSES, g
            if kind == "train" or not run.cfg.reward_model.overlong_buffer.enable:
                assert g["score"] == pytest.approx(verl_score(run, g)), (name, kind, g)
    if run.cfg.algorithm.filter_groups.enable:  # dynamic sampling: each kept group's two responses disagree (acc)
        for step in (1, 2):
            accs = [expected_score(g["output"], g["input"], g["gts"]) > 0 for g in run.dumped["train", step]]
            assert all(accs[i] != accs[i + 1] for i in range(0, len(accs), 2)), run.dumped["train", step]
        assert all(r["train/num_gen_batches"] >= 1 for r in run.rows)


@pytest.mark.parametrize("name", ["dapo_32b", "dapo_7b"])
def test_dapo_validation_scores_carry_the_overlong_penalty(tmp_path, capfd, monkeypatch, name):
    """verl validates DAPO with the training reward manager (main_ppo's val_reward_fn: the same reward_kwargs; the
    recipe's main_dapo: the same overlong_buffer): the validation dump's score and val-aux/<source>/reward/mean@1
    carry the overlong penalty, val-core's acc and val-aux/<source>/score (the rule's own) do not."""
    run = run_script(name, tmp_path, monkeypatch, capfd)
    got = run.dumped["val", 2]
    want = [verl_score(run, g) for g in got]
    assert [g["score"] for g in got] == pytest.approx(want)
    assert run.rows[1]["val-aux/math_dapo/reward/mean@1"] == pytest.approx(sum(want) / len(want))
    unshaped = [expected_score(g["output"], g["input"], g["gts"]) for g in got]
    assert run.rows[1]["val-aux/math_dapo/score/mean@1"] == pytest.approx(sum(unshaped) / len(unshaped))
