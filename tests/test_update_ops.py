"""bench/update_ops.py: one PPO step's training side on the meta device, and the issue's budgets.

The bench runs the five passes of a GSM8K step (128 responses of 256 tokens, Qwen2.5-0.5B widths) on
the meta device under the first GPU run's settings (`first`) and configs/gsm8k_qwen2.5_0.5b.yaml's
(`config`), with 1 and 2 layers built; op counts are linear in the layers, so the 24-layer counts are
extrapolated (syncs, micro-batches and the largest tensor are checked not to depend on the layers).
Held here, for both settings and every pass:
  - no host sync inside a micro-batch loop; outside them one read of the mask per pass and one read per
    mini-batch (`workers._step`);
  - under `config`, no tensor above the LM head's chunk x vocab x 4 bytes (fp32 logits of one chunk);
  - under `config`, at least 4x fewer dispatched ops per step than under `first`.
The checkout before the sync-free loops fails all three: its packing and attention layout read the
device 9 times a forward micro-batch (10 in an update), its config had the first settings, and its
Batching has no chunk. And the bench itself must see a read, and a blocking copy, put into a loop.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FORWARDS = ("old_log_prob", "ref", "values")
UPDATES = ("update_critic", "update_actor")


def load_bench():
    spec = importlib.util.spec_from_file_location("update_ops", ROOT / "bench" / "update_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def step():
    """(bench, {setting: (its specs, per-phase results at 24 layers)})."""
    bench = load_bench()
    out = {}
    for name in ("first", "config"):
        setting = bench.settings(name)
        out[name] = setting, bench.measure(setting, "0.5b", build=(1, 2))[0]
    return bench, out


@pytest.mark.parametrize("name", ["first", "config"])
def test_no_host_sync_inside_micro_batch_loops(step, name):
    bench, out = step
    _, res = out[name]
    mini_batches = bench.N // bench.MINI  # 1 epoch
    for phase in bench.PHASES:
        r = res[phase]
        assert r["micro"] >= 2, (phase, r["micro"])  # the loops ran (and were seen) more than once
        assert r["sync_inside"] == 0, (name, phase, r["sync_kinds_inside"])
        bound = 1 if phase in FORWARDS else 1 + mini_batches  # the mask, once; each mini-batch's one read
        assert r["sync_outside"] <= bound, (name, phase, r["sync_kinds_outside"])


def test_config_largest_tensor_within_one_chunk_of_logits(step):
    bench, out = step
    setting, res = out["config"]
    vocab = bench.SHAPES["0.5b"]["vocab_size"]
    chunk = setting["actor"].get("chunk")
    assert chunk, "the config's actor does not chunk its LM head"
    for phase in ("old_log_prob", "ref", "update_actor"):  # the passes through the LM head chunk it
        assert setting[bench.SPEC[phase]].get("chunk") == chunk, (phase, setting[bench.SPEC[phase]])
    for phase in bench.PHASES:
        size, op, shape, dtype = res[phase]["largest"]
        assert size <= chunk * vocab * 4, (phase, bench.largest_cell(res[phase]["largest"]))


def test_config_step_at_least_4x_fewer_ops_than_first(step):
    bench, out = step
    total = {name: sum(res[phase]["ops"] for phase in bench.PHASES) for name, (_, res) in out.items()}
    assert total["first"] >= 4 * total["config"], total
    table = bench.tables({name: res for name, (_, res) in out.items()}, 24, "0.5b")  # the script's own table
    assert f"**{total['first'] / total['config']:.2f}x**" in table, table


def test_the_bench_sees_a_sync_inside_a_loop(monkeypatch):
    bench = load_bench()
    plain = bench.forwards.critic_values

    def reading(critic, mb, inputs):
        out = plain(critic, mb, inputs)
        bool(out.isfinite().all())  # a device read per micro-batch
        torch.tensor([1.0], device=out.device)  # a blocking host-to-device copy (no dispatch shows it)
        return out
    for module in (bench.forwards, bench.workers):  # the values pass and the critic's update look it up
        monkeypatch.setattr(module, "critic_values", reading)
    res = bench.summarize(bench.count_step(bench.settings("config"), "0.5b", layers=1))
    for phase in ("values", "update_critic"):
        m = res[phase]["micro"]
        assert res[phase]["sync_kinds_inside"] == {"_local_scalar_dense:item": m, "tensor:h2d": m}, res[phase]
    for phase in ("old_log_prob", "ref", "update_actor"):
        assert res[phase]["sync_inside"] == 0, res[phase]
