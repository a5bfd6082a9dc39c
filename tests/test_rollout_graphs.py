"""nanokl.engine.graphs' CUDA-graph discipline, checked on CPU with a recording stand-in for CUDA graphs.

The stand-in (`FakeGraphs` in tests/fake_cuda_graph.py, swapped in for `graphs.graph_api`) keeps what matters of CUDA graph
semantics: capture records the aten ops of the decode step (a TorchDispatchMode) and leaves no
trace (every buffer it wrote is restored: a real capture runs nothing); replay re-executes those
ops on the same static tensors, so in-place writes land in the captured buffers, intermediates are
recomputed, and Python values (shapes, constants, which generator object) stay frozen at capture.
A host sync during capture is an error, as is a random op on a generator not registered with the
graph (CUDA's default generator is always registered). Its own test checks these properties.

On it:
- a simulated 8-step PPO run (new seed each step, prompt lengths that vary, n > 1, in-place weight
  updates, a validation batch of another size and setting) captures once per (bucket, setting),
  never rebuilds, and gives each step the tokens, log-probs and generator state of eager decoding;
- the same seed gives the same tokens, another seed other tokens; no generator means the default
  one, as in eager decoding;
- replay equals eager, greedy and sampled, for batches smaller than their bucket, and across the
  slot spans a long generation crosses (one graph per span);
- calls that do not fit the sized engine, and weights moved to new storage, rebuild (counted) and
  still decode correctly; an in-place update is seen without a rebuild;
- the buckets are 1, 2, 4, 8 and multiples of 16 (a 165-row batch runs in 176), against a brute-force
  reference;
- the decode step never syncs with the host and writes only into the state and cache buffers
  (a dispatch-mode check, itself shown to catch a planted `.item()` and a planted weight write);
- the memory budget (gpu_memory_utilization, with `device_memory` patched): the KV-cache bytes
  against a hand computation and against the tensors the engine allocates; a budget that holds
  the buffers leaves the sizing as it was, one a byte short refuses it naming the key, and a
  training run whose GPU cannot hold the cache stops at setup with that one-line error.
"""

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fake_cuda_graph import FakeGraphs, host_sync, storage, written
from nanokl.engine import graphs
from nanokl.engine import model as M
from nanokl.engine.fused import fuse_for_rollout
from nanokl.engine.graphs import KVBudgetError, batch_buckets, engine_bytes, engine_stats, kv_cache_bytes, make_engine
from nanokl.rollout import DecodeState, decode_step, generate

V, EOS, PAD = 48, 1, 0


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from a second thread, and on a shared machine they wait for it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fake(monkeypatch):
    f = FakeGraphs()
    monkeypatch.setattr(graphs, "graph_api", f)
    return f


def test_the_stand_in_records_and_replays_like_a_cuda_graph(fake):
    x, y, k = torch.zeros(3), torch.ones(3), 2.0
    g = fake.CUDAGraph()
    with fake.graph(g):
        tmp = y * k  # an intermediate: recomputed on replay from y's value then
        x.add_(tmp)  # a write into a captured buffer
        k = 100.0  # a Python value after the fact: the graph never sees it
    assert torch.equal(x, torch.zeros(3))  # capture ran nothing
    g.replay()
    assert torch.equal(x, torch.full((3,), 2.0))
    y.fill_(5.0)
    g.replay()
    assert torch.equal(x, torch.full((3,), 12.0))
    with pytest.raises(RuntimeError, match="synchronizes"), fake.graph(fake.CUDAGraph()):
        bool(x.sum() > 0)
    with pytest.raises(RuntimeError, match="not registered"), fake.graph(fake.CUDAGraph()):
        torch.empty(3).exponential_(generator=torch.Generator())


# ----------------------------------------------------------------------------------------------
# The engine on the stand-in


def tiny_model(seed=0, scale=0.15, fused=False):
    """fused: q|k|v and gate|up fused, as the rollout copy of a CUDA run is (fused.fuse_for_rollout)."""
    torch.manual_seed(seed)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
    m = M.CausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, scale)
    return fuse_for_rollout(m.eval()) if fused else m.eval()


def prompts(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for b in range(B):
        mask[b, : (b * 3 + seed) % T] = 0  # left padding of varied length
    return ids.masked_fill(mask == 0, PAD), mask


def same_output(a, b):
    assert torch.equal(a.responses, b.responses)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.position_ids, b.position_ids)
    assert (a.log_probs - b.log_probs).abs().max() <= 1e-5


def test_a_simulated_ppo_run_captures_once_per_bucket_and_honours_every_seed(fake):
    m = tiny_model(fused=True)
    n, B_train, B_val, max_P, R = 4, 4, 7, 9, 12  # 16 rows fill their bucket: same draws as eager
    engine = make_engine(m, max(B_train * n, B_val), max_P + R)  # what harness/run.setup does
    assert engine is not None and engine.buckets == [1, 2, 4, 8, 16]
    train_kw = dict(temperature=0.9, top_p=0.95, eos_token_id=[EOS], pad_token_id=PAD, n=n)
    val_kw = dict(do_sample=False, eos_token_id=[EOS], pad_token_id=PAD)
    for step in range(8):
        ids, mask = prompts(B_train, 4 + step % 6, seed=step)  # the longest prompt changes every step
        g_graph, g_eager = (torch.Generator().manual_seed(1000 + step) for _ in range(2))  # fresh per step
        out = generate(m, ids, mask, R, generator=g_graph, use_cuda_graph=True, **train_kw)
        ref = generate(m, ids, mask, R, generator=g_eager, use_cuda_graph=False, **train_kw)
        same_output(out, ref)
        assert torch.equal(g_graph.get_state(), g_eager.get_state())  # advanced as if it had drawn
        with torch.no_grad():  # the update: new values in the same storage
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        if step % 4 == 3:  # validation: another batch size, greedy
            vids, vmask = prompts(B_val, max_P, seed=50 + step)
            same_output(generate(m, vids, vmask, R, use_cuda_graph=True, **val_kw),
                        generate(m, vids, vmask, R, use_cuda_graph=False, **val_kw))
    stats = engine_stats(m)
    assert stats["rebuilds"] == 0
    assert stats["captures"] == stats["graphs"] == len(fake.graphs) == 2  # (16, sampled), (8, greedy)


def test_same_seed_same_tokens_other_seed_other_tokens(fake):
    m = tiny_model(1, scale=0.1)
    ids, mask = prompts(8, 7, seed=1)
    kw = dict(eos_token_id=None, pad_token_id=PAD, use_cuda_graph=True, n=2)  # 16 rows: a full bucket

    def tokens(seed):
        return generate(m, ids, mask, 10, generator=torch.Generator().manual_seed(seed), **kw).responses

    a, b, c = tokens(3), tokens(4), tokens(3)
    assert torch.equal(a, c) and not torch.equal(a, b)
    assert len(fake.graphs) == 1
    # no generator: the default one, exactly as in eager decoding
    torch.manual_seed(9)
    graph = generate(m, ids, mask, 10, **kw)
    after_graph = torch.default_generator.get_state()
    torch.manual_seed(9)
    eager = generate(m, ids, mask, 10, **{**kw, "use_cuda_graph": False})
    assert torch.equal(graph.responses, eager.responses)
    assert torch.equal(after_graph, torch.default_generator.get_state())


GREEDY, TOP_K, TOP_P = dict(do_sample=False), dict(temperature=1.2, top_k=6), dict(temperature=0.8, top_p=0.7)


# Greedy: any batch, also one smaller than its bucket (3 rows in 4, 15 in 16). Sampled: full buckets,
# where the graph draws exactly the noise eager decoding draws (a smaller batch draws the bucket's:
# another draw from the same distribution, checked below).
@pytest.mark.parametrize("B,n,sampling,fused", [(1, 1, GREEDY, False), (3, 1, GREEDY, True), (5, 3, GREEDY, False),
                                                (1, 1, TOP_K, True), (4, 1, TOP_P, False), (8, 2, TOP_K, False),
                                                (4, 4, TOP_P, True)])
def test_replay_equals_eager(fake, B, n, sampling, fused):
    m = tiny_model(2, fused=fused)
    ids, mask = prompts(B, 6, seed=B)
    kw = dict(eos_token_id=[EOS, 2], pad_token_id=PAD, n=n, **sampling)
    out = generate(m, ids, mask, 14, generator=torch.Generator().manual_seed(0), use_cuda_graph=True, **kw)
    ref = generate(m, ids, mask, 14, generator=torch.Generator().manual_seed(0), use_cuda_graph=False, **kw)
    same_output(out, ref)
    assert len(fake.graphs) == 1 and engine_stats(m)["buckets"][-1] >= B * n


@pytest.mark.parametrize("graphs", [True, False])
def test_zero_new_tokens_is_an_empty_response_on_every_path(fake, graphs):
    """max_new_tokens=0 samples nothing: a [N, 0] response, the prompt alone, even after an earlier
    call left tokens in the engine's buffers (the graph path once returned their column 0)."""
    m = tiny_model(4)
    ids, mask = prompts(3, 5, seed=1)
    kw = dict(eos_token_id=[EOS], pad_token_id=PAD, n=2, temperature=0.9, use_cuda_graph=graphs)
    generate(m, ids, mask, 6, generator=torch.Generator().manual_seed(0), **kw)  # leaves tokens behind
    out = generate(m, ids, mask, 0, generator=torch.Generator().manual_seed(0), **kw)
    assert out.responses.shape == out.response_mask.shape == out.log_probs.shape == (6, 0)
    assert torch.equal(out.sequences, ids.repeat_interleave(2, 0))
    assert torch.equal(out.attention_mask, mask.long().repeat_interleave(2, 0))


def test_a_batch_smaller_than_its_bucket_samples_from_the_model_and_honours_its_seed(fake):
    m = tiny_model(7)
    ids, mask = prompts(5, 6, seed=3)  # 10 rows in bucket 16
    kw = dict(eos_token_id=[EOS], pad_token_id=PAD, n=2, temperature=0.9, top_k=8, use_cuda_graph=True)

    def run(seed):
        return generate(m, ids, mask, 12, generator=torch.Generator().manual_seed(seed), **kw)

    a, b, c = run(1), run(2), run(1)
    assert torch.equal(a.responses, c.responses) and not torch.equal(a.responses, b.responses)
    with torch.no_grad():  # every recorded log-prob is the training forward's, at the same temperature
        logits = m(a.sequences, a.attention_mask, a.position_ids)[:, a.prompt_length - 1:-1]
    ref = (logits / 0.9).log_softmax(-1).gather(-1, a.responses[..., None])[..., 0] * a.response_mask
    assert (ref - a.log_probs).abs().max() <= 1e-5
    assert engine_stats(m)["captures"] == 1


def test_decode_crosses_slot_spans_with_one_graph_each(fake, monkeypatch):
    monkeypatch.setattr(graphs, "SLOT_SPAN", 4)  # spans of 4 slots: 6 + 13 slots reach spans 8..20
    m = tiny_model(8)
    make_engine(m, 4, 6 + 14)
    ids, mask = prompts(4, 6, seed=8)
    kw = dict(eos_token_id=None, pad_token_id=PAD, temperature=1.1)
    for seed in (0, 1):  # the second call replays what the first captured
        same_output(generate(m, ids, mask, 14, generator=torch.Generator().manual_seed(seed), **kw),
                    generate(m, ids, mask, 14, generator=torch.Generator().manual_seed(seed),
                             use_cuda_graph=False, **kw))
        assert engine_stats(m)["captures"] == len(fake.graphs) == 4  # spans 8, 12, 16, 20


def test_calls_that_do_not_fit_rebuild_and_still_decode_correctly(fake):
    m = tiny_model(3)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)
    make_engine(m, 4, 16)

    def check(B, T, R):
        ids, mask = prompts(B, T, seed=B + T)
        same_output(generate(m, ids, mask, R, use_cuda_graph=True, **kw),
                    generate(m, ids, mask, R, use_cuda_graph=False, **kw))
        return engine_stats(m)

    assert check(4, 8, 8)["rebuilds"] == 0
    s = check(4, 12, 8)  # longer than sized
    assert s["rebuilds"] == 1 and s["max_len"] >= 20
    s = check(7, 8, 8)  # more rows than sized
    assert s["rebuilds"] == 2 and s["buckets"][-1] == 8
    with torch.no_grad():  # in place: the replay sees it, nothing is rebuilt
        for p in m.parameters():
            p.mul_(1.1)
    assert check(7, 8, 8)["rebuilds"] == 2
    for p in m.parameters():  # rebinding: new storage, which the captured graphs do not read
        p.data = p.data.clone() * 0.9
    s = check(7, 8, 8)
    assert s["rebuilds"] == 3 and s["captures"] == 4 and s["graphs"] == 1


def test_buckets_are_powers_of_two_to_8_then_multiples_of_16():
    for rows in range(1, 300):
        top = batch_buckets(rows)[-1]
        assert top == min(b for b in [1, 2, 4, 8] + list(range(16, 400, 16)) if b >= rows)
    assert batch_buckets(165) == [1, 2, 4, 8, *range(16, 177, 16)]  # 165 rows run in 176, not 256


def test_cpu_without_the_stand_in_has_no_engine():
    m = tiny_model(4)
    assert make_engine(m, 8, 16) is None
    ids, mask = prompts(2, 5, seed=0)
    generate(m, ids, mask, 4, do_sample=False, use_cuda_graph=True)  # graphs asked for, CPU decodes eagerly
    assert engine_stats(m) == {"captures": 0, "rebuilds": 0, "graphs": 0, "buckets": [], "max_len": 0}


# ----------------------------------------------------------------------------------------------
# Step hygiene: what one decode step may do


class StepAudit(TorchDispatchMode):
    """Every host sync the step calls, and the storage of every tensor it writes."""

    def __init__(self):
        super().__init__()
        self.syncs, self.writes = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if host_sync(func, args, kwargs):
            self.syncs.append(str(func))
        self.writes |= {storage(t) for t in written(func, args, kwargs)}
        return func(*args, **kwargs)


def audit_step(m, sampling, rows=6, slots=24, generator=None):
    cache = M.KVCache(m.config, rows, slots)
    state = DecodeState(rows, slots, torch.device("cpu"))
    state.slot.fill_(5)
    state.positions.fill_(5)
    cache.valid[:, :5] = True
    static = {storage(t) for t in (cache.k, cache.v, cache.valid, *vars(state).values())}
    weights = {storage(t) for t in (*m.parameters(), *m.buffers())}
    eos = torch.tensor([EOS])
    with torch.inference_mode(), StepAudit() as audit:
        # views of the first rows, as the graph of a smaller bucket uses them: same storage
        decode_step(m, cache.view(rows=rows - 1), state.rows(rows - 1), eos, PAD, sampling, generator)
    return audit, static, weights | {storage(eos)}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=-1, top_p=1.0, do_sample=False),
                                      dict(temperature=0.7, top_k=5, top_p=0.9, do_sample=True)])
def test_the_decode_step_never_syncs_and_writes_only_static_buffers(sampling, fused):
    m = tiny_model(5, fused=fused)
    audit, static, external = audit_step(m, sampling, generator=torch.Generator().manual_seed(0))
    assert audit.syncs == []
    assert not (audit.writes & external)  # never a weight, a buffer of the model or the EOS ids
    assert static <= audit.writes  # and every cache / state buffer is written (the step does its job)
    # anything else written was allocated by the step itself (a temporary, dead after it)


def test_the_step_audit_catches_a_sync_and_a_weight_write():
    m = tiny_model(6)
    forward = m.forward

    def leaky(*a, **kw):
        logits = forward(*a, **kw)
        if logits.max().item() > 1e9:  # a host sync
            pass
        m.lm_head.weight.add_(0.0)  # a write into a weight
        return logits

    m.forward = leaky
    audit, _, external = audit_step(m, dict(temperature=1.0, top_k=-1, top_p=1.0, do_sample=False))
    assert audit.syncs and (audit.writes & external)


def test_a_ppo_run_sizes_the_engine_from_its_config_and_never_rebuilds(fake, sft_dir, tmp_path, monkeypatch):
    """train_ppo end to end on the stand-in: setup sizes the engine once (rows per rank x n, or the
    validation chunk), and three steps with two validations capture each (bucket, setting) once."""
    import train_ppo
    from nanokl.harness import run as run_module
    from nanokl.harness.tracking import read_metrics

    sized = []

    def spy(model, max_batch, max_len, memory_fraction=None, key=None):
        assert memory_fraction == 0.5 and key == "actor_rollout_ref.rollout.gpu_memory_utilization"  # verl's default
        sized.append((model, max_batch, max_len))
        return make_engine(model, max_batch, max_len, memory_fraction, key)  # device_memory: None on CPU

    monkeypatch.setattr(run_module, "make_engine", spy)
    root = Path(__file__).resolve().parents[1]
    args = ["--config", str(root / "configs" / "grpo_arith.yaml"), "data.num_train=64", "data.num_val=12",
            "data.train_batch_size=4", "data.val_batch_size=5", "actor_rollout_ref.rollout.n=4",
            "data.max_prompt_length=20", "data.max_response_length=16", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.logger=[jsonl]",
            "trainer.test_freq=2", "trainer.save_freq=-1", "trainer.total_training_steps=3",
            f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}"]
    train_ppo.main([*args, f"trainer.default_local_dir={tmp_path / 'graphs'}"])
    [(model, max_batch, max_len)] = sized
    assert max_batch == max(4 * 4, 5 * 1) and max_len == 20 + 16
    stats = engine_stats(model)
    # training: 16 rows sampled (bucket 16); validation: chunks of 5, 5, 2 prompts, greedy (buckets 8, 2)
    assert stats == {"captures": 3, "rebuilds": 0, "graphs": 3, "buckets": [1, 2, 4, 8, 16], "max_len": max_len}
    # the same run decoded eagerly samples the same responses (full bucket: the same draws; greedy)
    train_ppo.main([*args, f"trainer.default_local_dir={tmp_path / 'eager'}",
                    "actor_rollout_ref.rollout.use_cuda_graph=false"])
    graphs, eager = read_metrics(tmp_path / "graphs"), read_metrics(tmp_path / "eager")
    assert [r["training/global_step"] for r in graphs] == [0, 1, 2, 3]
    compared = 0
    for g, e in zip(graphs, eager):
        for k in ("response_length/mean", "critic/score/mean", "val-core/arith/acc/mean@1"):
            if k in g or k in e:
                assert g[k] == e[k], (g["training/global_step"], k)
                compared += 1
    assert compared == 3 * 2 + 3  # 3 training steps; validations before training, at step 2 and at the end


# ----------------------------------------------------------------------------------------------
# Memory: the KV cache within gpu_memory_utilization of the device


def test_kv_cache_bytes_by_hand_and_as_allocated(fake):
    m = tiny_model()  # 2 layers, 2 KV heads of 32 / 4 = 8 dims
    # layers x 2 (K, V) x kv_heads x head_dim x slots x rows x bytes: 2 * 2 * 2 * 8 = 64; x 21 x 16 x 4
    assert kv_cache_bytes(m.config, 16, 21, torch.float32) == 86016
    assert kv_cache_bytes(m.config, 16, 21, torch.bfloat16) == 43008
    assert engine_bytes(m.config, 16, 21, torch.float32) == 86016 + 16 * 21 * 13  # mask 1 + token 8 + log-prob 4
    qwen_05b = M.ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2)
    assert kv_cache_bytes(qwen_05b, 1, 1, torch.bfloat16) == 12 * 1024  # 24 x 2 x 2 x 64 x 2
    assert kv_cache_bytes(qwen_05b, 256, 1536, torch.bfloat16) == 4.5 * 2**30
    engine = make_engine(m, 11, 21)  # 11 rows: the top bucket, 16, is allocated
    assert engine.buckets[-1] == 16
    assert engine.cache.k.nbytes + engine.cache.v.nbytes == kv_cache_bytes(m.config, 16, 21, torch.float32)
    state = engine.static(DecodeState)  # what rollout.generate has the engine allocate beside the cache
    assert engine_bytes(m.config, 16, 21, torch.float32) == sum(
        t.nbytes for t in (engine.cache.k, engine.cache.v, engine.cache.valid, state.out_tokens, state.out_logp))


def test_the_memory_budget_keeps_a_cache_that_fits_and_refuses_one_that_does_not(fake, monkeypatch):
    m = tiny_model()
    need = engine_bytes(m.config, 16, 21, torch.float32)  # 90384 bytes for 11 rows (bucket 16) x 21 slots
    total, in_use = 1_000_000, 400_000
    monkeypatch.setattr(graphs, "device_memory", lambda device: (total - in_use, total))
    key = "actor_rollout_ref.rollout.gpu_memory_utilization"
    exact = (in_use + need) / total  # the fraction whose budget is the buffers to the byte
    make_engine(m, 11, 21, memory_fraction=exact, key=key)
    unbounded = tiny_model()
    make_engine(unbounded, 11, 21)
    assert engine_stats(m) == engine_stats(unbounded) and engine_stats(m)["buckets"][-1] == 16  # the same sizing
    m2 = tiny_model()
    with pytest.raises(KVBudgetError, match=key) as err:
        make_engine(m2, 11, 21, memory_fraction=(in_use + need - 1) / total, key=key)  # one byte short
    assert "16 rows x 21 slots" in str(err.value) and "\n" not in str(err.value)
    assert engine_stats(m2)["buckets"] == []  # nothing was allocated
    with pytest.raises(KVBudgetError):  # the device already fuller than the fraction: no budget at all
        make_engine(m2, 1, 1, memory_fraction=0.3, key=key)
    monkeypatch.setattr(graphs, "device_memory", lambda device: None)  # CPU: no memory to ask about
    assert make_engine(m2, 11, 21, memory_fraction=0.0, key=key) is not None


def test_a_run_whose_gpu_cannot_hold_the_cache_stops_at_setup(fake, sft_dir, tmp_path, monkeypatch):
    import train_ppo
    from nanokl.harness.config.yaml_io import UserError
    monkeypatch.setattr(graphs, "device_memory", lambda device: (2**30, 2**31))  # half of 2 GiB in use
    root = Path(__file__).resolve().parents[1]
    args = ["--config", str(root / "configs" / "arith_tiny.yaml"),
            f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}", f"trainer.default_local_dir={tmp_path}",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5"]
    with pytest.raises(UserError, match="actor_rollout_ref.rollout.gpu_memory_utilization=0.5 leaves 0.00 GiB"):
        train_ppo.main(args)
