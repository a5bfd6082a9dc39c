"""Sample completions from a Hugging Face-format checkpoint with nanokl's rollout engine.

    python generate.py --model runs/arith_tiny/sft --prompt "Q: 12 + 30 - 7 = ?
A:"
    python generate.py --model DIR --prompts prompts.txt --n 4 --temperature 0.7 --top-p 0.9
    python generate.py --model DIR --task arith --num-prompts 512 --n 4 --rank --out logged.jsonl

Prompts come from `--prompt`, from `--prompts` (one per line of a text file, or the "prompt" (else
"question") field of each line of a .jsonl file), or from `--task NAME`: the first --num-prompts
training problems of a built-in task (nanokl/tasks/), made from the `data` section of --config
(default configs/arith_tiny.yaml). They run in batches through `nanokl.rollout.generate` (static
KV cache; CUDA graphs on a GPU), with a progress bar when there is more than one batch.

`--out FILE` writes a logged-response file for offline training (nanokl/harness/logged.py), one
JSON row per prompt, appended and flushed batch by batch so a crash loses little:

    {"prompt", "responses": [n texts], "ended": [bools], "logprobs": [[per-token log-probs]],
     "temperature": T, + "ground_truth", "data_source", "reward_model" of the source row,
     + "ranking" (best first) with --rank}

`logprobs` are the rollout's: log softmax(logits / T) of each sampled token, before top-k/top-p
filtering (T = 0, greedy, records them at temperature 1; see nanokl/rollout.py). `--rank` orders
each row's responses by the synthetic preference of nanokl/supervised/preference_data.py (a
stable sort: equal keys keep sampling order); with a .jsonl source name the task: `--rank TASK`.
Rows left with fewer than two responses are then skipped, so a ranked file is DPO-ready.

verl's main_generation habits (its config/generation.yaml keys, `key=value`, mixed freely with the flags):

    python generate.py model.path=DIR data.path=test.parquet data.n_samples=4 data.output_path=gen.parquet \
        rollout.temperature=0.7 rollout.response_length=256

`data.path` is a verl row file (.parquet, .jsonl, .json: nanokl/tasks/rows.py's `read_rows`, as
train_ppo reads data.train_files) whose `data.prompt_key` column (default "prompt") is a chat message
list or a string; a .txt is one prompt per line, as --prompts. Every prompt is written as training wrote
it (nanokl/harness/data.py's `prompt_text`): a chat list through the model's own chat template (Qwen's
default system turn kept), a string in --template (default plain). `data.output_path` writes verl's
output: each source row with a `responses` column of n_samples texts (every sample, none dropped), as
Parquet when the name ends in .parquet and pyarrow is installed, else as JSONL (beside it, `.jsonl`, with
a note saying so). Keys and their flags: model.path=--model, data.path=--prompts, data.n_samples=--n,
data.batch_size=--batch-size, rollout.temperature / top_k / top_p = --temperature / --top-k / --top-p,
rollout.do_sample=false = temperature 0, rollout.response_length=--max-new-tokens, rollout.prompt_length
(a longer prompt is refused in one line naming it). verl's keys that change nothing here (the engine,
the GPUs, memory) are listed in a start-up note; any other key is refused in one line. Score the output as
verl's main_eval does: python -m nanokl.harness.main_eval data.path=gen.parquet (nanokl/harness/main_eval.py).

Refused in one line (exit 2) before the model loads: --n, --batch-size, --max-new-tokens below 1; no
prompts, or an empty one (0 tokens once templated: `file:line` for a --prompts file); a prompt plus
--max-new-tokens past the model's max_position_embeddings (config.json). Without --max-new-tokens a
sample takes up to 128 new tokens, fewer where the longest prompt leaves less room (a note says so).
An --out folder that cannot be written is refused first of all.

Why some samples are dropped. The reader tokenizes a response's *text* (plus EOS if it ended),
but a sampled token sequence need not be the canonical BPE tokenization of its decoded text
(" 12" drawn as " 1" "2" where the merge gives " 12"); its log-probs would then belong to other
tokens. Such a sample is left out of its row and counted. Measured, 32 new tokens: the arithmetic
warm start (runs/arith_tiny/sft) drops 4 of 1024 samples (0.4%, 256 prompts x 4, T = 1); the
tests' undertrained one (40 SFT steps, 64 x 4) drops 98% at T = 1, 94% at 0.7, 71% at 0.3.
tests/test_generate.py checks the logged log-probs against a teacher-forced recomputation.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from nanokl.harness.config.yaml_io import ConfigError, UserError, parse_override, run_cli
from nanokl.tasks.rows import DataError, Located, _chat_prompt, read_rows, where_of
from nanokl.harness.data import prompt_text
from nanokl.harness.faults import check_writable
from nanokl.harness.hf_format import from_pretrained, read_config
from nanokl.rollout import generate
from nanokl.harness.tokenizer import apply_template, load_tokenizer

PASSED_THROUGH = ("ground_truth", "data_source", "reward_model")  # what the task's rule reads
MAX_NEW_TOKENS = 128  # --max-new-tokens by default, or what the model's positions leave after the longest prompt


def read_prompts(path, prompt_key="prompt"):
    """Example dicts {"prompt", ...}: a .txt line each, or a row each of a .jsonl / .json / .parquet file
    (nanokl/tasks/rows.py's reader, as training reads data.train_files), which keeps its ground_truth /
    data_source / reward_model, its chat `messages` (rendered as training renders them) and the row itself
    (`source_row`, for data.output_path)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompts file {str(path)!r} does not exist")
    if path.suffix.lower() not in (".jsonl", ".json", ".parquet"):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not a text file of prompts, one per line (byte {e.object[e.start]:#04x} is "
                            "not UTF-8); give verl rows as .parquet, .jsonl or .json") from None
        lines = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]  # numbered as in the file
        return [Located({"prompt": ln, "source_row": {"prompt": ln}}, f"{path}:{i}") for i, ln in lines]
    examples = []
    for where, row in read_rows(path):
        if not isinstance(row, dict) or not (prompt_key in row or (prompt_key == "prompt" and "question" in row)):
            raise DataError(f"{where}: expected a row (JSON object) with a {prompt_key!r}"
                            + (" or 'question'" if prompt_key == "prompt" else "") + " field")
        ex = {"prompt": row[prompt_key] if prompt_key in row else row["question"]}
        if isinstance(ex["prompt"], list):
            ex["messages"] = [dict(m) for m in ex["prompt"]]
            ex["prompt"], system = _chat_prompt(ex["prompt"], where)
            if system is not None:
                ex["system_prompt"] = system
        if not isinstance(ex["prompt"], str):
            raise DataError(f"{where}: the prompt must be a string or a list of chat messages")
        ex["source_row"] = row
        examples.append(Located(ex | {k: row[k] for k in PASSED_THROUGH if k in row}, where))
    return examples


# verl's main_generation keys (config/generation.yaml) and the flag each one sets
VERL_KEYS = {"model.path": "model", "data.path": "prompts", "data.prompt_key": "prompt_key",
             "data.n_samples": "n", "data.output_path": "output_path", "data.batch_size": "batch_size",
             "rollout.temperature": "temperature", "rollout.top_k": "top_k", "rollout.top_p": "top_p",
             "rollout.response_length": "max_new_tokens", "rollout.prompt_length": "prompt_length",
             "rollout.do_sample": "do_sample"}
# verl's generation keys that choose the engine, the GPUs or memory: no effect on the samples here
VERL_NOTED = ("trainer.nnodes", "trainer.n_gpus_per_node", "model.external_lib", "model.trust_remote_code",
              "data.trust_remote_code", "rollout.name", "rollout.mode", "rollout.dtype",
              "rollout.gpu_memory_utilization", "rollout.ignore_eos", "rollout.enforce_eager",
              "rollout.free_cache_engine", "rollout.load_format", "rollout.tensor_model_parallel_size",
              "rollout.max_num_batched_tokens", "rollout.max_num_seqs", "rollout.log_prob_micro_batch_size",
              "rollout.log_prob_micro_batch_size_per_gpu", "rollout.micro_batch_size", "rollout.enable_chunked_prefill",
              "rollout.disable_log_stats", "rollout.max_model_len", "rollout.seed", "ray_init.num_cpus",
              "ray_kwargs.ray_init.num_cpus")
VERL_INT = ("data.n_samples", "data.batch_size", "rollout.top_k", "rollout.response_length", "rollout.prompt_length")


def split_verl_keys(argv):
    """(the flags, {flag name: value} of verl's key=value arguments, [verl keys noted as not acted on])."""
    flags, values, noted = [], {}, []
    for arg in argv:
        takes_value = bool(flags) and flags[-1].startswith("--") and "=" not in flags[-1] and flags[-1] != "--rank"
        if takes_value or arg.startswith("-") or not re.match(r"^\+{0,2}[A-Za-z_]\w*(\.\w+)+=", arg):
            flags.append(arg)  # a flag, or a flag's value (--prompt "a.b=c" is a prompt)
            continue
        try:
            _, parts, value = parse_override(arg)
        except ConfigError as e:
            raise UserError(str(e)) from None
        key = ".".join(parts)
        if key.startswith("actor_rollout_ref."):  # verl's trainer spelling of the same keys
            key = key[len("actor_rollout_ref."):]
        if key in VERL_NOTED:
            noted.append(key)
            continue
        if key not in VERL_KEYS:
            raise UserError(f"{arg}: not a key of verl's main_generation that generate.py reads (it reads "
                            f"{', '.join(VERL_KEYS)}; notes {', '.join(VERL_NOTED)})")
        if key in VERL_INT and (not isinstance(value, int) or isinstance(value, bool)):
            raise UserError(f"{key}={value!r}: must be an integer")
        if key in ("rollout.temperature", "rollout.top_p") and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise UserError(f"{key}={value!r}: must be a number")
        if key == "rollout.do_sample" and not isinstance(value, bool):
            raise UserError(f"{key}={value!r}: must be true or false")
        if key in ("model.path", "data.path", "data.output_path", "data.prompt_key"):
            if not isinstance(value, str) or not value:
                raise UserError(f"{key}={value!r}: must be a path" if key != "data.prompt_key" else
                                f"{key}={value!r}: must be a column name")
        values[VERL_KEYS[key]] = value
    return flags, values, noted


def write_verl_output(path, examples, responses):
    """verl's main_generation output: each source row plus `responses` (its n_samples texts); Parquet when
    `path` ends in .parquet and pyarrow is installed, else JSONL (beside it, with a note). The path written."""
    rows = [{**ex.get("source_row", {"prompt": ex["prompt"]}), "responses": r} for ex, r in zip(examples, responses)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # as verl's makedirs
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            path = path.with_suffix(".jsonl")
            print(f"note: pyarrow is not installed (pip install pyarrow): data.output_path written as JSONL, to "
                  f"{path}", file=sys.stderr)
        else:
            pq.write_table(pa.Table.from_pylist(rows), path)
            return path
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def task_examples(args):
    """The first --num-prompts training examples of --task, and the task."""
    from nanokl.harness.config.schema import DataConfig
    from nanokl.harness.config.load import DEFAULT_CONFIG, load_config
    from nanokl.tasks import get_task
    task = get_task(args.task)
    if args.config or args.task == "arith":
        data = load_config(args.config or DEFAULT_CONFIG).data
    else:
        data = DataConfig()
    data.task = args.task
    train, _ = task.examples(data, args.num_prompts, 0, seed=args.seed)
    return train, task


def logged_row(ex, texts, ended, logprobs, temperature, task):
    """One --out row, or None when no response is left; ranked best first when `task` is given."""
    row = {"prompt": ex["prompt"], "responses": texts, "ended": ended, "logprobs": logprobs,
           "temperature": temperature}
    if "system_prompt" in ex:
        row["prompt"] = [{"role": "system", "content": ex["system_prompt"]}, {"role": "user", "content": ex["prompt"]}]
    row |= {k: ex[k] for k in PASSED_THROUGH if k in ex}
    if task is not None and "ground_truth" in ex:
        from nanokl.supervised.preference_data import preference_key
        keys = [preference_key(t, ex, task.score) for t in texts]
        row["ranking"] = sorted(range(len(texts)), key=keys.__getitem__)  # stable: ties keep sampling order
    return row


def check_lengths(args, examples, lengths, model_kw, source) -> int:
    """The new tokens per sample: --max-new-tokens, refused when the longest prompt plus it passes the model's
    max_position_embeddings, or by default MAX_NEW_TOKENS capped to what the longest prompt leaves (said in
    a note). An empty prompt (0 tokens once templated) is refused too: each in one line naming it."""
    for i, (ex, n) in enumerate(zip(examples, lengths)):
        if n == 0:
            raise UserError(f"{where_of(ex, f'{source} prompt {i}')}: the prompt is empty "
                            f"(0 tokens with --template {args.template})")
    k = max(range(len(lengths)), key=lengths.__getitem__)
    longest, most, cfg_file = lengths[k], model_kw["max_position_embeddings"], Path(args.model) / "config.json"
    which = where_of(examples[k], source if len(examples) == 1 else f"{source} prompt {k}")
    if args.max_new_tokens is None:
        if longest >= most:
            raise UserError(f"{cfg_file}: max_position_embeddings={most}, but {which} alone has {longest} tokens: "
                            "no position is left for a response")
        if most - longest < MAX_NEW_TOKENS:
            print(f"note: --max-new-tokens {most - longest}: what max_position_embeddings={most} leaves after the "
                  f"longest prompt ({longest} tokens)", file=sys.stderr)
        return min(MAX_NEW_TOKENS, most - longest)
    if longest + args.max_new_tokens > most:
        fix = f"use --max-new-tokens {most - longest} or less" if longest < most else "shorten the prompt"
        raise UserError(f"{cfg_file}: max_position_embeddings={most}, but {which} has {longest} tokens + "
                        f"--max-new-tokens {args.max_new_tokens} = {longest + args.max_new_tokens} positions: {fix}")
    return args.max_new_tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="directory with config.json, model.safetensors, tokenizer.json (verl: model.path=)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help="a .txt (one prompt per line), or a .jsonl / .json / .parquet file of verl rows "
                                       "(verl: data.path=)")
    src.add_argument("--task", help="a built-in task (nanokl/tasks/): its first --num-prompts training problems")
    ap.add_argument("--num-prompts", type=int, help="with --task (default: the config's data.num_train)")
    ap.add_argument("--config", help="with --task: the YAML config whose data section makes the problems")
    ap.add_argument("--out", help="write a logged-response .jsonl file (log-probs included) instead of printing")
    ap.add_argument("--rank", nargs="?", const=True, metavar="TASK",
                    help="with --out: rank each row by the task's synthetic preference (TASK: for a --prompts source)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"default {MAX_NEW_TOKENS}, or fewer: what max_position_embeddings leaves after the "
                         "longest prompt")
    ap.add_argument("--template", default="plain", choices=["plain", "chatml"])
    ap.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    flags, verl, noted = split_verl_keys(sys.argv[1:] if argv is None else list(argv))
    args = ap.parse_args(flags)
    if "prompts" in verl and (args.prompt is not None or args.task is not None):
        raise UserError("data.path= is the prompts' source: not with --prompt or --task")
    if "output_path" in verl and args.out is not None:
        raise UserError("data.output_path= and --out each name the output: give one")
    args.prompt_key, args.output_path, args.prompt_length = "prompt", None, None
    if verl.pop("do_sample", True) is False:
        verl["temperature"] = 0.0
    for name, value in verl.items():
        setattr(args, name, value)
    if args.model is None:
        raise UserError("no model: give --model DIR (verl: model.path=DIR)")
    if args.prompt is None and args.prompts is None and args.task is None:
        raise UserError("no prompts: give --prompt, --prompts FILE (verl: data.path=FILE) or --task NAME")
    if noted:
        print(f"note: not acted on by generate.py (the engine, GPUs and memory; no effect on the samples): "
              f"{', '.join(noted)}", file=sys.stderr)
    for flag, value in (("--n", args.n), ("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens),
                        ("--num-prompts", args.num_prompts)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.task is None and (args.num_prompts is not None or args.config is not None):
        raise UserError("--num-prompts and --config go with --task")
    if args.rank is not None and args.out is None:
        raise UserError("--rank writes a ranking into the --out file: give --out")
    if args.out is not None and not args.out.endswith(".jsonl"):
        raise UserError(f"--out {args.out!r}: the logged-response file must end in .jsonl")
    if args.out is not None:  # one line now, not a traceback once the model has loaded
        check_writable(Path(args.out).parent, "--out")
    if args.output_path is not None:
        check_writable(Path(args.output_path).parent, "data.output_path")

    task = None
    if args.task is not None:
        examples, task = task_examples(args)
    else:
        examples = [{"prompt": args.prompt}] if args.prompt is not None else read_prompts(args.prompts, args.prompt_key)
    if args.rank is True and task is None:
        raise UserError("--rank with --prompt/--prompts needs the task that scores the rows: --rank TASK")
    if isinstance(args.rank, str):
        from nanokl.tasks import get_task
        task = get_task(args.rank)
    rank_task = task if args.rank is not None else None

    source = "--prompt" if args.prompt is not None else f"--task {args.task}" if args.task else f"{args.prompts}"
    if not examples:
        raise UserError(f"{source}: no prompts in it")
    kw, _ = read_config(args.model)  # a missing or broken model directory: its one line, before anything else
    tok = load_tokenizer(args.model)
    if args.out is None:  # as training writes its prompts: a chat through the model's chat template
        prompts = [prompt_text(ex, tok, args.template) for ex in examples]
    else:  # the logged file's reader (nanokl/harness/logged.py) writes its prompts in --template
        prompts = [apply_template(ex["prompt"], args.template, ex.get("system_prompt")) for ex in examples]
    lengths = [len(ids) for ids in map(tok.encode_one, prompts)]
    if args.prompt_length is not None:
        for i, (ex, n) in enumerate(zip(examples, lengths)):
            if n > args.prompt_length:
                raise UserError(f"{where_of(ex, f'{source} prompt {i}')}: the prompt has {n} tokens, over "
                                f"rollout.prompt_length={args.prompt_length}")
    max_new_tokens = check_lengths(args, examples, lengths, kw, source)

    dev = torch.device(args.device)
    model = from_pretrained(args.model, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    model.eval()
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    eos = torch.tensor(tok.eos_token_ids, device=dev)
    out_file = None
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out_file = open(args.out, "w", encoding="utf-8")
    responses = [[] for _ in examples]  # data.output_path: every sample's text
    stats = {"rows": 0, "samples": 0, "kept": 0, "dropped": 0, "skipped_rows": 0, "skipped_samples": 0}
    batches = range(0, len(examples), args.batch_size)
    for start in tqdm(batches, disable=len(batches) < 2 and out_file is None, desc="generate", file=sys.stderr):
        chunk = examples[start:start + args.batch_size]
        ids, mask = tok.encode(prompts[start:start + args.batch_size], device=dev)
        out = generate(model, ids, mask, max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, do_sample=args.temperature > 0, eos_token_id=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id, generator=gen, n=args.n)
        texts = tok.batch_decode(out.responses, out.response_mask)
        if args.output_path is not None:
            for i, text in enumerate(texts):
                responses[start + i // args.n].append(text)
            continue
        if out_file is None:
            for i, text in enumerate(texts):
                p = prompts[start + i // args.n]  # the text the model read
                head = f"=== prompt {start + i // args.n}" + (f", sample {i % args.n}" if args.n > 1 else "")
                tqdm.write(f"{head} ===\n{p}{text}\n", file=sys.stdout)
            continue
        lengths = out.response_mask.sum(-1)
        last = out.responses.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        ended = (torch.isin(last, eos) & (lengths > 0)).tolist()
        sampled = [r[:n] for r, n in zip(out.responses.tolist(), lengths.tolist())]
        logps = [lp[:n] for lp, n in zip(out.log_probs.tolist(), lengths.tolist())]
        for j, ex in enumerate(chunk):
            keep = [i for i in range(j * args.n, (j + 1) * args.n)
                    if sampled[i] == tok.encode_one(texts[i]) + [tok.eos_token_id] * ended[i]]
            stats["samples"] += args.n
            stats["dropped"] += args.n - len(keep)
            if not keep or (rank_task is not None and len(keep) < 2):
                stats["skipped_rows"] += 1
                stats["skipped_samples"] += len(keep)
                continue
            row = logged_row(ex, [texts[i] for i in keep], [ended[i] for i in keep], [logps[i] for i in keep],
                             args.temperature, rank_task)
            out_file.write(json.dumps(row) + "\n")
            stats["rows"] += 1
            stats["kept"] += len(keep)
        out_file.flush()
    if args.output_path is not None:
        written = write_verl_output(args.output_path, examples, responses)
        print(f"wrote {len(examples)} rows ({len(examples) * args.n} responses, {args.n} per row) to {written}",
              file=sys.stderr)
        stats |= {"rows": len(examples), "samples": len(examples) * args.n, "kept": len(examples) * args.n}
    if out_file is not None:
        out_file.close()
        print(f"wrote {stats['rows']} rows ({stats['kept']} responses) to {args.out}; {stats['dropped']} of "
              f"{stats['samples']} samples dropped: sampled tokens not the tokenization of their text; "
              f"{stats['skipped_rows']} prompts skipped (fewer than {2 if rank_task else 1} responses left)",
              file=sys.stderr)
    return stats


if __name__ == "__main__":
    run_cli(main)
