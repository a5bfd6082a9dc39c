"""LoRA in the trainer (issue 48), driven as a verl user types it: `train_ppo.py ...
actor_rollout_ref.model.lora_rank=4` on the tiny CPU config (tests/test_cluster.py's TINY).

- a LoRA run trains: finite metrics, the start-up line, only the adapters moved (the base, merged
  with the saved adapters, is the saved merged export; every unadapted tensor is the base's, bit
  for bit);
- the reference is the base model bit for bit (AdaptersOff on the adapted, trained actor vs the base
  loaded fresh from model.path), and the reference check accepts it and still refuses a trainable base;
- a stop at step 2 and a resume end bit-identical to the uninterrupted 4-step run (adapters, merged
  export, every metrics row);
- the merged export loads with nanokl's from_pretrained (and transformers when installed), logits
  equal to the adapted model's within fp32 rounding;
- a rollout copy (CUDA's path) receives the merged weights; fsdp2 under torchrun is refused in one line;
- DDP over 2 gloo processes: finite, and the same adapters on both ranks (each rank's, dumped at the end);
- a rollback restores the checkpoint's adapters and their Adam moments by name; "start over from the
  reference" (remedies.reload_reference) sets B = 0, which is the base model bit for bit.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from nanokl.engine import shard
from nanokl.forwards import compute_log_probs
from nanokl.harness import lora_run, ref_check
from nanokl.harness.checkpoint import latest_checkpoint
from nanokl.harness.config.load import load_config
from nanokl.harness.hf_format import from_pretrained
from nanokl.lora import AdaptersOff, merged_state_dict
from tiny_runs import ROOT, TINY_BASE, launch

TINY = [*TINY_BASE, "trainer.total_training_steps=4", "trainer.save_freq=2"]
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2"]
QUIET = ("timing", "perf/throughput", "perf/time_per_step", "perf/cpu_memory", "perf/max_memory")  # machine readings
LINE = "LoRA: rank 4, alpha 16 on 7 modules (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj): "


def args(sft_dir, run_dir, *extra):
    return [*TINY, f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run_dir}", *LORA, *extra]


def rows(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def cfg_of(sft_dir, run_dir):
    return load_config(ROOT / "configs" / "arith_tiny.yaml", args(sft_dir, run_dir)[2:])


def adapted(sft_dir, ckpt):
    """The trained actor rebuilt as the trainer resumes it: the base from model.path + the checkpoint's adapters."""
    actor = from_pretrained(sft_dir)
    ref = lora_run.attach(actor, cfg_of(sft_dir, ckpt.parent), ckpt)
    return actor, ref


@pytest.fixture(scope="module")
def straight(sft_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_straight")
    proc = launch(args(sft_dir, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_a_lora_run_trains_the_adapters_alone(sft_dir, straight):
    out, proc = straight
    assert LINE in proc.stderr and "the reference is the actor with its adapters off (no reference copy)" in \
        proc.stderr
    got = rows(out)
    assert [r["training/global_step"] for r in got] == [1, 2, 3, 4]
    assert all(math.isfinite(v) for r in got for v in r.values() if isinstance(v, (int, float)))
    ckpt = latest_checkpoint(out)
    assert ckpt.name == "global_step_4"
    meta = json.loads((ckpt / "actor" / lora_run.META).read_text())
    assert meta["lora_rank"] == 4 and meta["scale"] == 4.0 and len(meta["target_modules"]) == 7
    actor, _ = adapted(sft_dir, ckpt)
    assert any(m.lora_B.abs().max() > 0 for m in actor.modules() if hasattr(m, "lora_B"))  # they trained
    base, saved = load_file(sft_dir / "model.safetensors"), load_file(ckpt / "actor" / "model.safetensors")
    merged = merged_state_dict(actor)  # the base + the saved adapters
    tied = {"lm_head.weight"} if actor.config.tie_word_embeddings else set()  # a tied head is stored once
    assert set(saved) == set(merged) - tied
    for k, v in saved.items():
        assert torch.allclose(merged[k], v, atol=1e-6, rtol=0), k
        if not k.endswith("proj.weight"):  # norms, embeddings, the head: never adapted, never moved
            assert torch.equal(v, base[k]), k
    assert any(not torch.equal(saved[k], base[k]) for k in saved if k.endswith("proj.weight"))


def test_b_the_reference_is_the_base_model_bit_for_bit(sft_dir, straight):
    out, _ = straight
    actor, ref = adapted(sft_dir, latest_checkpoint(out))
    base = from_pretrained(sft_dir).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, base.config.vocab_size, (6, 14), generator=g)
    mask = torch.ones_like(ids)
    batch = {"sequences": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
             "responses": ids[:, -6:], "response_mask": torch.ones_like(ids[:, -6:])}
    want = compute_log_probs(base, batch, 1.0)[0]
    assert torch.equal(compute_log_probs(ref, batch, 1.0)[0], want)
    assert not torch.equal(compute_log_probs(actor, batch, 1.0)[0], want)  # the policy is not the reference
    # the reference check: the base shared under its own names is the design; a trainable base is not
    run = SimpleNamespace(ref=ref, actor=actor, rollout_model=actor, rollout_copy=False, critic=None,
                          actor_opt=torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad]),
                          critic_opt=None)
    assert ref_check.diagnose(run) is None
    assert {n for n, _ in ref.named_parameters()} == {n for n, p in actor.named_parameters() if not p.requires_grad}
    actor.model.norm.weight.requires_grad_(True)
    assert "requires grad" in ref_check.diagnose(run)
    actor.model.norm.weight.requires_grad_(False)
    before = ref_check.checksum(ref)
    next(m for m in actor.modules() if hasattr(m, "lora_B")).lora_B.data.add_(1.0)  # an adapter moves
    assert torch.equal(ref_check.checksum(ref), before)  # the reference's checksum reads the base alone
    actor.model.norm.weight.data[0] += 1e-3
    assert not torch.equal(ref_check.checksum(ref), before)


def test_c_a_stop_and_resume_is_bit_identical_to_the_straight_run(sft_dir, straight, tmp_path):
    out, _ = straight
    first = launch(args(sft_dir, tmp_path), fault="crash@2")  # dies at the start of step 3; checkpoint 2 stays
    assert first.returncode != 0 and latest_checkpoint(tmp_path).name == "global_step_2"
    second = launch(args(sft_dir, tmp_path))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and LINE in second.stderr
    a, b = latest_checkpoint(out) / "actor", latest_checkpoint(tmp_path) / "actor"
    for f in (lora_run.ADAPTERS, "model.safetensors"):
        wa, wb = load_file(a / f), load_file(b / f)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f
    ra, rb = rows(out), rows(tmp_path)
    assert [r["training/global_step"] for r in rb] == [1, 2, 3, 4]
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if not k.startswith(QUIET)} == \
            {k: v for k, v in y.items() if not k.startswith(QUIET)}


def test_d_the_merged_export_loads_as_a_plain_model(sft_dir, straight):
    out, _ = straight
    ckpt = latest_checkpoint(out)
    actor, _ = adapted(sft_dir, ckpt)
    plain = from_pretrained(ckpt / "actor").eval()
    assert not any(hasattr(m, "lora_A") for m in plain.modules())
    ids = torch.randint(3, plain.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = actor.eval()(ids)
        assert (plain(ids) - want).abs().max() <= 1e-5
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "actor").eval()
    with torch.no_grad():
        assert (hf(ids).logits - want).abs().max() <= 1e-4


def test_e_a_rollout_copy_gets_the_merged_weights_and_fsdp2_is_refused(sft_dir, straight):
    out, _ = straight
    actor, _ = adapted(sft_dir, latest_checkpoint(out))
    copy = from_pretrained(sft_dir).eval().requires_grad_(False)  # CUDA's copy starts at the export
    shard.sync_rollout_weights(copy, actor)
    merged = merged_state_dict(actor)
    for k, v in copy.state_dict().items():
        assert torch.allclose(v, merged[k], atol=1e-6, rtol=0), k
    cfg = cfg_of(sft_dir, out)
    cfg.actor_rollout_ref.actor.strategy = "fsdp2"
    lora_run.refuse_unsupported(cfg)  # no torchrun: fsdp2 is a plain model, LoRA runs
    from nanokl.engine import dist
    real, dist.active = dist.active, lambda: True
    try:
        with pytest.raises(Exception, match=r"^actor_rollout_ref.model.lora_rank=4 is not supported with "
                                            r"actor_rollout_ref.actor.strategy=fsdp2 under torchrun"):
            lora_run.refuse_unsupported(cfg)
    finally:
        dist.active = real


DUMP = """
import os, sys, torch
sys.path.insert(0, {root!r})
import train_ppo
from nanokl.engine import shard
from nanokl.lora import adapter_state_dict
real = train_ppo.finish
def finish(run):  # every rank's adapters at the end, before the run's own finish
    torch.save({{k: v.clone() for k, v in adapter_state_dict(shard.unwrap(run.actor)).items()}},
               os.path.join({out!r}, f"adapters_rank{{run.rank}}.pt"))
    return real(run)
train_ppo.finish = finish
sys.exit(train_ppo.main(sys.argv[1:]))
"""


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_f_ddp_over_two_processes_keeps_one_set_of_adapters(sft_dir, tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(DUMP.format(root=str(ROOT), out=str(tmp_path)))
    argv = args(sft_dir, tmp_path / "run", "actor_rollout_ref.actor.strategy=ddp", "trainer.total_training_steps=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NANOKL_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rows(tmp_path / "run")
    assert [r["training/global_step"] for r in got] == [1, 2]
    assert all(math.isfinite(v) for r in got for v in r.values() if isinstance(v, (int, float)))
    assert proc.stderr.count("LoRA: rank 4") == 1  # rank 0 says it
    a, b = (torch.load(tmp_path / f"adapters_rank{r}.pt") for r in (0, 1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # one set of adapters
    assert any(v.abs().max() > 0 for k, v in a.items() if k.endswith("lora_B"))  # and they trained
    saved = load_file(latest_checkpoint(tmp_path / "run") / "actor" / lora_run.ADAPTERS)
    assert all(torch.equal(saved[k], a[k]) for k in a)


def test_g_a_rollback_reloads_the_adapters_and_a_restart_from_the_reference_zeroes_b(sft_dir, straight):
    from nanokl.harness import remedies
    from nanokl.harness.run_state import _restore
    out, _ = straight
    actor, ref = adapted(sft_dir, out / "global_step_4")  # the actor at step 4 rolls back to step 2
    from nanokl.harness.optim import make_optimizer
    opt, sched = make_optimizer(actor, cfg_of(sft_dir, out).actor_rollout_ref.actor.optim, 4)  # A and B alone
    assert len(opt.param_groups[0]["params"]) == 14
    run = SimpleNamespace(rank=0, actor=actor, actor_opt=opt, actor_sched=sched, critic=None, rollout_copy=False,
                          rollout_model=actor, ref=ref)
    _restore(run, out / "global_step_2", weights=True)
    want = load_file(out / "global_step_2" / "actor" / lora_run.ADAPTERS)
    from nanokl.lora import adapter_state_dict
    assert all(torch.equal(v, want[k]) for k, v in adapter_state_dict(actor).items())
    assert len(opt.state) == len(want)  # Adam's moments of every A and B, by name
    remedies.reload_reference(run)
    assert not opt.state and all(v.abs().max() == 0 for k, v in adapter_state_dict(actor).items()
                                 if k.endswith("lora_B"))
    base = from_pretrained(sft_dir)
    ids = torch.randint(3, base.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(actor(ids), base(ids))  # B = 0: the policy is the reference again
