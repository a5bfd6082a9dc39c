"""Loading a config: a YAML file and `key=value` arguments in, one resolved and checked `Config` out;
the command line; saving.

    cfg = load_config("configs/presets/conservative.yaml", ["algorithm.kl_ctrl.target_kl=0.02"])
      1. YAML files, following `defaults:` chains, deep-merged        (yaml_io.load_yaml_chain)
      2. `key.sub=value` overrides on top, with Hydra's `+key=value` (add a key not yet set),
         `++key=value` (set) and `~key` (back to its default)          (yaml_io.apply_override)
         then `${a.b}` in any value resolved against the merged tree  (yaml_io.interpolate)
      3. keys and types checked against config.py's dataclasses      (build.build)
      4. `resolve`: None -> derived defaults, then `validate`: impossible values rejected
                                                                       (config/rules.py)

`parse_cli` is what every entry point (train_ppo.py, the SFT and reward-model scripts) calls on
its argv: `--config PATH` and overrides. Without --config, `choose_base` picks the base: verl's
defaults (the dataclasses) for a verl command, which gives data.train_files, else the CPU demo's
configs/arith_tiny.yaml (DEFAULT_CONFIG). `save_config` writes a resolved config back as YAML.

This module sits on top of the others: it imports config.py, config/yaml_io.py, config/build.py and
config/rules.py, and none of them imports it.
"""

import dataclasses
import os
import sys
from pathlib import Path

import yaml

from nanokl.harness.config.schema import RENAMED, Config, TrainerConfig
from nanokl.harness.config.build import all_keys, build, config_to_dict
from nanokl.harness.config.yaml_io import ConfigError, apply_override, interpolate, load_yaml_chain
from nanokl.harness.config.rules import resolve, validate

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "arith_tiny.yaml"


def load_config(path=None, overrides=()) -> Config:
    """YAML file `path` (None: the dataclass defaults) + `key=value` overrides -> resolved Config."""
    tree, origins = ({}, {}) if path is None else load_yaml_chain(str(path))
    try:
        defaults = default_tree()
        for arg in overrides:
            apply_override(tree, origins, arg, defaults)
        interpolate(tree, defaults)
        refuse_renamed(tree)
        return validate(resolve(build(Config, tree, universe=all_keys(Config))))
    except ConfigError as e:
        raise e.locate(origins) from None


def refuse_renamed(tree: dict) -> None:
    """A key of schema.RENAMED under its old name: one line naming the new (no silent default)."""
    for old, (new, what) in RENAMED.items():
        node, *path = tree, *old.split(".")
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            raise ConfigError(f"{old} is now {new} ({what})", keys=old)


def default_tree() -> dict:
    """Every key's default as plain values, for `~key` and `${key}` (yaml_io). trainer.default_local_dir
    keeps its `${trainer.project_name}/${trainer.experiment_name}`, resolved against the run's own names."""
    tree = config_to_dict(Config())
    tree["trainer"]["default_local_dir"] = TrainerConfig.default_local_dir
    return tree


USAGE = ("usage: [--config PATH] [key.sub=value | +key=value | ++key=value | ~key ...]   "
         "e.g. algorithm.kl_ctrl.target_kl=0.03")


def parse_cli(argv=None, default_path=DEFAULT_CONFIG) -> Config:
    """`--config PATH` and `key.sub=value` overrides -> Config. Without --config the base is verl's
    defaults when the overrides give data.train_files (a verl command), else `default_path` (the CPU
    demo's configs/arith_tiny.yaml); one line says which (`choose_base`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(USAGE + "\nsections: " + ", ".join(f.name for f in dataclasses.fields(Config)))
            sys.exit(0)
        if arg in ("--config", "-c"):
            if i + 1 == len(argv):
                raise ConfigError(f"{arg} needs a path; {USAGE}")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; {USAGE}")
        else:
            overrides.append(arg)
        i += 1
    path, base = choose_base(path, overrides, default_path)
    cfg = load_config(path, overrides)
    # the KL monitor on by default, neither the file(s) nor the command setting it: start-up says so, with how
    # to turn it off or make it act (notes.startup_notes, printed by the trainer's setup)
    tree, defaults = ({} if path is None else load_yaml_chain(str(path))[0]), default_tree()
    for arg in overrides:  # as load_config merged them (it has refused any that fails)
        apply_override(tree, {}, arg, defaults)
    given = "enable" in ((tree.get("trainer") or {}).get("kl_monitor") or {})
    cfg.__dict__["kl_monitor_by_default"] = cfg.trainer.kl_monitor.enable and not given
    if os.environ.get("RANK", "0") == "0":
        print(f"config: {base}")
    return cfg


def choose_base(path, overrides, default_path):
    """(the file to load, or None for the dataclass defaults; the line saying so). A verl command
    (data.train_files given, no --config) starts from verl's defaults, and must name its model;
    any other command from `--config`, else `default_path` (the CPU demo's file)."""
    if path is None and default_path is not None and _given(overrides, "data", "train_files"):
        if not _given(overrides, "actor_rollout_ref", "model", "path"):
            raise ConfigError("data.train_files is given without --config, so the run starts from verl's defaults "
                              "and needs the model to train: set actor_rollout_ref.model.path=<HF checkpoint dir>",
                              keys="actor_rollout_ref.model.path")
        return None, "verl's defaults (no --config, data files given)"
    path = default_path if path is None else path
    if path is None:
        return None, "the defaults"
    shown, root = Path(path).resolve(), Path(__file__).resolve().parents[3]
    shown = shown.relative_to(root) if shown.is_relative_to(root) else path
    demo = default_path is not None and Path(path).resolve() == Path(default_path).resolve()
    return path, f"{shown}" + (" (the CPU demo)" if demo else "")


def _given(overrides, *keys):
    """The value the `key=value` overrides give the nested key `keys` (None when none does)."""
    tree = {}
    try:
        for arg in overrides:
            apply_override(tree, {}, arg)
    except ConfigError:
        return None  # load_config reports it, with where it was set
    for k in keys:
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


def save_config(cfg: Config, path) -> None:
    """Write `cfg` as YAML; `load_config(path)` gives back an equal Config."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("# nanokl config, resolved (written by nanokl.harness.config.load.save_config)\n")
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=None)
