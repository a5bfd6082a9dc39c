"""Rollout: sample responses from the policy, fast, on a static KV cache (the RLHF hot path).

The idea
--------
Most of a PPO step's time goes into generating responses: one forward per new token, with
nothing to batch across time. The recipe that makes it fast is small (gpt-fast, nano-vllm):

1. Prefill once. The left-padded prompts [B, P] run through the model in one forward that writes
   every layer's keys/values into a preallocated `KVCache` (nanokl/model.py), slots 0..P-1.
   With `n` samples per prompt the prefill still runs on B rows; the cache rows are then
   repeated n times, so the prompt is never recomputed.
2. Decode with fixed shapes. Each step feeds one token per row at cache slot P+t and reads the
   logits of that one position. Shapes and storage never change between steps, so on CUDA the
   whole step (forward, sampling, EOS bookkeeping, writing the outputs) is captured once into a
   `torch.cuda.CUDAGraph` and replayed: one launch per token instead of hundreds. On CPU the very
   same step function runs eagerly: one code path.
3. Sample without a host sync. Drawing E_i ~ Exp(1) and taking argmax_i p_i / E_i picks token i
   with probability p_i (E_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is
   the i-th with probability p_i / sum p), so sampling is elementwise ops plus an argmax that stay
   on the device. The host only checks "has every row finished?" (every step on CPU, where it is
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

CUDA graphs and weight updates. A graph replays kernels on fixed *addresses*: it reads the
weights from the storage they had at capture. The PPO update must therefore change the actor's
(or the bf16 rollout copy's) parameters in place (`optimizer.step()`, `param.copy_()`), never
rebind them; then the next replay sees the new weights for free. If the storage does change
(`model.to()`, loading a new module), the engine notices (it records every parameter's
data_ptr at capture) and captures again. One graph is captured per batch-size bucket (1, 2, 4, ...)
and sampling setting, all sharing one memory pool; a batch runs in the smallest bucket that fits,
the extra rows computing garbage that is never read.

Tests: tests/test_rollout.py (greedy equals argmax over full forwards without cache; returned
log-probs equal a training forward; top-k/top-p never sample outside the allowed set; seeded
sampling frequencies pass a chi-square test; EOS and masks) and tests/test_rollout_cuda.py (graph
replay equals eager; a weight update is seen by the replayed graph).
"""

import weakref
from dataclasses import dataclass

import torch

from nanokl.model import KVCache


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
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        token = (probs / noise).argmax(-1)  # Exp(1) race: a categorical draw with no host sync
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
    """Sample `n` responses per left-padded prompt; see the module docstring for the layout."""
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
    if use_cuda_graph is None:
        use_cuda_graph = dev.type == "cuda"
    use_cuda_graph = use_cuda_graph and dev.type == "cuda"
    dtype = next(model.parameters()).dtype

    if use_cuda_graph:
        engine = _graph_engine(model, N, P + R, dtype)
        cache, full_state = engine.cache, engine.state
        bucket = engine.bucket(N)
        state = full_state.rows(N)
        # capture (first use only) before the prefill: the warm-up runs scribble on the cache
        graph = engine.graph(model, bucket, eos, pad_token_id, sampling, generator) if R > 1 else None
    else:
        cache = KVCache(model.config, N, P + R, device=dev, dtype=dtype)
        state = DecodeState(N, max(R, 1), dev)
    cache.reset()
    state.done.zero_()

    # 1. prefill the B prompts once; repeat their cache rows (and last logits) n times
    mask = attention_mask.bool()
    prompt_pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    prefill_cache = cache.view(rows=B)
    logits = model(input_ids, mask, prompt_pos, cache=prefill_cache, cache_positions=torch.arange(P, device=dev),
                   logits_to_keep=1)[:, -1]
    if n > 1:
        _repeat_rows(cache, B, n)
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
            graph.replay()
        else:
            # attend over the P + steps filled slots only (a graph must keep the full cache)
            decode_step(model, cache.view(slots=P + steps), state, eos_ids, pad_token_id, sampling, generator)
        steps += 1

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


def _repeat_rows(cache, B, n):
    """Rows 0..B-1 become rows 0..B*n-1, each repeated n times in place (prompt shared n ways)."""
    for t, dim in ((cache.k, 1), (cache.v, 1), (cache.valid, 0)):
        src = t.narrow(dim, 0, B).repeat_interleave(n, dim)
        t.narrow(dim, 0, B * n).copy_(src)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: one captured decode step per batch-size bucket, replayed with static buffers.

_ENGINES = weakref.WeakKeyDictionary()  # model -> its GraphEngine, dropped with the model


def _graph_engine(model, rows, max_len, dtype):
    """The engine of this model, (re)built when it is too small or its weights moved."""
    eng = _ENGINES.get(model)
    if eng is None or not eng.fits(model, rows, max_len, dtype):
        if eng is not None:
            eng.graphs.clear()
        eng = GraphEngine(model, rows, max_len, dtype)
        _ENGINES[model] = eng
    return eng


class GraphEngine:
    def __init__(self, model, rows, max_len, dtype):
        dev = next(model.parameters()).device
        self.max_batch = 1 << max(rows - 1, 0).bit_length()  # largest bucket: a power of two
        self.max_len = -(-max_len // 128) * 128  # room for later, longer calls without re-capture
        self.dtype = dtype
        self.ptrs = [p.data_ptr() for p in model.parameters()]
        self.cache = KVCache(model.config, self.max_batch, self.max_len, device=dev, dtype=dtype)
        self.state = DecodeState(self.max_batch, self.max_len, dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = {}

    def fits(self, model, rows, max_len, dtype):
        return (rows <= self.max_batch and max_len <= self.max_len and dtype == self.dtype
                and self.ptrs == [p.data_ptr() for p in model.parameters()])

    def bucket(self, rows):
        return 1 << max(rows - 1, 0).bit_length()

    def graph(self, model, bucket, eos, pad_token_id, sampling, generator):
        """The captured decode step for this bucket and sampling setting (captured on first use)."""
        key = (bucket, tuple(sampling.items()), tuple(eos), pad_token_id, id(generator))
        if key not in self.graphs:
            # the graph reads the EOS ids from this tensor's address on every replay: keep it alive
            eos_static = torch.tensor(eos, dtype=torch.long, device=self.cache.k.device)
            self.graphs[key] = (self._capture(model, bucket, eos_static, pad_token_id, sampling, generator),
                                eos_static)
        return self.graphs[key][0]

    def _capture(self, model, bucket, eos_ids, pad_token_id, sampling, generator):
        cache, state = self.cache.view(rows=bucket), self.state.rows(bucket)
        for t in (state.slot, state.col, state.positions, state.done):
            t.zero_()  # warm-up writes at slot/column 0..1; generate() re-initialises all of it after
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up (cuBLAS handles, allocator) off the capture stream
            for _ in range(2):
                decode_step(model, cache, state, eos_ids, pad_token_id, sampling, generator)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool):
            decode_step(model, cache, state, eos_ids, pad_token_id, sampling, generator)
        return graph
