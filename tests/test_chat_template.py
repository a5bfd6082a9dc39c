"""The model's own chat template (nanokl/harness/chat_template.py, Tokenizer.apply_chat_template)
against transformers' apply_chat_template on the same tokenizer files: the real Qwen2.5 and
Llama 3.1 templates (tests/chat_templates.py), the environment features templates rely on, ChatML
for a tokenizer without a template, and prompts built from verl's chat rows."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from chat_templates import LLAMA3_1, QWEN2_5
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.data import build_prompts, filter_overlong
from nanokl.tasks.rows import verl_row_to_example
from nanokl.harness.tokenizer import apply_template, load_tokenizer, train_tokenizer

transformers = pytest.importorskip("transformers")

QWEN_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA_SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
EXTRA = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>",
         "<|end_header_id|>", "<|eot_id|>"]

CHATS = [
    [{"role": "user", "content": "What is 2+3? Let's think step by step and output the final answer after \"####\"."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 17+4-9=?"}],
    [{"role": "user", "content": "  padded with spaces and a newline\n"}],  # Llama trims contents, Qwen does not
    [{"role": "user", "content": "Ünïcödé ✓ — 数学 <b>tags</b> & \"quotes\""}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "u2"}],  # several turns: the templates' loops
]


def write_tokenizer(path, template, specials):
    """tokenizer.json (a small byte-level BPE holding the special tokens) + tokenizer_config.json
    carrying `template` as a model's tokenizer_config.json does."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=EXTRA, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for chat in CHATS for m in chat] * 4, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def reference(path, messages):
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name, template, specials", [("qwen2.5", QWEN2_5, QWEN_SPECIALS),
                                                      ("llama3.1", LLAMA3_1, LLAMA_SPECIALS)])
def test_real_templates_render_as_transformers_does(tmp_path, name, template, specials):
    path = write_tokenizer(tmp_path / name, template, specials)
    tok = load_tokenizer(path)
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == reference(path, chat)
    # what each model expects to read, by hand: Qwen adds its default system turn, Llama its dated header
    one = CHATS[1][1:]
    if name == "qwen2.5":
        assert tok.apply_chat_template(one) == (
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nQ: 17+4-9=?<|im_end|>\n<|im_start|>assistant\n")
    else:
        assert tok.apply_chat_template(one) == (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ: 17+4-9=?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # a checkpoint's tokenizer (Tokenizer.save) keeps the template and the special tokens it reads
    tok.save(tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").apply_chat_template(CHATS[0]) == reference(path, CHATS[0])


@pytest.mark.parametrize("template", [
    "{{ messages | tojson }}{{ messages[0].content | tojson(indent=2) }}",  # no HTML escaping, non-ASCII kept
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.role }}]\n{% endfor %}",  # loopcontrols
    "  {% for m in messages %}\n    {{ m['content'] }}\n  {% endfor %}\n{% if add_generation_prompt %}>{% endif %}",
    "{{ bos_token }}{{ eos_token }}{{ pad_token }}|{{ unk_token is defined }}|{{ tools is none }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
])
def test_environment_features_match_transformers(tmp_path, template):
    """trim_blocks / lstrip_blocks, tojson, loop controls, special tokens as variables, namespaces,
    the generation tag: each as transformers' environment has it."""
    path = write_tokenizer(tmp_path / "t", template, {**LLAMA_SPECIALS, "pad_token": "<|endoftext|>"})
    tok = load_tokenizer(path)
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == reference(path, chat)


def test_a_template_that_refuses_the_chat_is_one_line(tmp_path):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user turn!') }}{% endif %}"
    tok = load_tokenizer(write_tokenizer(tmp_path / "t", template, QWEN_SPECIALS))
    with pytest.raises(UserError, match=r"t: chat_template: Conversation must start with a user turn!$") as err:
        tok.apply_chat_template(CHATS[1])
    assert "\n" not in str(err.value)
    broken = load_tokenizer(write_tokenizer(tmp_path / "b", "{% for m in messages %}", QWEN_SPECIALS))
    with pytest.raises(UserError, match="chat_template: Unexpected end of template"):
        broken.apply_chat_template(CHATS[0])


def test_a_chat_template_jinja_file_beside_the_config_is_read(tmp_path):
    path = write_tokenizer(tmp_path / "t", None, QWEN_SPECIALS)
    (path / "chat_template.jinja").write_text(QWEN2_5)  # where newer transformers saves it
    assert load_tokenizer(path).apply_chat_template(CHATS[0]) == reference(path, CHATS[0])


def test_the_builtin_tokenizer_writes_chatml():
    tok = train_tokenizer(["Q: 1+2=?\nA: 3"], vocab_size=300)
    assert tok.chat_template is None
    for system in (None, "Be brief."):
        chat = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Q?"}]
        assert tok.apply_chat_template(chat) == apply_template("Q?", "chatml", system)


def test_verl_chat_rows_become_prompts_in_the_model_template(tmp_path):
    """A verl row's `prompt` list is rendered by the model's template (whatever data.prompt_template
    says about text prompts), token for token what transformers' tokenizer gives, left-padded;
    filter_overlong measures that rendered text."""
    path = write_tokenizer(tmp_path / "q", QWEN2_5, QWEN_SPECIALS)
    tok, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(str(path))
    rows = [{"data_source": "openai/gsm8k", "prompt": chat, "reward_model": {"ground_truth": "1"}} for chat in CHATS[:4]]
    examples = [verl_row_to_example(r, f"row {i}") for i, r in enumerate(rows)]
    ids, mask = build_prompts(examples, tok, "plain", max_length=512)
    for b, chat in enumerate(CHATS[:4]):
        want = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids[b][mask[b].bool()].tolist() == want
    lengths = mask.sum(-1).tolist()
    limit = sorted(lengths)[1]
    assert filter_overlong(examples, tok, "plain", limit) == [e for e, n in zip(examples, lengths) if n <= limit]
