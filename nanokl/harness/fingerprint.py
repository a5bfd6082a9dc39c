"""What a run is started with, as numbers every rank and every resume can compare: the record.

A run's result is a function of its config, its tokenizer and its data files. Two places must see that
they are the same as somewhere else:

  across ranks   torchrun starts one process per GPU, each parsing its own command line and config file
                 (a node with another copy of the YAML, a launcher that adds a key on one rank). DDP and
                 FSDP2 only check that the gradients' shapes match: ranks whose batch sizes, learning
                 rates or data differ train on, silently, one replica drifting from the next. So at start
                 every rank's fingerprint (the resolved config, flat, paths absolute; the tokenizer's and
                 the data files' SHA-256) is gathered by one collective, and any difference stops every
                 rank with one line naming each differing key and each rank's value (exit 2), before a
                 model loads or a collective could hang on a rank that refused something the others
                 accepted.
  across resumes every checkpoint holds what its run was started with (run.json: `run_record`, the
                 settings above and the model's config.json shapes). `resume_check` compares this run's
                 with it before anything loads: a key that changes the result (the model, the algorithm,
                 the batch sizes, the lengths, a data file: a training file edited between a stop and
                 its resume changes every later batch) stops the run with one line naming each
                 difference, unless trainer.resume_allow_changes names it or resume_mode=disable starts
                 over; keys that change only the speed or the logging (speed_only) resume with a
                 one-line note. A checkpoint from before the record resumes, with a note (its model's
                 shapes still compared with the new model's); one from before data hashes compares none.

A data file is hashed in full (SHA-256, ~1 GB/s: GSM8K's 4 MB in milliseconds); a directory (a Parquet
dataset) is every file under it, in name order. The built-in tasks have no files: their data is a function
of the config already compared. tests/test_cluster.py drives both (ranks under torchrun);
tests/test_run_guard.py the resume's refusals.
"""

import hashlib
import json
import os
from pathlib import Path

from nanokl.engine import dist
from nanokl.engine.model import ModelConfig
from nanokl.harness.checkpoint import read_record
from nanokl.harness.config.build import config_to_dict
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.hf_format import read_config

DATA_KEYS = ("data.train_files", "data.val_files", "data.offline_files")
_HASHED = {}  # (path, size, mtime_ns) -> sha256: each file is read once a process


def file_sha256(path) -> str:
    path = Path(path)
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHED:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def data_hashes(config: dict) -> dict:
    """{path: sha256} of every local data file the flat `config` names (DATA_KEYS, a path or a list of them;
    a directory: one hash over its files); a path that does not exist (a hub name, a file made later) is left
    to the loader that reads it."""
    out = {}
    for key in DATA_KEYS:
        paths = config.get(key)
        for p in [paths] if isinstance(paths, str) else paths or []:
            path = Path(p)
            if path.is_file():
                out[str(path)] = file_sha256(path)
            elif path.is_dir():
                h = hashlib.sha256()
                for f in sorted(q for q in path.rglob("*") if q.is_file()):
                    h.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
                out[str(path)] = h.hexdigest()
    return out


# paths compare as absolute paths (the same model from another working directory is the same model)
PATH_LEAVES = {"path", "tokenizer_path", "train_files", "val_files", "offline_files", "output_dir", "data_path",
             "val_data_path", "hf_config_path", "lora_adapter_path", "rollout_data_dir", "validation_data_dir",
             "default_local_dir", "resume_from_path", "input_tokenizer"}


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _absolute(v):
    if isinstance(v, str) and v and "://" not in v:
        return os.path.abspath(os.path.expanduser(v))
    if isinstance(v, list):
        return [_absolute(x) for x in v]
    return v


def settings(cfg) -> dict:
    """What this run computes from: the config (flat, dotted keys; paths absolute), the SHA-256 of the
    policy's tokenizer.json (None before it exists) and of each data file."""
    config = {k: _absolute(v) if k.rsplit(".", 1)[-1] in PATH_LEAVES else v
              for k, v in _flat(config_to_dict(cfg))}
    tok = Path(cfg.actor_rollout_ref.model.tokenizer_path) / "tokenizer.json"
    config = json.loads(json.dumps(config))
    return {"config": config, "tokenizer_sha256": file_sha256(tok) if tok.is_file() else None,
            "data_sha256": data_hashes(config)}


def fingerprint_of(cfg) -> dict:
    """This rank's settings as one flat dict, for `ranks_agree`."""
    s = settings(cfg)
    return {**s["config"], "tokenizer.json sha256": s["tokenizer_sha256"],
            **{f"data file {p} sha256": h for p, h in s["data_sha256"].items()}}


def differences(prints: list[dict]) -> list[str]:
    """'key (rank 0: a, rank 1: b)' for every key of the ranks' fingerprints (flat dicts) that is not the
    same on all of them; ranks that agree with rank 0 are named together."""
    out = []
    for key in sorted(set().union(*prints)):
        values = [p.get(key, "<unset>") for p in prints]
        if any(v != values[0] for v in values):
            groups = {}
            for r, v in enumerate(values):
                groups.setdefault(json.dumps(v, sort_keys=True), []).append(r)
            out.append(f"{key} (" + ", ".join(
                f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {_show(json.loads(v))}"
                for v, rs in groups.items()) + ")")
    return out


def ranks_agree(print_: dict) -> None:
    """Every rank calls it with its fingerprint (a flat dict): returns when all are equal, else raises on
    every rank the same one-line UserError naming the differences. A no-op for one process."""
    if dist.world() == 1:
        return
    prints = dist.all_gather_object(print_)
    if diffs := differences(prints):
        raise UserError(f"the {len(prints)} ranks were started with different settings, and each would train on "
                        f"its own: {'; '.join(diffs)}. Start every rank with the same config, data and tokenizer")


SHAPES = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
# never compared: where the run lives and how it resumes; the stages before RL (their output is the model path)
IGNORED = ("trainer.resume_mode", "trainer.resume_from_path", "trainer.resume_allow_changes",
           "trainer.default_local_dir", "sft.", "reward_model.train.")
# keys that change how fast a run goes, or what it logs, and not what it computes: a resume may change them
SPEED_ONLY_NAMES = {
    "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size",
    "log_prob_micro_batch_size_per_gpu", "forward_micro_batch_size", "forward_micro_batch_size_per_gpu",
    "micro_batch_size", "micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu",
    "forward_max_token_len_per_gpu", "use_dynamic_bsz", "log_prob_use_dynamic_bsz", "use_remove_padding",
    "use_fused_kernels", "fused_chunk_size", "strategy", "use_torch_compile", "enable_gradient_checkpointing",
    "entropy_from_logits_with_chunking", "entropy_checkpointing", "use_cuda_graph", "enforce_eager",
    "max_batch_size", "gpu_memory_utilization", "dataloader_num_workers", "filter_overlong_prompts_workers",
    "nccl_timeout"}
SPEED_ONLY_PARTS = (".fsdp_config.", ".checkpoint.", ".profiler.", ".global_profiler.", ".fused_kernel_options.")
SPEED_ONLY_KEYS = {"data.val_batch_size", *(f"trainer.{k}" for k in (
    "logger", "project_name", "experiment_name", "save_freq", "test_freq", "total_training_steps", "total_epochs",
    "max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep", "log_freq", "log_val_generations", "validation_data_dir",
    "rollout_data_dir", "val_before_train", "val_only", "val_kl_prompts", "n_gpus_per_node", "nnodes", "device",
    "balance_batch", "profile_steps", "signal_grace_s", "del_local_ckpt_after_load")),
    "custom_reward_function.timeout"}
MODEL_PATH = "actor_rollout_ref.model.path"


def speed_only(key: str) -> bool:
    return (key in SPEED_ONLY_KEYS or key.rsplit(".", 1)[-1] in SPEED_ONLY_NAMES
            or any(part in f".{key}." for part in SPEED_ONLY_PARTS))


def model_shapes(path) -> dict:
    """The shape fields of the model at `path` (its config.json, as nanokl reads it)."""
    mc = ModelConfig(**read_config(path)[0])
    return {k: getattr(mc, k) for k in SHAPES}


def run_record(cfg) -> dict:
    """What this run is started with, as a checkpoint keeps it (run.json): its settings and its model's shapes."""
    return {**settings(cfg), "model_shapes": model_shapes(cfg.actor_rollout_ref.model.path)}


def _show(v) -> str:
    if isinstance(v, list):
        text = "[" + ",".join(_show(x) for x in v) + "]"
    elif isinstance(v, bool) or v is None:
        text = json.dumps(v)
    else:
        text = str(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _renamed(was: dict) -> dict:
    """A record written before nanokl renamed two of its own spellings (actor.loss_mode -> objective, the
    monitor's knob kl_coef -> kl_weight) in today's words: the same settings are no change."""
    was = {OBJECTIVE if k == OLD_OBJECTIVE else k: v for k, v in was.items()}
    return {k: "kl_weight" if k.endswith(".knob") and v == "kl_coef" else v for k, v in was.items()}


OLD_OBJECTIVE, OBJECTIVE = "actor_rollout_ref.actor.loss_mode", "actor_rollout_ref.actor.objective"


def resume_check(ckpt, record: dict, allow=()) -> list[str]:
    """Resuming from checkpoint `ckpt` with this run's `record` (run_record): the notes to print, or a
    UserError naming every difference that changes the result and that `allow`
    (trainer.resume_allow_changes) does not name."""
    ckpt = Path(ckpt)
    old, notes = read_record(ckpt), []
    if old is None:  # written before checkpoints kept a record: only the actor's shapes to compare
        notes.append(f"note: {ckpt} has no record of the settings its run started with (written before nanokl "
                     "kept one): resuming without comparing them")
        actor = ckpt / "actor"
        old = {"model_shapes": model_shapes(actor)} if (actor / "config.json").is_file() else {}
    diffs = {}  # name -> "old -> new"
    was = _renamed(old.get("config") or {})
    for k, v in record["config"].items():
        if k in was and was[k] != v and not k.startswith(IGNORED):
            diffs[k] = f"{_show(was[k])} -> {_show(v)}"
    if MODEL_PATH in diffs:  # the keys that follow the model path (its tokenizer's, the critic's): named with it
        diffs = {k: d for k, d in diffs.items() if k == MODEL_PATH or (was[k], record["config"][k]) !=
                 (was[MODEL_PATH], record["config"][MODEL_PATH])}
    if "tokenizer_sha256" in old and old["tokenizer_sha256"] != record["tokenizer_sha256"]:
        a, b = (x[:12] if x else "none" for x in (old["tokenizer_sha256"], record["tokenizer_sha256"]))
        diffs["tokenizer"] = f"tokenizer.json sha256 {a} -> {b}"
    if "data_sha256" in old:  # a checkpoint from before data hashes were kept compares none
        for path in sorted(set(old["data_sha256"]) | set(record["data_sha256"])):
            a, b = (x[:12] if x else "none" for x in (old["data_sha256"].get(path), record["data_sha256"].get(path)))
            if a != b:
                diffs.setdefault("data", []).append(f"{path} sha256 {a} -> {b}")
        if "data" in diffs:
            diffs["data"] = ", ".join(diffs["data"]) + " (the batches of every later step change)"
    shapes = old.get("model_shapes") or {}
    changed = [f"{k} {_show(shapes[k])} -> {_show(v)}" for k, v in record["model_shapes"].items()
               if k in shapes and shapes[k] != v]
    if changed:
        diffs["model_shapes"] = ", ".join(changed)

    def allowed(name):
        return any(name == a or name.startswith(a + ".") for a in allow)
    speed = [k for k in diffs if speed_only(k)]
    accepted = [k for k in diffs if k not in speed and allowed(k)]
    refused = [k for k in diffs if k not in speed and k not in accepted]
    if refused:
        raise UserError(f"checkpoint {ckpt} was written by a run started with other settings, which change the "
                        f"result: {'; '.join(f'{k} ({diffs[k]})' for k in refused)}. Start over with "
                        "trainer.resume_mode=disable (or another trainer.default_local_dir), or resume with the "
                        f"change: trainer.resume_allow_changes=[{','.join([*accepted, *refused])}]")
    if accepted:
        notes.append("note: resuming with changed keys that trainer.resume_allow_changes accepts: "
                     + "; ".join(f"{k} ({diffs[k]})" for k in accepted))
    if speed:
        notes.append("note: resuming with changed speed-only keys: " + "; ".join(f"{k} ({diffs[k]})" for k in speed))
    return notes
