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
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from nanokl.harness.config.yaml_io import UserError, run_cli
from nanokl.tasks.rows import DataError, Located, _chat_prompt, where_of
from nanokl.harness.faults import check_writable
from nanokl.harness.hf_format import from_pretrained, read_config
from nanokl.rollout import generate
from nanokl.harness.tokenizer import apply_template, load_tokenizer

PASSED_THROUGH = ("ground_truth", "data_source", "reward_model")  # what the task's rule reads
MAX_NEW_TOKENS = 128  # --max-new-tokens by default, or what the model's positions leave after the longest prompt


def read_prompts(path):
    """Example dicts {"prompt", ...}: a .jsonl row keeps its ground_truth / data_source / reward_model."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompts file {str(path)!r} does not exist")
    lines = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]  # numbered as in the file
    if path.suffix != ".jsonl":
        return [Located({"prompt": ln}, f"{path}:{i}") for i, ln in lines]
    examples = []
    for i, ln in lines:
        try:
            row = json.loads(ln)
            ex = {"prompt": row["prompt"] if "prompt" in row else row["question"]}
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{i}: expected a JSON object with a 'prompt' or 'question' field") from None
        if isinstance(ex["prompt"], list):
            ex["prompt"], system = _chat_prompt(ex["prompt"], f"{path}:{i}")
            if system is not None:
                ex["system_prompt"] = system
        if not isinstance(ex["prompt"], str):
            raise DataError(f"{path}:{i}: the prompt must be a string or a list of chat messages")
        examples.append(Located(ex | {k: row[k] for k in PASSED_THROUGH if k in row}, f"{path}:{i}"))
    return examples


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
    ap.add_argument("--model", required=True, help="directory with config.json, model.safetensors, tokenizer.json")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help="a .txt (one prompt per line) or .jsonl file")
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
    args = ap.parse_args(argv)
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

    task = None
    if args.task is not None:
        examples, task = task_examples(args)
    else:
        examples = [{"prompt": args.prompt}] if args.prompt is not None else read_prompts(args.prompts)
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
    prompts = [apply_template(ex["prompt"], args.template, ex.get("system_prompt")) for ex in examples]
    max_new_tokens = check_lengths(args, examples, [len(ids) for ids in map(tok.encode_one, prompts)], kw, source)

    dev = torch.device(args.device)
    model = from_pretrained(args.model, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    model.eval()
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    eos = torch.tensor(tok.eos_token_ids, device=dev)
    out_file = None
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out_file = open(args.out, "w", encoding="utf-8")
    stats = {"rows": 0, "samples": 0, "kept": 0, "dropped": 0, "skipped_rows": 0, "skipped_samples": 0}
    batches = range(0, len(examples), args.batch_size)
    for start in tqdm(batches, disable=len(batches) < 2 and out_file is None, desc="generate", file=sys.stderr):
        chunk = examples[start:start + args.batch_size]
        ids, mask = tok.encode(prompts[start:start + args.batch_size], device=dev)
        out = generate(model, ids, mask, max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, do_sample=args.temperature > 0, eos_token_id=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id, generator=gen, n=args.n)
        texts = tok.batch_decode(out.responses, out.response_mask)
        if out_file is None:
            for i, text in enumerate(texts):
                p = chunk[i // args.n]["prompt"]
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
    if out_file is not None:
        out_file.close()
        print(f"wrote {stats['rows']} rows ({stats['kept']} responses) to {args.out}; {stats['dropped']} of "
              f"{stats['samples']} samples dropped: sampled tokens not the tokenization of their text; "
              f"{stats['skipped_rows']} prompts skipped (fewer than {2 if rank_task else 1} responses left)",
              file=sys.stderr)
    return stats


if __name__ == "__main__":
    run_cli(main)
