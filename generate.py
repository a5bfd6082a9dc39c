"""Sample completions from a Hugging Face-format checkpoint with nanokl's rollout engine.

    python generate.py --model runs/arith_tiny/sft --prompt "Q: 12 + 30 - 7 = ?
A:"
    python generate.py --model DIR --prompts prompts.txt --n 4 --temperature 0.7 --top-p 0.9

`--prompts` reads one prompt per line from a text file, or the "prompt" (else "question") field of
each line of a .jsonl file. Prompts run in batches through `nanokl.rollout.generate` (static KV
cache; CUDA graphs on a GPU), with a progress bar when there is more than one batch.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from nanokl.harness.config_io import UserError, run_cli
from nanokl.harness.hf_format import from_pretrained
from nanokl.rollout import generate
from nanokl.harness.tokenizer import apply_template, load_tokenizer


def read_prompts(path):
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompts file {str(path)!r} does not exist")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for i, ln in enumerate(lines, 1):
        try:
            row = json.loads(ln)
            prompts.append(row["prompt"] if "prompt" in row else row["question"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{i}: expected a JSON object with a 'prompt' or 'question' field") from None
    return prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="directory with config.json, model.safetensors, tokenizer.json")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help="a .txt (one prompt per line) or .jsonl file")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--template", default="plain", choices=["plain", "chatml"])
    ap.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    model = from_pretrained(args.model, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    model.eval()
    tok = load_tokenizer(args.model)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    batches = range(0, len(prompts), args.batch_size)
    for start in tqdm(batches, disable=len(batches) < 2, desc="generate", file=sys.stderr):
        chunk = prompts[start:start + args.batch_size]
        ids, mask = tok.encode([apply_template(p, args.template) for p in chunk], device=dev)
        out = generate(model, ids, mask, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, do_sample=args.temperature > 0, eos_token_id=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id, generator=gen, n=args.n)
        texts = tok.batch_decode(out.responses, out.response_mask)
        for i, text in enumerate(texts):
            p = chunk[i // args.n]
            head = f"=== prompt {start + i // args.n}" + (f", sample {i % args.n}" if args.n > 1 else "")
            tqdm.write(f"{head} ===\n{p}{text}\n", file=sys.stdout)


if __name__ == "__main__":
    run_cli(main)
