"""Fuzzed checkpoint directories (tests/fuzzing.py has the property): truncations, bit flips and
deletions, with and without a manifest, read in the order a resume reads them.
"""

import json
import shutil
import tempfile
from pathlib import Path

import pytest

# first: importing it skips this module where there is no SIGALRM or no hypothesis
from fuzzing import OFFSETS, fuzz, outcome, time_limit, tiny_tokenizer

import torch  # noqa: E402
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanokl.harness.checkpoint import (MANIFEST, latest_checkpoint, load_state, rng_state,  # noqa: E402
                                       save_checkpoint, verify_checkpoint)
from nanokl.harness.config.yaml_io import UserError  # noqa: E402
from nanokl.harness.hf_format import from_pretrained, load_value_model  # noqa: E402
from nanokl.harness.tokenizer import load_tokenizer  # noqa: E402
from nanokl.engine.model import CausalLM, ModelConfig, ValueModel, init_weights  # noqa: E402

# ---------------------------------------------------------------------------------------------
# 3. Checkpoint directories: truncations, bit flips, deletions; with and without a manifest
# ---------------------------------------------------------------------------------------------

STEP = "global_step_2"  # verl's layout: <run>/global_step_N/ and <run>/latest_checkpointed_iteration.txt
TARGETS = ["latest_checkpointed_iteration.txt", f"{STEP}/{MANIFEST}", f"{STEP}/optim.pt",
           f"{STEP}/trainer_state.pt", f"{STEP}/actor/config.json", f"{STEP}/actor/model.safetensors",
           f"{STEP}/actor/tokenizer.json", f"{STEP}/actor/tokenizer_config.json", f"{STEP}/critic/config.json",
           f"{STEP}/critic/model.safetensors"]
# verl's HF folder beside each model's files: hard links to them (checkpoint.hf_view), under the manifest too
# (copytree below makes them copies, so damage to either side is damage to one file)
TARGETS += [t.replace("/actor/", "/actor/huggingface/").replace("/critic/", "/critic/huggingface/")
            for t in TARGETS if "/actor/" in t or "/critic/" in t]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tok):
    """A run directory with one complete checkpoint of tiny models (actor, critic, tokenizer, states)."""
    run = tmp_path_factory.mktemp("fuzz_run")
    cfg = ModelConfig(model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      rope_theta=1e4)
    actor, critic = init_weights(CausalLM(cfg)), init_weights(ValueModel(cfg))
    # an AdamW state dict's shape, built by hand (a real step first imports torch's compiler stack: seconds),
    # for two parameters (each tensor is a record torch.load reads: a full state costs every case milliseconds)
    params = list(actor.parameters())[:2]
    optim = {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p),
                           "exp_avg_sq": torch.rand_like(p)} for i, p in enumerate(params)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01,
                               "params": list(range(len(params)))}]}
    save_checkpoint(run, 2, {"actor": actor, "critic": critic}, {"actor": optim, "actor_sched": {"last_epoch": 1}},
                    {"kl_ctrl": {"value": 0.1}, "rng": rng_state()}, tokenizer=tok)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == sorted(TARGETS)
    return run, {t: (run / t).read_bytes() for t in TARGETS}


DAMAGE = st.tuples(st.sampled_from(TARGETS), st.sampled_from(["truncate", "flip", "flip", "flip", "delete", "empty"]),
                   OFFSETS, st.integers(0, 7))


def legacy_case(target, how, offset=0, bit=0):
    return example(damage=[(f"{STEP}/{target}", how, offset, bit)], drop_manifest=True)


@fuzz(200)
# found by fuzzing, the loaders' own errors: safetensors' SafetensorError, the tokenizers parser's Exception,
# json's JSONDecodeError and UnicodeDecodeError for the tokenizer's config (a config.json not UTF-8 too)
@legacy_case("actor/model.safetensors", "truncate", 100)
@legacy_case("critic/model.safetensors", "flip", 3, 6)
@legacy_case("actor/tokenizer.json", "truncate", 10)
@legacy_case("actor/tokenizer_config.json", "truncate", 5)
@legacy_case("actor/tokenizer_config.json", "flip", 0, 7)
@legacy_case("critic/config.json", "flip", 0, 7)
@given(damage=st.lists(DAMAGE, max_size=3), drop_manifest=st.booleans())
def test_checkpoint_readers(pristine, damage, drop_manifest):
    pristine, original = pristine
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(pristine, run)
        ckpt = run / STEP
        if drop_manifest:
            (ckpt / MANIFEST).unlink()
        for target, how, offset, bit in damage:
            path = run / target
            if not path.is_file():
                continue
            data = bytearray(path.read_bytes())
            if how == "delete":
                path.unlink()
                continue
            if how == "truncate":
                data = data[:offset % (len(data) + 1)]
            elif how == "empty":
                data = b""
            elif data:
                data[offset % len(data)] ^= 1 << bit
            path.write_bytes(bytes(data))
        manifest = ckpt / MANIFEST
        changed = [ckpt / t.removeprefix(STEP + "/") for t in TARGETS if t.startswith(STEP + "/") and
                   (not (run / t).is_file() or (run / t).read_bytes() != original[t])]
        legacy = not manifest.exists()  # dropped, or deleted by the damage: nothing to verify against
        manifest_changed = manifest in changed and not legacy
        changed = [p for p in changed if p != manifest]

        with time_limit():
            problem = verify_checkpoint(ckpt)
        if not legacy:
            if not changed and not manifest_changed:
                assert problem is None
            else:  # a changed file never verifies, and the problem names it (any file, if the manifest changed)
                assert problem is not None and "\n" not in problem
                assert manifest_changed or any(str(p) in problem for p in changed), problem
        found = outcome(latest_checkpoint, run, warn=False)
        if found is None:  # a fresh start: nothing verifies, and no legacy checkpoint has its trainer state
            assert problem is not None and (not legacy or not (ckpt / "trainer_state.pt").is_file())
            return
        assert found == ckpt and (problem is None or legacy)
        names = changed + [p.parent for p in changed]  # a bad config.json is named, or its model directory
        results = [outcome(load_state, ckpt, names=names), outcome(from_pretrained, ckpt / "actor", names=names),
                   outcome(load_value_model, ckpt / "critic", names=names),
                   outcome(load_tokenizer, ckpt / "actor", names=names)]
        if not changed:  # an undamaged checkpoint always loads
            assert not any(isinstance(r, UserError) for r in results), results


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, "ValueError: num_attention_heads must be a multiple of num_key_value_heads"),
    ("num_key_value_heads", 0, "ZeroDivisionError"),
    ("rope_parameters", {"rope_type": "dgfault"}, "unsupported rope_scaling type 'dgfault'"),
    ("rope_scaling", {"rope_type": "linear"}, "KeyError: 'factor'"),
    ("rope_theta", "big", "ValueError: could not convert string to float"),
    ("architectures", 5, "TypeError"),
    (None, ["not", "an", "object"], "expected a JSON object, got list"),
])
def test_a_bad_model_config_value_is_a_one_line_error(pristine, tmp_path, field, value, message):
    """What single bit flips rarely reach in config.json: wrong types and impossible values, named with the file."""
    actor = tmp_path / "actor"
    shutil.copytree(pristine[0] / STEP / "actor", actor)
    hf = json.loads((actor / "config.json").read_text())
    if field is None:
        hf = value
    else:
        hf[field] = value
    (actor / "config.json").write_text(json.dumps(hf))
    error = outcome(from_pretrained, actor, names=[actor / "config.json"])
    assert isinstance(error, UserError) and message in str(error), error
