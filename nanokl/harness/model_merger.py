"""verl's model-merger step, for nanokl's checkpoints: one Hugging Face folder out of a checkpoint's actor.

    python -m nanokl.harness.model_merger merge --backend fsdp \\
        --local_dir checkpoints/verl_examples/gsm8k/global_step_100/actor --target_dir merged/

verl's FSDP checkpoints are per-rank shards (model_world_size_W_rank_R.pt) that
`python -m verl.model_merger merge` gathers into an HF folder. nanokl's global_step_N/actor/ already
is one (config.json + model.safetensors + the tokenizer; under LoRA the merged W + (alpha/r)·B A), so
merging here is a copy: target_dir gets config.json, model.safetensors and the tokenizer's files.
(`nanokl.model_merger` would be a lesson module, and the lessons import nothing of the harness:
tests/test_layout.py; hence the harness path.)

verl's arguments, as it spells them:
    merge                       the subcommand (verl's `test` is not offered)
    --backend fsdp|megatron     fsdp; megatron is refused in one line (nanokl writes no Megatron shards)
    --local_dir DIR             global_step_N/actor (or critic/), or global_step_N itself (its actor/;
                                its critic/ with --is-value-model)
    --target_dir DIR            where the HF folder goes (verl's default: tmp)
    --hf_model_path DIR         optional: config.json and the tokenizer's files come from here. Needed
                                only for an actor folder that holds LoRA adapters without the merged
                                weights (lora_adapters.safetensors/.json, no model.safetensors): the
                                base's weights are read here and the adapters merged (nanokl/lora.py)
    --tie-word-embedding, --is-value-model, --trust-remote-code, --use_cpu_initialization
                                accepted; the tying is read from config.json, the value head is the
                                critic's folder, and the rest mean nothing here (a note says so)
    --hf_upload_path, --private refused in one line: nanokl uploads nothing (no network)
Every error is one line and exit status 2.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from nanokl.harness.config.yaml_io import UserError, run_cli
from nanokl.harness.hf_format import file_mode, from_pretrained, save_tensors
from nanokl.harness.lora_run import ADAPTERS, META
from nanokl.lora import add_adapters, load_adapter_state_dict, merged_state_dict

WEIGHTS = "model.safetensors"
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "special_tokens_map.json", "chat_template.jinja")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (a UserError: exit 2), not the usage text."""

    def error(self, message):
        raise UserError(f"model_merger: {message}")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m nanokl.harness.model_merger",
                 description="Write a Hugging Face folder from a nanokl checkpoint (verl's model_merger).")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    m = sub.add_parser("merge", help="write the HF folder")
    m.add_argument("--backend", required=True, choices=["fsdp", "megatron"])
    m.add_argument("--local_dir", required=True)
    m.add_argument("--target_dir", default="tmp")
    m.add_argument("--hf_model_path", default=None)
    m.add_argument("--hf_upload_path", default=None)
    for flag in ("--private", "--tie-word-embedding", "--is-value-model", "--trust-remote-code",
                 "--use_cpu_initialization"):
        m.add_argument(flag, action="store_true")
    return ap


def model_folder(local_dir, value_model=False) -> Path:
    """The HF folder to merge: `local_dir` itself, or its actor/ (critic/) when it is a step folder."""
    d = Path(local_dir)
    if not d.is_dir():
        raise UserError(f"--local_dir {d}: no such folder")
    part = "critic" if value_model else "actor"
    if (d / part).is_dir() and (d / "trainer_state.pt").is_file():  # global_step_N/
        d = d / part
    if any(d.glob("model_world_size_*_rank_*.pt")):
        raise UserError(f"--local_dir {d}: verl's own FSDP shards; merge them with `python -m verl.model_merger`")
    if not (d / "config.json").is_file() or not ((d / WEIGHTS).is_file() or (d / ADAPTERS).is_file()):
        raise UserError(f"--local_dir {d}: not a nanokl checkpoint's {part}/ folder (no config.json and "
                        f"{WEIGHTS}); pass global_step_N or global_step_N/{part}")
    return d


def merge_adapters(folder: Path, base: Path) -> dict:
    """The merged weights of an actor folder holding only LoRA adapters, over the base model at `base`."""
    try:
        meta = json.loads((folder / META).read_text())
        rank, scale, names = int(meta["lora_rank"]), float(meta["scale"]), list(meta["target_modules"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{folder / META}: missing or unreadable (the adapters' rank, scale and modules)") from None
    model = from_pretrained(base)
    try:
        add_adapters(model, rank, scale * rank, names)
        load_adapter_state_dict(model, load_file(folder / ADAPTERS))
    except ValueError as e:
        raise UserError(f"{folder / ADAPTERS}: does not fit --hf_model_path {base}: {e}") from None
    sd = merged_state_dict(model)
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _place(src: Path, dst: Path):
    """Copy src to dst through a temporary file and a rename: a dst that is a hard link into a checkpoint
    (actor/huggingface/) is replaced, never written through."""
    if dst.exists() and os.path.samefile(src, dst):
        return
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    os.close(fd)
    shutil.copyfile(src, tmp)
    os.chmod(tmp, file_mode())
    os.replace(tmp, dst)


def merge(args) -> Path:
    if args.backend == "megatron":
        raise UserError("--backend megatron: nanokl writes no Megatron checkpoints; use --backend fsdp")
    if args.hf_upload_path or args.private:
        raise UserError("--hf_upload_path/--private: nanokl uploads nothing (no network); upload --target_dir "
                        "yourself, e.g. `huggingface-cli upload REPO TARGET_DIR`")
    folder = model_folder(args.local_dir, args.is_value_model)
    side = Path(args.hf_model_path) if args.hf_model_path else folder
    if args.hf_model_path and not (side / "config.json").is_file():
        raise UserError(f"--hf_model_path {side}: no config.json there")
    target = Path(args.target_dir)
    target.mkdir(parents=True, exist_ok=True)
    for flag, spelled, why in (
            ("tie_word_embedding", "--tie-word-embedding", "the tying is read from config.json"),
            ("trust_remote_code", "--trust-remote-code", "nanokl runs no model code of the folder"),
            ("use_cpu_initialization", "--use_cpu_initialization", "nanokl merges on the CPU"),
            ("is_value_model", "--is-value-model", f"merging {folder}")):
        if getattr(args, flag):
            print(f"note: {spelled} accepted; {why}", file=sys.stderr)
    if (folder / WEIGHTS).is_file():  # nanokl's actor/: the merged export already (under LoRA too)
        _place(folder / WEIGHTS, target / WEIGHTS)
        how = "copied" + (" (LoRA's merged export)" if (folder / ADAPTERS).is_file() else "")
    else:
        if not args.hf_model_path:
            raise UserError(f"--local_dir {folder}: LoRA adapters without merged weights; pass --hf_model_path "
                            "with the base model they were trained on")
        save_tensors(merge_adapters(folder, side), target)  # a temporary file and a rename, as _place
        how = f"merged from the adapters over {side}"
    written = [WEIGHTS]
    for name in SIDE_FILES:
        src = side / name if (side / name).is_file() else folder / name
        if src.is_file():
            _place(src, target / name)
            written.append(name)
    print(f"wrote {target}: {', '.join(sorted(written))} (weights {how})", file=sys.stderr)
    return target


def main(argv=None):
    args = parser().parse_args(argv)
    return merge(args)


if __name__ == "__main__":
    run_cli(main)
