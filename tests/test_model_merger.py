"""verl's model-merger step on nanokl's checkpoints (nanokl/harness/model_merger.py) and verl's
global_step_N/actor/huggingface/ folder (checkpoint.hf_view): a tiny run, then the command as a verl
user types it; the target folder loads and holds the checkpoint's actor bit for bit, and under LoRA
base + (alpha/r)·B A computed here in float64 from the adapters file."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from nanokl.harness.checkpoint import verify_checkpoint
from nanokl.harness.hf_format import from_pretrained
from tiny_runs import ROOT, TINY_BASE

TINY = [*TINY_BASE, "trainer.total_training_steps=2", "trainer.save_freq=2"]
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2"]


def train(sft_dir, run_dir, *extra):
    argv = sys.argv
    sys.argv = ["train_ppo.py", *TINY, f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run_dir}",
                *extra]
    try:
        train_ppo.cli(train_ppo.main)
    except SystemExit as e:
        assert not e.code, f"the tiny run failed ({e.code})"
    finally:
        sys.argv = argv
    return Path(run_dir) / "global_step_2"


@pytest.fixture(scope="module")
def plain(sft_dir, tmp_path_factory):
    return train(sft_dir, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def lora(sft_dir, tmp_path_factory):
    return train(sft_dir, tmp_path_factory.mktemp("lora"), *LORA)


def merger(*argv, cwd=ROOT):
    """`python -m nanokl.harness.model_merger ...` in a new process: (exit status, stderr)."""
    out = subprocess.run([sys.executable, "-m", "nanokl.harness.model_merger", *map(str, argv)], capture_output=True,
                         text=True, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return out.returncode, out.stderr


def same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_actor_huggingface_holds_the_hf_folder_as_hard_links(plain):
    actor, hf = plain / "actor", plain / "actor" / "huggingface"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in hf.iterdir()}
    for f in hf.iterdir():
        assert os.path.samefile(f, actor / f.name), f"{f.name}: not a hard link to actor/{f.name}"
    assert not (plain / "critic").exists()  # arith_tiny's estimator has no critic (a critic/ gets its huggingface/ too)
    manifest = json.loads((plain / "manifest.json").read_text())["files"]
    assert "actor/huggingface/model.safetensors" in manifest and "actor/huggingface/config.json" in manifest
    assert verify_checkpoint(plain) is None
    same_tensors(from_pretrained(hf).state_dict(), from_pretrained(actor).state_dict())


def test_merge_as_verl_types_it_copies_the_actor_bit_for_bit(plain, tmp_path):
    target = tmp_path / "hf"
    code, err = merger("merge", "--backend", "fsdp", "--local_dir", plain / "actor", "--target_dir", target)
    assert code == 0, err
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in target.iterdir()}
    assert not os.path.samefile(target / "model.safetensors", plain / "actor" / "model.safetensors")  # a copy
    same_tensors(load_file(target / "model.safetensors"), load_file(plain / "actor" / "model.safetensors"))
    same_tensors(from_pretrained(target).state_dict(), from_pretrained(plain / "actor").state_dict())
    # the step folder works too, and verl's own habit of --target_dir <actor>/huggingface leaves it whole
    step = tmp_path / "step"
    code, err = merger("merge", "--backend", "fsdp", "--local_dir", plain, "--target_dir", step, "--tie-word-embedding")
    assert code == 0 and "note: --tie-word-embedding accepted" in err, err
    same_tensors(load_file(step / "model.safetensors"), load_file(target / "model.safetensors"))
    code, err = merger("merge", "--backend", "fsdp", "--local_dir", plain / "actor", "--target_dir",
                       plain / "actor" / "huggingface")
    assert code == 0, err
    assert verify_checkpoint(plain) is None


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_merge_under_lora_is_base_plus_scaled_adapters(lora, sft_dir, tmp_path):
    actor = lora / "actor"
    assert (actor / "lora_adapters.safetensors").is_file()
    assert not (actor / "huggingface" / "lora_adapters.safetensors").exists()
    meta = json.loads((actor / "lora_adapters.json").read_text())
    ab, base = load_file(actor / "lora_adapters.safetensors"), load_file(Path(sft_dir) / "model.safetensors")
    want = {k: v.double() for k, v in base.items()}
    for name in meta["target_modules"]:
        b, a = ab[f"{name}.lora_B"].double(), ab[f"{name}.lora_A"].double()
        want[f"{name}.weight"] += meta["scale"] * (b @ a)
    assert meta["scale"] == 16 / 4 and any(ab[k].abs().max() > 0 for k in ab if k.endswith("lora_B"))  # trained

    def check(folder):
        got = load_file(folder / "model.safetensors")
        assert sorted(got) == sorted(want)
        for k, w in want.items():
            torch.testing.assert_close(got[k].double(), w, rtol=1e-6, atol=1e-6, msg=k)
        from_pretrained(folder)  # loads as a plain causal LM
    target = tmp_path / "merged"
    code, err = merger("merge", "--backend", "fsdp", "--local_dir", actor, "--target_dir", target)
    assert code == 0 and "LoRA's merged export" in err, err
    check(target)
    # a folder of adapters alone (no merged weights): merged over --hf_model_path with nanokl/lora.py
    only = tmp_path / "adapters_only"
    only.mkdir()
    for f in ("config.json", "lora_adapters.safetensors", "lora_adapters.json", "tokenizer.json"):
        shutil.copy(actor / f, only / f)
    code, err = merger("merge", "--backend", "fsdp", "--local_dir", only, "--target_dir", tmp_path / "m2")
    assert code == 2 and "--hf_model_path" in err and len(err.strip().splitlines()) == 1, err
    code, err = merger("merge", "--backend", "fsdp", "--local_dir", only, "--target_dir", tmp_path / "m2",
                       "--hf_model_path", sft_dir)
    assert code == 0 and "merged from the adapters" in err, err
    check(tmp_path / "m2")


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_critic_huggingface_and_is_value_model(sft_dir, tmp_path):
    step = train(sft_dir, tmp_path / "run", "algorithm.adv_estimator=gae")
    critic = step / "critic"
    assert os.path.samefile(critic / "huggingface" / "model.safetensors", critic / "model.safetensors")
    assert verify_checkpoint(step) is None
    code, err = merger("merge", "--backend", "fsdp", "--local_dir", step, "--target_dir", tmp_path / "v",
                       "--is-value-model")
    assert code == 0 and "note: --is-value-model accepted" in err, err
    same_tensors(load_file(tmp_path / "v" / "model.safetensors"), load_file(critic / "model.safetensors"))


@pytest.mark.parametrize("argv, says", [
    (["merge", "--backend", "megatron", "--local_dir", "{plain}"], "--backend megatron"),
    (["merge", "--backend", "fsdp", "--local_dir", "{plain}", "--hf_upload_path", "me/model"], "uploads nothing"),
    pytest.param(["merge", "--backend", "fsdp", "--local_dir", "{plain}", "--private"], "uploads nothing", marks=pytest.mark.slow),
    (["merge", "--backend", "fsdp", "--local_dir", "{plain}/nope"], "no such folder"),
    pytest.param(["merge", "--backend", "fsdp", "--local_dir", "{plain}/.."], "not a nanokl checkpoint's actor/ folder", marks=pytest.mark.slow),
    pytest.param(["merge", "--backend", "ddp", "--local_dir", "{plain}"], "invalid choice", marks=pytest.mark.slow),
    pytest.param(["merge", "--local_dir", "{plain}"], "--backend", marks=pytest.mark.slow),
    pytest.param(["test", "--backend", "fsdp"], "invalid choice", marks=pytest.mark.slow),
    pytest.param([], "required", marks=pytest.mark.slow),
])
def test_bad_arguments_exit_2_with_one_line(plain, tmp_path, argv, says):
    code, err = merger(*[a.format(plain=plain) for a in argv], "--target_dir", tmp_path / "t") if argv else merger()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not (tmp_path / "t").exists() or not any((tmp_path / "t").iterdir())
