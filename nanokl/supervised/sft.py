"""Supervised warm start: the reference policy that PPO starts from and is regularised towards.

The idea
--------
RLHF never starts from scratch: a pretrained model is first fine-tuned on demonstrations
(supervised fine-tuning, SFT), and that SFT model becomes both PPO's initial policy and its
reference π_ref, the anchor of the KL penalty (Ouyang et al. 2022, InstructGPT; Ziegler et al.
2019). For the CPU course we have no pretrained model, so this file makes one: it trains a small
byte-level BPE tokenizer on the task's demonstrations (nanokl/harness/tokenizer.py) and a tiny
Qwen2-shaped decoder on them, then saves both in Hugging Face format, a directory that
`transformers`, generate.py and train_ppo.py all load. The demonstrations are the task's
(data.task, nanokl/tasks/: `demonstrations`), drawn with seed trainer.seed; a task without any
cannot be warm-started here.

The loss is next-token cross-entropy on the *response* only (solution + EOS): the prompt is
given, not imitated, exactly as in verl's SFT trainer. With `sft.steps` kept short the model
learns the format of the arithmetic task (chain of thought, `#### N`, EOS) and much of the
arithmetic but stays clearly imperfect, which leaves PPO something to improve; the held-out
greedy accuracy it reaches (by the task's rule) is printed and saved in `sft_metrics.json`.

    python -m nanokl.supervised.sft                       # the default config (configs/arith_tiny.yaml)
    python -m nanokl.supervised.sft --config C.yaml sft.steps=300

train_ppo.py calls `train_sft(cfg)` itself when the default reference checkpoint is missing.
tests/test_sft.py checks that the loss counts response tokens only (against a hand-computed
cross-entropy) and that a short run saves a checkpoint that transformers loads.
"""

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nanokl.harness.config.yaml_io import UserError, run_cli
from nanokl.harness.config.load import parse_cli
from nanokl.harness.data import build_prompts
from nanokl.harness.hf_format import save_pretrained
from nanokl.harness.tokenizer import apply_template, right_pad, train_tokenizer
from nanokl.harness.world import pick_device
from nanokl.engine.model import CausalLM, ModelConfig, init_weights
from nanokl.rollout import generate
from nanokl.tasks import get_task


def demo_texts(examples) -> list[str]:
    """prompt + solution of each demonstration: the text the tokenizer learns from."""
    return [ex["prompt"] + ex["solution"] for ex in examples]


def encode_demos(examples, tok, template):
    """(input_ids, attention_mask, loss_mask), right-padded: loss_mask is 1 on response tokens."""
    rows = []
    for ex in examples:
        p = tok.encode_one(apply_template(ex["prompt"], template))
        r = tok.encode_one(ex["solution"]) + [tok.eos_token_id]
        rows.append((p, r))
    ids, attn = right_pad([p + r for p, r in rows], tok.pad_token_id)
    loss_mask, _ = right_pad([[0] * len(p) + [1] * len(r) for p, r in rows], 0)
    return ids, attn, loss_mask


def sft_loss(model, ids, attn, loss_mask):
    """Mean cross-entropy of the response tokens: token t+1 predicted from positions <= t."""
    logits = model(ids, attn)[:, :-1]
    target, m = ids[:, 1:], loss_mask[:, 1:].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none")
    return (nll.view_as(m) * m).sum() / m.sum()


@torch.no_grad()
def greedy_accuracy(model, tok, examples, score, template, max_new_tokens, batch_size=256):
    """Share of examples whose greedy response scores 1 under the task's rule `score`."""
    model.eval()
    hits = 0.0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        ids, mask = build_prompts(chunk, tok, template, device=next(model.parameters()).device)
        out = generate(model, ids, mask, max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out.responses, out.response_mask)
        hits += sum(score(t, ex) for t, ex in zip(texts, chunk))
    model.train()
    return hits / max(len(examples), 1)


def adamw_cosine(model, lr, steps):
    """AdamW (betas 0.9/0.95, weight decay 0.01) with linear warm-up over the first 5% of `steps`,
    then cosine down to 10% of `lr`: the small supervised runs' schedule (SFT, reward model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(k / steps, 1.0))))
    return opt, sched


def train_sft(cfg, progress=True) -> Path:
    """Train tokenizer + tiny model on the task's demonstrations; save to sft.output_dir."""
    s, d = cfg.sft, cfg.data
    task = get_task(d.task)
    if task.demonstrations is None:
        raise UserError(f"data.task={d.task} has no demonstrations to warm-start from: give "
                        "actor_rollout_ref.model.path a policy to start PPO from")
    device = pick_device(cfg.trainer.device)
    train, val = task.examples(d, num_train=s.num_examples, seed=cfg.trainer.seed)
    train = task.demonstrations(train, s, seed=cfg.trainer.seed)
    tok = train_tokenizer(demo_texts(train[:5000]), vocab_size=s.vocab_size)
    mcfg = ModelConfig(model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=s.hidden_size,
                       intermediate_size=s.intermediate_size, num_hidden_layers=s.num_hidden_layers,
                       num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
                       max_position_embeddings=s.max_position_embeddings, rope_theta=10000.0,
                       tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):  # its own seeded stream: the caller's global generator is left as it was
        torch.manual_seed(cfg.trainer.seed)
        model = init_weights(CausalLM(mcfg), std=0.02).to(device).train()
    opt, sched = adamw_cosine(model, s.lr, s.steps)
    ids, attn, loss_mask = encode_demos(train, tok, d.prompt_template)
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    bar = tqdm(range(s.steps), desc="sft warm start", disable=not progress, file=sys.stderr)
    for _ in bar:
        rows = torch.randint(0, len(train), (s.batch_size,), generator=gen)
        T = int(attn[rows].sum(-1).max())  # trim the batch's common right padding
        loss = sft_loss(model, ids[rows, :T].to(device), attn[rows, :T].to(device), loss_mask[rows, :T].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    acc = greedy_accuracy(model, tok, val, task.score, d.prompt_template, d.max_response_length)
    out = Path(s.output_dir)
    save_pretrained(model, out)
    tok.save(out)
    metrics = {"val_greedy_acc": acc, "final_loss": loss.item(), "steps": s.steps,
               "params": sum(p.numel() for p in model.parameters())}
    (out / "sft_metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"sft: held-out greedy accuracy {acc:.3f} ({len(val)} problems); saved to {out}", file=sys.stderr)
    return out


def main(argv=None):
    train_sft(parse_cli(argv))


if __name__ == "__main__":
    run_cli(main)
