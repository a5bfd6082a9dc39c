"""From YAML files and `key=value` arguments to a typed dataclass, with one-line errors.

`config.py` says *what* the knobs are; this file says *how* text becomes those knobs. It knows
nothing about PPO: every function here works on any tree of dataclasses.

The pipeline, in the order `config.load_config` runs it:

1. `load_yaml_chain(path)` reads a YAML file. A top-level `defaults: [a.yaml, b.yaml]` list
   names files (relative to this one) to load first; later entries override earlier ones and
   the file itself overrides them all. Mappings are deep-merged, anything else (lists
   included) is replaced whole. A file that reaches itself again is a cycle and an error.
2. `apply_override(tree, origins, "a.b.c=value")` merges one command-line argument on top.
   The value is parsed by `yaml.safe_load`, so `0.03`, `true`, `null`, `[console,wandb]` all
   mean what they would mean in a file.
3. `build(cls, tree, ...)` turns the merged dict into dataclasses, checking every key and
   type against the annotations: an unknown key names the closest valid ones, a wrong type
   names the expected type. The few coercions are the ones that cannot surprise anybody:
   int -> float, a list -> a tuple field, and a string that spells a float -> float, because
   PyYAML follows YAML 1.1, in which `1e-6` (no dot) is a *string*. An infinite or NaN value
   (`.inf`, `.nan`, `inf`) is refused for every float key, whatever the key: none means it.
   An empty file (nothing, or only comments) is refused too, naming it: it would run the defaults.

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
import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from typing import Any, Literal, Union

import yaml


class UserError(Exception):
    """A mistake in what the user gave us (config, paths, data): reported in one line, no traceback.

    Other modules raise it for user-fixable problems (a missing model directory, a malformed
    data line); `run_cli` prints it as `error: <message>` and exits with status 2."""


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
            bases = [k.split("[")[0] for k in self.keys]  # "trainer.logger[1]" was set as "trainer.logger"
            bases = [k for k in bases if k in origins]
            if bases:
                self.where = origins[max(bases, key=order.get)]
        return self

    def __str__(self):
        return f"{self.where}: {self.message}" if self.where else self.message


class NotFinite(ConfigError):
    """An infinite or NaN value for a float key (refused for every one of them, by `coerce`)."""


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
# 2. Command-line overrides: a.b.c=value
# ---------------------------------------------------------------------------------------------

def parse_override(arg: str) -> tuple[list[str], Any]:
    """'algorithm.kl_ctrl.target_kl=0.03' -> (['algorithm', 'kl_ctrl', 'target_kl'], 0.03)."""
    key, sep, text = arg.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"bad override {arg!r}: expected key.sub=value, "
                          f"e.g. algorithm.kl_ctrl.target_kl=0.03")
    try:
        value = yaml.load(text, Loader=_SafeLoader)
    except (yaml.YAMLError, RecursionError) as e:
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ConfigError(f"bad override {arg!r}: cannot parse the value {text!r} ({problem})") from None
    return parts, value


def apply_override(tree: dict, origins: dict, arg: str) -> None:
    """Merge one `key=value` argument into `tree`, as if it were a one-key YAML file on top."""
    parts, value = parse_override(arg)
    layer = value
    for p in reversed(parts):
        layer = {p: layer}
    where = f"argument {arg!r}"
    layer_origins = {".".join(parts[:i + 1]): where for i in range(len(parts))}
    if isinstance(value, dict):  # a mapping value: every key inside it came from this argument too
        _record_dict_keys(value, ".".join(parts) + ".", where, layer_origins)
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
# 3. dict -> dataclasses, checking keys and types against the annotations
# ---------------------------------------------------------------------------------------------

def all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass tree, sections included: the universe for suggestions."""
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, prefix + f.name + ".")
    return keys


def build(cls, data: dict, prefix: str = "", universe: list[str] | None = None):
    """Construct dataclass `cls` from `data`; keys not in `data` keep their defaults.

    A class may declare `RENAMED = {"old_name": "new_name"}` to accept a key verl renamed."""
    universe = all_keys(cls) if universe is None else universe
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    data = dict(data)
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in data and data[old] is None:  # verl's own files write the old name as `warmup_style: null`
            del data[old]
        if old in data:
            if new in data:
                raise ConfigError(f"set only one of {prefix}{old} and {prefix}{new} (same knob, "
                                  f"{old} is its older verl name)", keys=(prefix + old, prefix + new))
            data[new] = data.pop(old)
    for k in data:
        if k not in names:
            raise _unknown_key(prefix, str(k), names, universe)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in data.items():
        f = fields[k]
        if hasattr(hints[k], "DROPS") and isinstance(v, dict) and f.default_factory is not dataclasses.MISSING:
            # a section whose default is an instance with its own values (the KL monitor's adjust
            # rules, which declare DROPS): the keys given override that instance's values, not the
            # class's defaults
            base = to_dict(f.default_factory())
            for given, drop in hints[k].DROPS.items():  # e.g. a value replaces a default factor
                if given in v:
                    for d in drop:
                        base.pop(d, None)
            data[k] = {**base, **v}
    kwargs = {k: coerce(v, hints[k], prefix + k, universe) for k, v in data.items()}
    return cls(**kwargs)


def _unknown_key(prefix: str, name: str, siblings: list[str], universe: list[str]) -> ConfigError:
    key = prefix + name
    # Closest siblings first (a typo), then the same or a similar name elsewhere (a key put in
    # the wrong section), then whole-path look-alikes.
    near = [prefix + s for s in difflib.get_close_matches(name, siblings, n=3, cutoff=0.6)]
    leaves = {}
    for path in universe:
        leaves.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    near += leaves.get(name, [])
    for leaf in difflib.get_close_matches(name, list(leaves), n=3, cutoff=0.75):
        near += leaves[leaf]
    elsewhere = [p for p in universe if not p.startswith(prefix)]  # siblings were matched above
    near += difflib.get_close_matches(key, elsewhere, n=3, cutoff=0.85)
    near = [p for p in dict.fromkeys(near) if p != key and not key.startswith(p + ".")][:4]
    if near:
        hint = "did you mean " + " or ".join(near) + "?"
    else:
        hint = f"valid keys in {prefix.rstrip('.') or 'the top level'}: {', '.join(siblings)}"
    return ConfigError(f"unknown key '{key}'; {hint}", keys=key)


def coerce(value, tp, key: str, universe: list[str] | None = None):
    """Check `value` against annotation `tp` (converting the few safe cases); else ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} is a section; expected a mapping of its keys, got {_show(value)}",
                              keys=key)
        return build(tp, value, key + ".", universe)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in args:
            if arm is not type(None):
                try:
                    return coerce(value, arm, key, universe)
                except NotFinite:
                    raise  # the arm that took the number says why it is refused
                except ConfigError as e:
                    if _same_kind(value, arm) and any(typing.get_origin(a) in (list, tuple) for a in args):
                        raise  # a name-or-list key (trainer.logger): the matching arm's error names the bad item
        raise ConfigError(f"{key} expects {type_name(tp)}, got {_show(value)}", keys=key)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise ConfigError(f"{key} must be one of {', '.join(map(str, args))}; got {_show(value)}", keys=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} expects {type_name(tp)}, got {_show(value)}", keys=key)
        if origin is list:
            return [coerce(v, args[0], f"{key}[{i}]", universe) for i, v in enumerate(value)]
        if len(value) != len(args):
            raise ConfigError(f"{key} expects a list of {len(args)} values, got {_show(value)}", keys=key)
        return tuple(coerce(v, a, f"{key}[{i}]", universe) for i, (v, a) in enumerate(zip(value, args)))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} expects a mapping, got {_show(value)}", keys=key)
        return copy.deepcopy(value)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):  # True is not 1 here
        return value
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int past float's range (~1.8e308): refused below
                pass
        if isinstance(value, str):  # YAML 1.1 reads `1e-6` as a string; take it as the float it spells
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # `.inf`, `.nan`, "inf": no knob means it, and each fails steps later
                raise NotFinite(f"{key} must be a finite number, got {value!r}", keys=key)
            return number
    if tp is str and isinstance(value, str):
        return value
    hint = " (quote it to make it a string)" if tp is str and isinstance(value, (int, float)) else ""
    raise ConfigError(f"{key} expects {type_name(tp)}, got {_show(value)}{hint}", keys=key)


def _same_kind(value, arm) -> bool:
    """Is `value` the kind of thing union arm `arm` holds (a list for a list, a name for a Literal of names)?"""
    origin = typing.get_origin(arm)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    return origin is Literal and isinstance(value, str) and all(isinstance(a, str) for a in typing.get_args(arm))


def type_name(tp) -> str:
    """A short human name for an annotation: 'int', 'float or null', 'list of str'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        return f"a list of {type_name(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} {type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _show(value) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit limit on int -> str (YAML reads any length)
        text = f"<an integer of {value.bit_length()} bits>"
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def to_dict(obj):
    """A dataclass tree -> plain dicts, lists and scalars, ready for `yaml.safe_dump`."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
