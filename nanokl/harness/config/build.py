"""From the merged tree of values to the typed dataclasses, and back: every key and type checked.

Step 3 of `load.load_config` (steps 1 and 2, the YAML files and the `key=value` arguments,
are config/yaml_io.py's). It knows nothing about PPO: every function here works on any tree of dataclasses.

`build(cls, tree, ...)` turns the merged dict into dataclasses, checking every key and type
against the annotations: an unknown key names the closest valid ones, a wrong type names the
expected type. The few coercions are the ones that cannot surprise anybody: int -> float, a
list -> a tuple field, and a string that spells a float -> float, because PyYAML follows YAML
1.1, in which `1e-6` (no dot) is a *string*. An infinite or NaN value (`.inf`, `.nan`, `inf`)
is refused for every float key, whatever the key: none means it. `to_dict` goes back, to plain
dicts, lists and scalars; `config_to_dict` is that for the whole Config (what
`load.save_config` writes, what loggers and a checkpoint's run.json record). It is here,
not in config/load.py, because harness/run_state.py records configs and is itself imported (via
harness/reward_fn.py) by the task table that rules.validate checks data.task against:
importing load there would close an import cycle.

Every error is yaml_io's one-line `ConfigError`, naming the full dotted key.
"""

import copy
import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union

from nanokl.harness.config.yaml_io import ConfigError


class NotFinite(ConfigError):
    """An infinite or NaN value for a float key (refused for every one of them, by `coerce`)."""


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


def config_to_dict(cfg) -> dict:
    """The config as plain dicts, lists and scalars (what save_config writes, what loggers record)."""
    return to_dict(cfg)
