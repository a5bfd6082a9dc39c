"""Text <-> token ids: a thin layer over the `tokenizers` library, with left padding and prompts.

The idea
--------
A model directory from Hugging Face carries its tokenizer as `tokenizer.json` (the whole
pipeline: normaliser, pre-tokeniser, BPE merges, decoder), which the Rust `tokenizers` library
runs directly; `tokenizer_config.json` names the special tokens (`eos_token`, `pad_token`) and
`generation_config.json` may list extra ids that end a response (Qwen2.5-Instruct stops at both
`<|im_end|>` and `<|endoftext|>`). This module reads those three files and adds what RLHF needs:

- Left padding. A batch of prompts is padded on the *left*, so every prompt ends in the last
  column and generation appends the next token of every row in the same column. The attention
  mask (1 = real token) tells the model to skip the padding (see nanokl/engine/model.py).
- Truncation of over-long prompts as verl's `data.truncation`: "error" (the default: a prompt
  that does not fit is a mistake), "left" (keep the end) or "right" (keep the start).
- Prompt templates: "plain" feeds the text as is; "chatml" wraps it in the chat format that Qwen
  instruct models were trained on:
      <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n
- The model's own chat template (`Tokenizer.apply_chat_template`): the Jinja program in
  tokenizer_config.json's `chat_template` (or chat_template.jinja), rendered as transformers renders
  it (nanokl/harness/chat_template.py). A tokenizer without one (the built-in) writes ChatML.
- A small byte-level BPE tokenizer trained on the built-in synthetic task, with digits split one
  per token (so the model sees numbers digit by digit, which makes arithmetic learnable), saved as
  `tokenizer.json` + `tokenizer_config.json` next to the weights so `transformers` loads it too.

Byte-level BPE (GPT-2; Sennrich et al. 2016 for BPE) maps every byte to a symbol first, so any
text encodes without an unknown token and decodes back exactly. tests/test_tokenizer.py checks
left padding and truncation against hand-made expectations, exact round trips, and that
`transformers`' tokenizer loading the same file gives the same ids; tests/test_chat_template.py,
that a chat template renders as transformers' `apply_chat_template` renders it.
"""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from nanokl.harness.chat_template import SPECIAL_TOKENS, render
from nanokl.harness.config.yaml_io import UserError

CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"


def _token_str(tok):
    # tokenizer_config.json stores a special token as a string or as {"content": ...}
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_token: str, pad_token: str | None = None, extra_eos_ids=(),
                 chat_template: str | None = None, special_tokens: dict | None = None, source: str = "tokenizer"):
        self.tok = tok
        # the model's chat template (None: ChatML) and the named special tokens it may read
        self.chat_template, self.source = chat_template, source
        self.special_tokens = special_tokens if special_tokens is not None else {"eos_token": eos_token}
        self.eos_token = eos_token
        self.pad_token = pad_token or eos_token  # no pad token: pad with eos (masked out anyway)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.pad_token)
        # every id that ends a response; the first is eos_token_id
        self.eos_token_ids = [self.eos_token_id] + [i for i in extra_eos_ids if i != self.eos_token_id]

    def _id(self, token):
        i = self.tok.token_to_id(token)
        if i is None:
            raise UserError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return i

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size()

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The text the model reads for chat `messages` ([{"role", "content"}, ...]), as transformers'
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` writes it."""
        if self.chat_template is None:
            return chatml(messages, add_generation_prompt)
        return render(self.chat_template, messages, self.special_tokens, add_generation_prompt,
                      where=f"{self.source}: chat_template")

    def encode_one(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, texts, max_length=None, truncation="error", device=None):
        """Left-padded batch: (input_ids [B, T], attention_mask [B, T]); T = the longest prompt."""
        rows = [ids for ids in (e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False))]
        if max_length is not None:
            for i, ids in enumerate(rows):
                if len(ids) <= max_length:
                    continue
                if truncation == "left":
                    rows[i] = ids[-max_length:]
                elif truncation == "right":
                    rows[i] = ids[:max_length]
                else:
                    raise UserError(f"prompt {i} has {len(ids)} tokens, over data.max_prompt_length={max_length} "
                                    "(set data.truncation=left|right, or data.filter_overlong_prompts=true)")
        T = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), T), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), T), dtype=torch.long)
        for i, ids in enumerate(rows):
            if ids:
                input_ids[i, T - len(ids):] = torch.tensor(ids)
                attention_mask[i, T - len(ids):] = 1
        return input_ids.to(device), attention_mask.to(device)

    def decode(self, ids, skip_special_tokens=True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows, mask=None, skip_special_tokens=True) -> list[str]:
        """Decode each row, keeping only the positions where `mask` is 1 (e.g. a response mask)."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else rows
        if mask is not None:
            mask = mask.tolist() if isinstance(mask, torch.Tensor) else mask
            rows = [[t for t, m in zip(r, mr) if m] for r, mr in zip(rows, mask)]
        return self.tok.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def save(self, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(path / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
               "pad_token": self.pad_token, "model_max_length": 1 << 30, "padding_side": "left"}
        # a checkpoint of a chat model keeps its chat format: a resumed run renders prompts alike
        cfg.update({k: v for k, v in self.special_tokens.items() if k not in cfg})
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def right_pad(seqs, pad_id):
    """Token lists -> right-padded (ids, mask) [N, max len]: training batches (SFT, reward model),
    where every row starts at position 0; generation instead left-pads (Tokenizer.encode)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def load_tokenizer(path) -> Tokenizer:
    """Read tokenizer.json (+ tokenizer_config.json, generation_config.json) from a directory."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"{path}: no tokenizer.json (nanokl reads fast-tokenizer files only)")
    try:
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the Rust parser's one error type, for a damaged file or a foreign one
        raise UserError(f"{path / 'tokenizer.json'}: not a readable tokenizer ({' '.join(str(e).split())})") from None
    tcfg, gen = _json_object(path / "tokenizer_config.json"), _json_object(path / "generation_config.json")
    eos, pad = _token_str(tcfg.get("eos_token")), _token_str(tcfg.get("pad_token"))
    extra = gen.get("eos_token_id", [])
    extra = [extra] if isinstance(extra, int) else extra
    if not (isinstance(extra, list) and all(type(i) is int for i in extra)
            and all(t is None or isinstance(t, str) for t in (eos, pad))):
        raise UserError(f"{path}: eos_token and pad_token (tokenizer_config.json) must be strings, and eos_token_id "
                        "(generation_config.json) a token id or a list of them")
    if eos is None:
        if not extra:
            raise UserError(f"{path}: no eos_token in tokenizer_config.json nor eos_token_id in generation_config.json")
        eos = tok.id_to_token(extra[0])
        if eos is None:
            raise UserError(f"{path}: eos_token_id {extra[0]} (generation_config.json) is not in the vocabulary")
    specials = {k: _token_str(tcfg[k]) for k in SPECIAL_TOKENS if isinstance(_token_str(tcfg.get(k)), str)}
    try:
        return Tokenizer(tok, eos, pad, extra, chat_template=_chat_template(path, tcfg), special_tokens=specials,
                         source=str(path))
    except UserError as e:  # a special token the vocabulary lacks: say which directory's
        raise UserError(f"{path}: {e}") from None


def _chat_template(path: Path, tcfg: dict) -> str | None:
    """tokenizer_config.json's chat_template (a string, or a list of named ones: the "default"),
    else chat_template.jinja's text (where newer transformers saves it), else None."""
    template = tcfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{path}: chat_template (tokenizer_config.json) must be a string or a list of "
                        "{name, template} with a 'default'")
    return template


def _json_object(file: Path) -> dict:
    """A JSON object from `file`, {} when there is no such file."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON, or not UTF-8 text
        raise UserError(f"{file}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(value, dict):
        raise UserError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def train_tokenizer(texts, vocab_size=512, eos_token="<|endoftext|>", pad_token="<|pad|>",
                    extra_special=("<|im_start|>", "<|im_end|>")) -> Tokenizer:
    """Byte-level BPE with one token per digit, trained on `texts` (the synthetic task's)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token, pad_token, *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, eos_token, pad_token)


def chatml(messages: list, add_generation_prompt: bool = True) -> str:
    """Chat messages in ChatML, each turn `<|im_start|>role\\ncontent<|im_end|>\\n`, then the assistant's header."""
    turns = "".join(CHATML.format(role=m["role"], content=m["content"]) for m in messages)
    return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def apply_template(prompt: str, template="plain", system_prompt=None) -> str:
    """The text the model is conditioned on: `prompt` as is, or wrapped in ChatML."""
    if template == "plain":
        return prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
    if template == "chatml":
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        return chatml(system + [{"role": "user", "content": prompt}])
    raise UserError(f"unknown prompt template {template!r} (valid: plain, chatml)")
