"""A model's own chat template: the Jinja program in its tokenizer_config.json that writes a chat as text.

The idea
--------
An instruct model was trained on chats written in one exact format: Qwen2.5 wraps every turn in
`<|im_start|>role ... <|im_end|>` and adds a default system turn when there is none, Llama 3.1
opens with `<|begin_of_text|>`, a system header with a knowledge-cutoff date, and
`<|start_header_id|>role<|end_header_id|>` turns. Feed it a prompt in any other format and it is
a different (worse) policy before RL has done anything. The model ships the format with itself:
`tokenizer_config.json`'s `chat_template` (or a `chat_template.jinja` file beside it) is a Jinja
program that turns a list of messages `[{"role", "content"}, ...]` into the text the model reads.
`add_generation_prompt=True` appends the header of the assistant's turn, so the model's next
token starts its answer. verl renders every prompt this way (`tokenizer.apply_chat_template`).

`render` does what `transformers`' `apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)` does, with the same Jinja environment, because templates rely on it:

- a sandboxed environment (a template is code from the Hub: it may not touch Python internals),
  with `trim_blocks` and `lstrip_blocks` (a `{% ... %}` tag eats its own line's newline and
  indentation, so a template can be indented for reading and still emit no stray whitespace),
  and the `loopcontrols` extension (`{% break %}`, `{% continue %}`);
- `raise_exception(msg)` (a template refuses a chat it cannot write, e.g. roles not
  alternating), `strftime_now(fmt)` (Llama 3's "Today Date"), and a `tojson` filter that keeps
  non-ASCII text and does not HTML-escape (Jinja's own escapes `<` as `\\u003c`);
- the tokenizer's special tokens as variables (`bos_token`, `eos_token`, ...), `tools` and
  `documents` as None, and messages with None-valued keys dropped;
- `{% generation %}...{% endgeneration %}` (marks assistant text for training masks) renders its
  body: nanokl only renders prompts.

A template's `raise_exception` and its syntax errors become one-line `UserError`s naming the file.
tests/test_chat_template.py compares `render` with transformers' `apply_chat_template` on the real
Qwen2.5 and Llama 3.1 templates.
"""

import functools
import json
from datetime import datetime

from nanokl.harness.config.yaml_io import UserError

# the named special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)  # one template per model, compiled once
def compile_template(source: str):
    """The Jinja template object of `source`, in transformers' environment (the module docstring)."""
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("rendering a model's chat template needs jinja2 (pip install jinja2)") from None

    class Generation(Extension):  # {% generation %} ... {% endgeneration %}: the body, unchanged
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render(source: str, messages: list, special_tokens: dict | None = None, add_generation_prompt: bool = True,
           where: str = "chat template") -> str:
    """The text of `messages` written by template `source`, ending in the assistant's header
    when `add_generation_prompt`; `special_tokens` are the tokenizer's (bos_token, ...)."""
    import jinja2  # compile_template has checked it is there
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return compile_template(source).render(messages=chat, tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **(special_tokens or {}))
    except jinja2.exceptions.TemplateError as e:  # raise_exception, or the template's own syntax error
        raise UserError(f"{where}: {' '.join(str(e).split())}") from None
