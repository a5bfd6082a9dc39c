"""Rollout: sample responses from the policy, fast, on a static KV cache (the RLHF hot path).

The idea
--------
Most of a PPO step's time goes into generating responses: one forward per new token, with
nothing to batch across time. The recipe that makes it fast is small (gpt-fast, nano-vllm):

1. Prefill once. The left-padded prompts [B, P] run through the model in one forward that writes
   every layer's keys/values into a preallocated `KVCache` (nanokl/model.py), slots 0..P-1.
   With `n` samples per prompt the prefill still runs on B rows; the prompt slots of the cache
   rows are then repeated n times, so the prompt is never recomputed.
2. Decode with fixed shapes. Each step feeds one token per row at cache slot P+t and reads the
   logits of that one position. Shapes and storage never change between steps, so on CUDA the
   whole step (forward, sampling, EOS bookkeeping, writing the outputs) is captured once into a
   `torch.cuda.CUDAGraph` and replayed: one launch per token instead of hundreds. On CPU the very
   same step function runs eagerly: one code path.
3. Sample without a host sync. Drawing E_i ~ Exp(1) and taking argmax_i p_i / E_i picks token i
   with probability p_i (E_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is
   the i-th with probability p_i / sum p), so sampling is elementwise ops plus an argmax that stay
   on the device. E_i is drawn as -log U_i with U_i ~ Uniform[0, 1), and argmax p_i / E_i is
   computed as argmax log(U_i) / p_i (the same order, one negation fewer; a filtered p_i = 0
   gives -inf and is never drawn): on the CPU uniform_ + log is 2-3x faster than exponential_,
   which was ~10% of a small model's rollout. The host only checks "has every row finished?" (every step on CPU, where it is
   free, every 16 steps on CUDA, where it is a sync).

Which log-probability is returned. `log_probs[b, t]` is log softmax(logits / temperature) of the
chosen token: the temperature-scaled distribution *before* top-k / top-p filtering. That is what
the training forward recomputes (`logprobs_from_logits(logits / temperature)`, nanokl/workers.py), as in
verl, so the two agree to float error and `rollout/log_prob_max_diff` measures only numerics.
Filtering changes which tokens can be drawn, not the recorded log-prob; with top-k/top-p the
sampler is thus slightly off-policy, a known and accepted trade. Greedy decoding (do_sample=False
or temperature=0) records log softmax(logits) at temperature 1.

Layout of the result: `sequences = [prompt (left-padded, P) | response (R)]`, where R is the number
of decode steps actually run (at most `max_new_tokens`; generation stops when every row has
emitted an EOS). `response_mask` is 1 up to and including the first EOS; later tokens are pad.
`attention_mask` and `position_ids` cover the whole sequence, ready for the training forward.

The CUDA-graph engine
---------------------
A graph replays kernels on fixed *addresses*, so everything it touches must be allocated once and
kept: the engine of a model (`GraphEngine`, one per model, found by `generate`) owns

- the buffers, sized once: a KV cache and a `DecodeState` of `max_batch` rows (rounded up to a
  bucket) by `max_len` = longest prompt + response slots. A training run sizes it from its config
  before the first step (`make_engine`, called by nanokl/harness/run.py: rows per rank
  train_batch_size / W x n, or the validation chunk if larger). Batch buckets follow nano-vllm:
  1, 2, 4, 8, then multiples of 16 up to the first one that holds max_batch; a batch runs in the
  smallest bucket that fits it (165 rows run in 176, not 256), the extra rows computing garbage
  that is never read.
- the graphs: one captured decode step per key (bucket, slot span, sampling settings, EOS ids,
  pad id), captured on its first use and then replayed for the engine's life. Nothing in the key
  names an object: a fresh generator every PPO step must not mean a fresh capture every step.
  The span is how much of the cache a step attends over: the first multiple of `SLOT_SPAN` (256)
  slots that holds the filled ones, capped at max_len, so a step at slot 300 of a 1024-slot cache
  reads 512 slots, not 1024. A call captures every span it will reach before its prefill (a
  capture's warm-up runs write into the buffers).
- its own random generator, registered with every graph (a graph replays the random kernels of
  the generators registered with it, advancing their offsets). The caller's generator state is
  copied into it before the prefill and copied back after the last step, so a seed chooses the
  tokens exactly as in eager decoding and the caller's generator advances as if it had drawn them.
  (Exactly, when the batch fills its bucket. A smaller batch draws noise for the whole bucket
  every step, so its tokens are a different draw from the same distribution as eager decoding's.)

A call that does not fit (more rows or more slots than sized, or weights moved to new storage by
`model.to()` / a new module: their old addresses are what the graphs read) *rebuilds* the engine:
new buffers, every graph dropped and captured again on use, `rebuilds` counted. Rebuilding rather
than refusing keeps `generate` a plain library call (generate.py and the benchmarks never size an
engine; the first call sizes it, slots rounded up to 128); in training it is a sizing bug, which
`engine_stats` shows and tests/test_rollout_graphs.py keeps at zero. The PPO update must change the
parameters in place (`optimizer.step()`, `param.copy_()`) so the next replay sees the new weights
for free.

`engine_stats(model)` -> {"captures", "rebuilds", "graphs", "buckets", "max_len"}: graphs captured
and rebuilds since `make_engine` (or the first call), live graphs, and the sizing; a 4-step PPO run
should show one capture per (bucket, span, sampling setting) it used and no rebuild.

The CUDA graph API is reached through `graph_api` only, so the CPU tests can swap in a stand-in
that records the step's aten ops at capture and re-executes them on replay.

Tests: tests/test_rollout.py (greedy equals argmax over full forwards without cache; returned
log-probs equal a training forward; top-k/top-p never sample outside the allowed set; seeded
sampling frequencies pass a chi-square test; EOS and masks), tests/test_rollout_graphs.py (on CPU,
with the recording stand-in: captures once per bucket over a simulated PPO run with new seeds
each step; seeds honoured; replay equals eager, across spans too; the step never syncs with the
host and writes only into the engine's buffers; a CPU train_ppo run sizes the engine once) and tests/test_rollout_cuda.py (on a GPU: replay equals eager in fp32,
and in bf16 the graph's tokens agree with a teacher-forced forward; a weight update is seen by the
replayed graph; moved weights are captured again).
"""

import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from nanokl.model import KVCache

# The CUDA graph API, reached only through here: tests/test_rollout_graphs.py swaps in a stand-in
# that records and replays on CPU. Graphs run on `device_type`.
graph_api = SimpleNamespace(device_type="cuda", CUDAGraph=torch.cuda.CUDAGraph, graph=torch.cuda.graph,
                            Stream=torch.cuda.Stream, stream=torch.cuda.stream,
                            current_stream=torch.cuda.current_stream, graph_pool_handle=torch.cuda.graph_pool_handle)


@dataclass
class RolloutOutput:
    sequences: torch.Tensor  # [N, P+R] prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # [N, P+R] 1 on real prompt tokens and on response_mask
    position_ids: torch.Tensor  # [N, P+R] positions the training forward must use
    responses: torch.Tensor  # [N, R] sampled tokens, pad after the first EOS
    response_mask: torch.Tensor  # [N, R] 1 up to and including the first EOS
    log_probs: torch.Tensor  # [N, R] log-prob of each sampled token (0 where masked)
    prompt_length: int  # P


def filter_logits(logits, top_k=-1, top_p=1.0):
    """Set to -inf every logit outside the top-k and outside the smallest top-p nucleus."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits, temperature=1.0, top_k=-1, top_p=1.0, do_sample=True, generator=None):
    """Next token and its log-prob (under the unfiltered temperature-scaled distribution).

    log p(token) = logit[token] - logsumexp(logits): one gather and one reduction, rather than
    a whole [B, V] log-softmax that would be written out only to read one entry per row."""
    logits = logits.float()
    if not do_sample or temperature == 0:
        token = logits.argmax(-1)
    else:
        logits = logits / temperature
        probs = filter_logits(logits, top_k, top_p).softmax(-1)
        log_u = torch.empty_like(probs).uniform_(generator=generator).log_()  # -E_i, E_i ~ Exp(1)
        token = (log_u / probs).argmax(-1)  # Exp(1) race: a categorical draw with no host sync
    return token, logits.gather(-1, token[:, None])[:, 0] - logits.logsumexp(-1)


class DecodeState:
    """Everything one decode step reads and writes, as tensors with fixed storage."""

    def __init__(self, rows, max_new_tokens, device):
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)  # last sampled token
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)  # its position id
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # cache slot it is written to
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # response column being sampled
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)  # row has emitted EOS
        self.out_tokens = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
        self.out_logp = torch.zeros(rows, max_new_tokens, device=device)

    def rows(self, n):
        """A view of the first n rows (a smaller batch run in a bigger bucket's buffers)."""
        v = DecodeState.__new__(DecodeState)
        for k, t in vars(self).items():
            setattr(v, k, t if k in ("slot", "col") else t[:n])
        return v


def record(state, token, logp, eos_ids, pad_token_id):
    """Store the sampled column; rows already finished get pad and log-prob 0."""
    token = token.masked_fill(state.done, pad_token_id)
    logp = logp.masked_fill(state.done, 0.0)
    state.out_tokens.index_copy_(1, state.col, token[:, None])
    state.out_logp.index_copy_(1, state.col, logp[:, None])
    state.done |= torch.isin(token, eos_ids)
    state.tokens.copy_(token[:, None])
    state.col += 1


def decode_step(model, cache, state, eos_ids, pad_token_id, sampling, generator=None):
    """One token for every row: forward at `state.slot`, sample, record. Fixed shapes throughout,
    so this function is what the CUDA graph captures; on CPU it simply runs."""
    logits = model(state.tokens, position_ids=state.positions, cache=cache, cache_positions=state.slot)
    token, logp = sample_tokens(logits[:, -1], **sampling, generator=generator)
    record(state, token, logp, eos_ids, pad_token_id)
    state.positions += 1
    state.slot += 1


def generate(model, input_ids, attention_mask, max_new_tokens, temperature=1.0, top_k=-1, top_p=1.0,
             do_sample=True, eos_token_id=None, pad_token_id=0, generator=None, use_cuda_graph=None,
             n=1) -> RolloutOutput:
    """Sample `n` responses per left-padded prompt; see the module docstring for the layout.
    `use_cuda_graph` (default: on CUDA) replays the decode step from the model's graph engine."""
    with torch.inference_mode():
        out = _generate(model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, do_sample,
                        eos_token_id, pad_token_id, generator, use_cuda_graph, n)
    # cloned outside inference mode: ordinary tensors that a training forward may use under autograd
    return RolloutOutput(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(out).items()})


def _generate(model, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, do_sample,
              eos_token_id, pad_token_id, generator, use_cuda_graph, n) -> RolloutOutput:
    dev = input_ids.device
    B, P = input_ids.shape
    N, R = B * n, max_new_tokens
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    eos_ids = torch.tensor(eos, dtype=torch.long, device=dev)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, do_sample=do_sample)
    graphs_here = dev.type == graph_api.device_type
    use_cuda_graph = graphs_here if use_cuda_graph is None else bool(use_cuda_graph) and graphs_here

    if use_cuda_graph:
        engine = _engine_for(model, N, P + R)
        cache, state = engine.cache, engine.state.rows(N)
        # capture (first use only) every slot span this call will reach, before the prefill: the
        # warm-up runs scribble on the cache and the state
        spans = sorted({engine.span(P + t) for t in range(1, R)})
        graphs = {S: engine.graph(model, engine.bucket(N), S, eos, pad_token_id, sampling) for S in spans}
        caller_gen = generator if generator is not None else _default_generator(dev)
        generator = engine.gen  # the one the graphs draw from: it takes over the caller's state
        generator.set_state(caller_gen.get_state())
        prefill_cache = cache.view(rows=B, slots=P)  # the prompt needs only its own slots
    else:
        cache = KVCache(model.config, N, P + R, device=dev, dtype=next(model.parameters()).dtype)
        state = DecodeState(N, max(R, 1), dev)
        prefill_cache = cache.view(rows=B)
    cache.reset()
    state.done.zero_()

    # 1. prefill the B prompts once; repeat their cache rows (and last logits) n times
    mask = attention_mask.bool()
    prompt_pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids, mask, prompt_pos, cache=prefill_cache, cache_positions=torch.arange(P, device=dev),
                   logits_to_keep=1)[:, -1]
    if n > 1:
        _repeat_rows(cache, B, n, P)
        logits = logits.repeat_interleave(n, 0)
        input_ids, mask, prompt_pos = (t.repeat_interleave(n, 0) for t in (input_ids, mask, prompt_pos))
    if R > 0:
        state.col.zero_()
        token, logp = sample_tokens(logits, **sampling, generator=generator)
        record(state, token, logp, eos_ids, pad_token_id)
        state.positions.copy_(mask.sum(-1, keepdim=True))  # the first response token's position
        state.slot.fill_(P)

    # 2. decode: one fixed-shape step per token, replayed from a CUDA graph when available
    steps = 1
    check_every = 16 if dev.type == "cuda" else 1
    while steps < R:
        if steps % check_every == 0 and bool(state.done.all()):
            break
        if use_cuda_graph:
            graphs[engine.span(P + steps)].replay()  # attends over a span that holds the P + steps slots
        else:
            # attend over the P + steps filled slots only (a graph must keep the full cache)
            decode_step(model, cache.view(slots=P + steps), state, eos_ids, pad_token_id, sampling, generator)
        steps += 1
    if use_cuda_graph:
        caller_gen.set_state(generator.get_state())  # the caller's generator advances as if it had drawn

    # 3. trim to the columns that have a real token somewhere, and build the training inputs
    responses = state.out_tokens[:, :steps].clone()
    is_eos = torch.isin(responses, eos_ids)
    response_mask = ((is_eos.long().cumsum(-1) - is_eos.long()) == 0).long()
    used = int(response_mask.sum(0).nonzero().max()) + 1 if response_mask.any() else 0
    responses, response_mask = responses[:, :used], response_mask[:, :used]
    log_probs = state.out_logp[:, :used] * response_mask
    resp_pos = mask.sum(-1, keepdim=True) + torch.arange(used, device=dev)
    return RolloutOutput(
        sequences=torch.cat([input_ids, responses], 1),
        attention_mask=torch.cat([mask.long(), response_mask], 1),
        position_ids=torch.cat([prompt_pos, resp_pos], 1),
        responses=responses,
        response_mask=response_mask,
        log_probs=log_probs,
        prompt_length=P,
    )


def _repeat_rows(cache, B, n, P):
    """Rows 0..B-1 become rows 0..B*n-1, each repeated n times in place (prompt shared n ways).
    Only the P prompt slots hold anything yet: the later slots are not copied."""
    for t, dim, slot_dim in ((cache.k, 1, 3), (cache.v, 1, 3), (cache.valid, 0, 1)):
        src = t.narrow(dim, 0, B).narrow(slot_dim, 0, P).repeat_interleave(n, dim)
        t.narrow(dim, 0, B * n).narrow(slot_dim, 0, P).copy_(src)


def _default_generator(dev):
    if dev.type == "cuda":
        return torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
    return torch.default_generator


# ---------------------------------------------------------------------------------------------
# CUDA graphs: buffers sized once per model, one captured decode step per bucket and setting.

_ENGINES = weakref.WeakKeyDictionary()  # model -> its GraphEngine, dropped with the model
SLOT_SPAN = 256  # a decode graph attends over the first multiple of this many slots that holds the filled ones


def make_engine(model, max_batch, max_len):
    """Size `model`'s graph engine for calls of at most `max_batch` rows (prompts x n) and
    `max_len` slots (prompt + response), replacing any engine it had. Returns it, or None on a
    device without graphs (CPU decodes eagerly and needs none)."""
    if next(model.parameters()).device.type != graph_api.device_type:
        return None
    _ENGINES[model] = GraphEngine(model, max_batch, max_len)
    return _ENGINES[model]


def engine_stats(model) -> dict:
    """Captures and rebuilds of `model`'s engine so far, its live graphs and its sizing (zeros and
    no buckets when it has none: CPU, or graphs off)."""
    eng = _ENGINES.get(model)
    if eng is None:
        return {"captures": 0, "rebuilds": 0, "graphs": 0, "buckets": [], "max_len": 0}
    return {"captures": eng.captures, "rebuilds": eng.rebuilds, "graphs": len(eng.graphs),
            "buckets": list(eng.buckets), "max_len": eng.max_len}


def batch_buckets(max_batch):
    """1, 2, 4, 8, then multiples of 16, up to the first bucket that holds max_batch rows."""
    sizes = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    top = next(b for b in sizes if b >= max_batch)
    return [b for b in sizes if b <= top]


def _engine_for(model, rows, length):
    """The engine of this model, made by this call when there is none, rebuilt when the call does
    not fit it (see the module docstring)."""
    eng = _ENGINES.get(model)
    roomy = -(-length // 128) * 128  # slots rounded up: a slightly longer prompt next time still fits
    if eng is None:
        eng = _ENGINES[model] = GraphEngine(model, rows, roomy)
    elif not eng.fits(model, rows, length):
        eng.rebuild(model, max(rows, eng.buckets[-1]), eng.max_len if length <= eng.max_len else roomy)
    return eng


def _weight_ptrs(model):
    return [t.data_ptr() for t in (*model.parameters(), *model.buffers())]


class GraphEngine:
    """The static buffers of one model's rollout and its captured decode steps."""

    def __init__(self, model, max_batch, max_len):
        self.captures = self.rebuilds = 0
        self._allocate(model, max_batch, max_len)

    def _allocate(self, model, max_batch, max_len):
        self.graphs, self.cache, self.state = {}, None, None  # free the old ones before allocating anew
        p = next(model.parameters())
        self.buckets, self.max_len = batch_buckets(max(max_batch, 1)), max_len
        self.ptrs = _weight_ptrs(model)
        self.cache = KVCache(model.config, self.buckets[-1], max_len, device=p.device, dtype=p.dtype)
        self.state = DecodeState(self.buckets[-1], max_len, p.device)
        self.gen = torch.Generator(p.device)
        self.pool = graph_api.graph_pool_handle()

    def rebuild(self, model, max_batch, max_len):
        self.rebuilds += 1
        self._allocate(model, max_batch, max_len)

    def fits(self, model, rows, length):
        return rows <= self.buckets[-1] and length <= self.max_len and self.ptrs == _weight_ptrs(model)

    def bucket(self, rows):
        return next(b for b in self.buckets if b >= rows)

    def span(self, filled):
        """Cache slots a decode step attends over when `filled` slots are in use."""
        return min(-(-filled // SLOT_SPAN) * SLOT_SPAN, self.max_len)

    def graph(self, model, bucket, span, eos, pad_token_id, sampling):
        """The captured decode step for this bucket, span and setting (captured on its first use)."""
        key = (bucket, span, tuple(sampling.items()), tuple(eos), pad_token_id)
        if key not in self.graphs:
            # the graph reads the EOS ids from this tensor's address on every replay: keep it alive
            eos_static = torch.tensor(eos, dtype=torch.long, device=self.cache.k.device)
            self.graphs[key] = (self._capture(model, bucket, span, eos_static, pad_token_id, sampling), eos_static)
        return self.graphs[key][0]

    def _capture(self, model, bucket, span, eos_ids, pad_token_id, sampling):
        self.captures += 1
        cache, state = self.cache.view(rows=bucket, slots=span), self.state.rows(bucket)
        for t in (state.slot, state.col, state.positions, state.done):
            t.zero_()  # warm-up writes at slot/column 0..1; generate() re-initialises all of it after
        s = graph_api.Stream()
        s.wait_stream(graph_api.current_stream())
        with graph_api.stream(s):  # warm-up (cuBLAS handles, allocator) off the capture stream
            for _ in range(2):
                decode_step(model, cache, state, eos_ids, pad_token_id, sampling, self.gen)
        graph_api.current_stream().wait_stream(s)
        graph = graph_api.CUDAGraph()
        graph.register_generator_state(self.gen)
        with graph_api.graph(graph, pool=self.pool):
            decode_step(model, cache, state, eos_ids, pad_token_id, sampling, self.gen)
        return graph
