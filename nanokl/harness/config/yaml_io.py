"""From YAML files and `key=value` arguments to one merged tree of values, with one-line errors.

`config.py` says *what* the knobs are; this file says *how* text becomes a tree of plain values
(dicts, lists, scalars), and `config/build.py` how that tree becomes the typed dataclasses. It
knows nothing about PPO: every function here works on any nesting of mappings.

The first two steps of `load.load_config`:

1. `load_yaml_chain(path)` reads a YAML file. A top-level `defaults: [a.yaml, b.yaml]` list
   names files (relative to this one) to load first; later entries override earlier ones and
   the file itself overrides them all. Mappings are deep-merged, anything else (lists
   included) is replaced whole. A file that reaches itself again is a cycle and an error.
   An empty file (nothing, or only comments) is refused, naming it: it would run the defaults.
2. `apply_override(tree, origins, "a.b.c=value")` merges one command-line argument on top.
   The value is parsed by `yaml.safe_load`, so `0.03`, `true`, `null`, `[console,wandb]` all
   mean what they would mean in a file. Hydra's prefixes as verl's scripts write them: `+a.b=v`
   adds a key not set yet, `++a.b=v` sets it, `~a.b` deletes it (its default again).
3. `interpolate(tree, defaults)` then replaces each `${a.b}` by that key's merged value.

Along the way we keep `origins`, a dict from dotted key to where it was last set
("configs/arith_tiny.yaml:12" or "argument 'a.b=1'"). Line numbers come from `yaml.compose`,
which keeps the position of every mapping key; `yaml.safe_load` alone throws them away. When
anything later fails on a key, `ConfigError.locate(origins)` prefixes the message with that
place, the way a compiler points at a line.

Every error is a `ConfigError`: one line, naming the full dotted key. `run_cli` turns it (and
any other `UserError`) into `error: <message>` on stderr and exit status 2, with no
traceback, because a typo in a config is the user's to fix, not a bug to debug.
"""

import copy
import difflib
import functools
import os
import re
import sys
from typing import Any

import yaml

from nanokl.tasks.rows import UserError  # the one-line error's class (raised here as ConfigError)


class ConfigError(UserError, ValueError):
    """A bad config key or value. `keys` are the dotted keys involved, most relevant first;
    `where` is the file:line or command-line argument that set it, once known."""

    def __init__(self, message: str, keys=(), where: str | None = None):
        self.message = " ".join(str(message).split())  # one line, always
        self.keys = (keys,) if isinstance(keys, str) else tuple(keys)
        self.where = where
        super().__init__(self.message)

    def locate(self, origins: dict) -> "ConfigError":
        """Fill `where` from whichever of our keys was set last (origins is in setting order)."""
        if self.where is None:
            order = {key: i for i, key in enumerate(origins)}
            # "trainer.logger[1]" was set as "trainer.logger" (a key may hold a "[" itself: a typo)
            bases = [k if k in origins else k.split("[")[0] for k in self.keys]
            bases = [k for k in bases if k in origins]
            if bases:
                self.where = origins[max(bases, key=order.get)]
        return self

    def __str__(self):
        return f"{self.where}: {self.message}" if self.where else self.message


def run_cli(main, *args, **kwargs):
    """Call `main(*args, **kwargs)`; a `UserError` becomes one line on stderr and exit status 2."""
    try:
        return main(*args, **kwargs)
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------------------------------
# 1. YAML files, their line numbers, and the `defaults:` chain
# ---------------------------------------------------------------------------------------------

class _SafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader whose every failure is a YAMLError with a line. PyYAML's own constructors raise
    ValueError, KeyError and the like for a scalar that resolves to a type it does not hold:
    `2024-13-45` is a date to YAML 1.1, `!!bool maybe`, an int of more digits than Python converts."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as e:
            value = node.value if isinstance(node.value, str) else ""
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {value[:40]!r} as {node.tag.rsplit(':', 1)[-1]} ({e})",
                node.start_mark) from None


def read_yaml(path: str) -> tuple[dict, dict]:
    """One YAML file -> (data, origins), origins mapping each dotted key to 'path:line'."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # e.object is the whole file: read() decodes it in one piece
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text (byte {e.object[e.start]:#04x})", where=f"{path}:{line}") from None
    try:
        data = yaml.load(text, Loader=_SafeLoader)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"YAML syntax error: {problem}", where=where) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError("YAML nested too deeply", where=path) from None
    if data is None:  # nothing, blank lines, comments or a bare `~`: it would silently run the defaults
        raise ConfigError("empty config file: it sets no key (write the sections it changes, or leave "
                          "--config out to run the defaults)", where=path)
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping of sections, got {type(data).__name__}",
                          where=f"{path}:1")
    origins = {}
    _record_key_lines(node, "", path, origins)
    return data, origins


def _record_key_lines(node, prefix: str, path: str, origins: dict, _inside: tuple = ()) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    if any(node is n for n in _inside):  # an alias to an enclosing mapping (`a: &x {b: *x}`) never ends
        raise ConfigError(f"'{prefix.rstrip('.')}' contains itself (a recursive YAML alias)",
                          where=f"{path}:{node.start_mark.line + 1}")
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # YAML `<<: *anchor`; its keys live elsewhere
            continue
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
            raise ConfigError(f"keys must be strings, got {key_node.value!r} under "
                              f"'{prefix.rstrip('.') or '<top>'}'", where=f"{path}:{line}")
        key = prefix + key_node.value
        origins[key] = f"{path}:{line}"
        _record_key_lines(value_node, key + ".", path, origins, _inside + (node,))


def load_yaml_chain(path: str, _stack: tuple = ()) -> tuple[dict, dict]:
    """Load `path` and, first, the files its `defaults:` list names; return (merged, origins)."""
    path = os.path.normpath(str(path))
    if os.path.isabs(path) and not os.path.relpath(path).startswith(".."):
        path = os.path.relpath(path)  # messages read better as configs/x.yaml:12
    data, origins = read_yaml(path)
    defaults = data.pop("defaults", None) or []
    where = origins.pop("defaults", path)
    if not isinstance(defaults, list) or not all(isinstance(d, str) and "\0" not in d for d in defaults):
        raise ConfigError(f"'defaults' must be a list of file paths, got {defaults!r}", where=where)
    stack = _stack + ((os.path.realpath(path), path),)
    merged, merged_origins = {}, {}
    for entry in defaults:
        sub = os.path.normpath(os.path.join(os.path.dirname(path), entry))
        if os.path.realpath(sub) in [real for real, _ in stack]:
            chain = " -> ".join([shown for _, shown in stack] + [sub])
            raise ConfigError(f"cycle in defaults: {chain}", where=where)
        if not os.path.exists(sub):
            raise ConfigError(f"defaults entry '{entry}' not found (looked for {sub})", where=where)
        sub_data, sub_origins = load_yaml_chain(sub, stack)
        merge_into(merged, merged_origins, sub_data, sub_origins)
    merge_into(merged, merged_origins, data, origins)
    return merged, merged_origins


def merge_into(dst: dict, dst_origins: dict, src: dict, src_origins: dict, prefix: str = "") -> None:
    """Deep-merge `src` into `dst` in place: mappings merge key by key, anything else replaces.

    `dst_origins` follows along: a replaced value forgets where its old sub-keys came from."""
    for k, v in src.items():
        key = prefix + str(k)
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge_into(dst[k], dst_origins, v, src_origins, key + ".")
        else:
            dst[k] = copy.deepcopy(v)
            for p in [p for p in dst_origins if p.startswith(key + ".")]:
                del dst_origins[p]
            dst_origins.update({p: o for p, o in src_origins.items() if p.startswith(key + ".")})
        if key in src_origins:
            dst_origins.pop(key, None)  # re-insert at the end: origins stay in the order keys were set
            dst_origins[key] = src_origins[key]


# ---------------------------------------------------------------------------------------------
# 2. Command-line overrides: a.b.c=value, and Hydra's +a.b=value, ++a.b=value, ~a.b
# ---------------------------------------------------------------------------------------------

def parse_override(arg: str) -> tuple[str, list[str], Any]:
    """'+algorithm.kl_ctrl.target_kl=0.03' -> ('+', ['algorithm', 'kl_ctrl', 'target_kl'], 0.03).

    The prefix is Hydra's: '' or '++' set the key, '+' adds one that is not yet set, '~' deletes
    (`~a.b`, or `~a.b=value`: only if that is its value; the value is then the one to match, else _ANY)."""
    key, sep, text = arg.partition("=")
    key = key.strip()
    prefix = next((p for p in ("++", "+", "~") if key.startswith(p)), "")
    parts = key[len(prefix):].split(".")
    if not all(parts) or not (sep or prefix == "~"):
        raise ConfigError(f"bad override {arg!r}: expected key.sub=value (or Hydra's +key=value, ++key=value, "
                          f"~key), e.g. algorithm.kl_ctrl.target_kl=0.03")
    if prefix == "~" and not text.strip():
        return prefix, parts, _ANY
    try:
        value = yaml.load(text, Loader=_SafeLoader)
    except (yaml.YAMLError, RecursionError) as e:
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ConfigError(f"bad override {arg!r}: cannot parse the value {text!r} ({problem})") from None
    return prefix, parts, value


_ANY = object()  # `~key` with no value: delete whatever the key holds
_MISSING = object()


def _find(tree, parts):
    """The value at `parts` in a tree of dicts (and lists, by index), or _MISSING."""
    for p in parts:
        if isinstance(tree, dict) and p in tree:
            tree = tree[p]
        elif isinstance(tree, list) and p.isdigit() and int(p) < len(tree):
            tree = tree[int(p)]
        else:
            return _MISSING
    return tree


def _dotted(tree, prefix=""):
    for k, v in tree.items():
        yield prefix + str(k)
        if isinstance(v, dict):
            yield from _dotted(v, f"{prefix}{k}.")


def apply_override(tree: dict, origins: dict, arg: str, defaults: dict | None = None) -> None:
    """Merge one `key=value` argument into `tree`, as if it were a one-key YAML file on top.

    Hydra's prefixes: `+key=value` adds a key the files and earlier arguments have not set (set
    already: refused, naming where); `++key=value` is `key=value`; `~key` deletes the key from the
    tree, so it takes its default again (`~key=value`: only if its value is that one). `defaults`,
    the tree of default values, lets `~` check the key exists and, when the tree lacks it, its value."""
    prefix, parts, value = parse_override(arg)
    key, where = ".".join(parts), f"argument {arg!r}"
    current = _find(tree, parts)
    if prefix == "+" and current is not _MISSING:
        raise ConfigError(f"+{key} adds a key that is not set yet, but {key} is already set"
                          f"{' at ' + origins[key] if key in origins else ''}: write {key}=... or ++{key}=... to "
                          f"override it", keys=key, where=where)
    if prefix == "~":
        held = current if current is not _MISSING else _MISSING if defaults is None else _find(defaults, parts)
        if held is _MISSING and defaults is not None:
            near = difflib.get_close_matches(key, list(_dotted(defaults)), n=2, cutoff=0.75)
            hint = "; did you mean " + " or ".join(near) + "?" if near else ""
            raise ConfigError(f"~{key}: no such key to delete{hint}", keys=key, where=where)
        if value is not _ANY and held is not _MISSING and held != value:
            raise ConfigError(f"~{key}={value!r}: {key} is {held!r}, not {value!r} (nothing deleted)", keys=key,
                              where=where)
        if current is not _MISSING and isinstance(_find(tree, parts[:-1]), dict):
            del _find(tree, parts[:-1])[parts[-1]]
            for p in [p for p in origins if p == key or p.startswith(key + ".")]:
                del origins[p]
        return
    layer = value
    for p in reversed(parts):
        layer = {p: layer}
    layer_origins = {".".join(parts[:i + 1]): where for i in range(len(parts))}
    if isinstance(value, dict):  # a mapping value: every key inside it came from this argument too
        _record_dict_keys(value, key + ".", where, layer_origins)
    merge_into(tree, origins, layer, layer_origins)


def _record_dict_keys(d: dict, prefix: str, where: str, out: dict, _inside: tuple = ()) -> None:
    if any(d is e for e in _inside):  # `x=&r {a: *r}`: a mapping inside itself
        raise ConfigError(f"bad override: '{prefix.rstrip('.')}' contains itself (a recursive YAML alias)",
                          where=where)
    for k, v in d.items():
        out[prefix + str(k)] = where
        if isinstance(v, dict):
            _record_dict_keys(v, prefix + str(k) + ".", where, out, _inside + (d,))


# ---------------------------------------------------------------------------------------------
# 3. ${a.b} interpolation, resolved once the files and arguments are merged
# ---------------------------------------------------------------------------------------------

_REF = re.compile(r"(?<!\\)\$\{([^{}]*)\}")


def interpolate(tree: dict, defaults: dict) -> None:
    """Replace, in place, each `${a.b}` in the tree's strings by the value of key a.b in the merged
    config: `tree` over `defaults` (the tree of default values), whichever file or argument set it
    and in whatever order, as OmegaConf does. A string that is exactly one `${a.b}` takes a.b's
    value with its type (`${data.train_batch_size}` is an int); inside a longer string the value is
    written out (`ckpt/${trainer.project_name}`). `${.b}` is a sibling, `${..b}` the parent's;
    `\\${` is a literal `${`. A reference to no key, a cycle, or a resolver (`${oc.env:X}`) is a
    ConfigError naming the key that holds it."""
    merged = copy.deepcopy(defaults)
    merge_into(merged, {}, tree, {})
    done = {}

    def value_of(key, stack):
        if key in stack:
            raise ConfigError(f"interpolation cycle: {' -> '.join(stack + (key,))}", keys=stack[:1])
        if key not in done:
            value = _find(merged, key.split("."))
            if value is _MISSING:
                raise ConfigError(f"{stack[-1]}: ${{{key}}} refers to no key", keys=stack[:1])
            done[key] = resolved(value, key, stack + (key,))
        return done[key]

    def resolved(value, key, stack, inside=()):
        if isinstance(value, (dict, list)) and not any(value is v for v in inside):  # (`&r [*r]`: build refuses it)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            out = {k: resolved(v, f"{key}.{k}", stack, inside + (value,)) for k, v in items}
            return out if isinstance(value, dict) else list(out.values())
        if not isinstance(value, str) or "${" not in value:
            return value
        refs = [(m, target(m.group(1), key, stack)) for m in _REF.finditer(value)]
        if len(refs) == 1 and refs[0][0].group(0) == value:  # the whole string: the value, typed
            return copy.deepcopy(value_of(refs[0][1], stack))
        text = _REF.sub(lambda m: str(value_of(target(m.group(1), key, stack), stack)), value)
        return text.replace("\\${", "${")

    def target(ref, key, stack):
        ref = ref.strip()
        if ":" in ref or not ref.strip("."):
            why = " (resolvers such as oc.env are not supported: write the value)" if ":" in ref else ""
            raise ConfigError(f"{key}: ${{{ref}}} is not a key{why}", keys=stack[:1])
        dots = len(ref) - len(ref.lstrip("."))
        if dots:  # relative: ${.b} beside this key, ${..b} beside its parent
            base = key.split(".")[:-dots]
            ref = ".".join(base + [ref[dots:]])
        return ref

    def walk(node, prefix, inside=()):
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            key = f"{prefix}{k}" if isinstance(node, dict) else f"{prefix[:-1]}[{k}]"  # as ConfigError.locate reads it
            if isinstance(v, str) and "${" in v:
                node[k] = resolved(v, key, (key,))
            elif isinstance(v, (dict, list)) and not any(v is n for n in inside):
                walk(v, key + ".", inside + (node,))
    walk(tree, "")


def get_key(cfg, key: str):
    """The value at a dotted key ("actor_rollout_ref.actor.ppo_epochs") of a config object."""
    return functools.reduce(getattr, key.split("."), cfg)
