"""Rollout: sample responses from the policy on a static KV cache (the RLHF hot path).

The idea
--------
Most of a PPO step's time goes into generating responses: one forward per new token, with
nothing to batch across time. The recipe that makes it fast is small (gpt-fast, nano-vllm):

1. Prefill once. The left-padded prompts [B, P] run through the model in one forward that writes
   every layer's keys/values into a preallocated `KVCache` (nanokl/engine/model.py), slots 0..P-1.
   With `n` samples per prompt the prefill still runs on B rows; the prompt slots of the cache
   rows are then repeated n times, so the prompt is never recomputed.
2. Decode with fixed shapes. Each step (`decode_step`) feeds one token per row at cache slot P+t,
   reads the logits of that one position, samples and records: tensors whose shapes and storage
   never change between steps. Run eagerly, as here, a step attends over the P+t filled slots only.
3. Sample without a host sync. Drawing E_i ~ Exp(1) and taking argmax_i p_i / E_i picks token i
   with probability p_i (E_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is
   the i-th with probability p_i / sum p), so sampling is elementwise ops plus an argmax that stay
   on the device. E_i is drawn as -log U_i with U_i ~ Uniform[0, 1), and argmax p_i / E_i is
   computed as argmax log(U_i) / p_i (the same order, one negation fewer; a filtered p_i = 0
   gives -inf and is never drawn): on the CPU uniform_ + log is 2-3x faster than exponential_,
   which was ~10% of a small model's rollout. The host only checks "has every row finished?"
   (every step on CPU, where it is free, every 16 steps on CUDA, where it is a sync).

Which log-probability is returned. `log_probs[b, t]` is log softmax(logits / temperature) of the
chosen token: the temperature-scaled distribution *before* top-k / top-p filtering. That is what
the training forward recomputes (`logprobs_from_logits(logits / temperature)`, nanokl/forwards.py),
as in verl, so the two agree to float error and `rollout/log_prob_max_diff` measures only numerics.
Filtering changes which tokens can be drawn, not the recorded log-prob; with top-k/top-p the sampler
is thus slightly off-policy, a known and accepted trade. Greedy decoding (do_sample=False or
temperature=0) records log softmax(logits) at temperature 1.

Layout of the result: `sequences = [prompt (left-padded, P) | response (R)]`, where R is the number
of decode steps actually run (at most `max_new_tokens`; generation stops when every row has
emitted an EOS). `response_mask` is 1 up to and including the first EOS; later tokens are pad.
`attention_mask` and `position_ids` cover the whole sequence, ready for the training forward.

One entry: `generate`. Every caller samples through it (PPO's rollout, validation, generate.py,
the SFT / reward-model / DPO helpers, the benchmarks). On the CPU it is the eager loop above. On
CUDA (`use_cuda_graph`, by default on a device that has graphs) the same prefill, loop and trim run
on the buffers of the model's graph engine (nanokl/engine/graphs.py, an appendix: launches, not
ideas): rollout hands the engine its `DecodeState` class to allocate once and a `decode_step` over
those buffers to capture per (bucket, slot span, setting); each step is then one replay. The engine
draws from its own generator, so the caller's state is copied in before the prefill and back after
the last step: a seed picks the same tokens as eager decoding when the batch fills its bucket.

Tests: tests/test_rollout.py (greedy equals argmax over full forwards without cache; returned
log-probs equal a training forward; top-k/top-p never sample outside the allowed set; seeded
sampling frequencies pass a chi-square test; EOS and masks); the graph path against the eager one,
tests/test_rollout_graphs.py (a recording stand-in for CUDA graphs, on CPU) and
tests/test_rollout_cuda.py (on a GPU).
"""

from dataclasses import dataclass

import torch

from nanokl.engine import graphs
from nanokl.engine.model import KVCache


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
    """One token for every row: forward at `state.slot`, sample, record. Fixed shapes throughout
    (what a CUDA graph can capture, nanokl/engine/graphs.py)."""
    logits = model(state.tokens, position_ids=state.positions, cache=cache,
                   cache_positions=state.slot)
    token, logp = sample_tokens(logits[:, -1], **sampling, generator=generator)
    record(state, token, logp, eos_ids, pad_token_id)
    state.positions += 1
    state.slot += 1


def generate(model, input_ids, attention_mask, max_new_tokens, temperature=1.0, top_k=-1, top_p=1.0,
             do_sample=True, eos_token_id=None, pad_token_id=0, generator=None, use_cuda_graph=None,
             n=1) -> RolloutOutput:
    """Sample `n` responses per left-padded prompt; see the module docstring for the layout. Each
    decode step is a CUDA-graph replay when `use_cuda_graph` (default: on a device that has
    graphs, not on the CPU), else an eager step."""
    graphed = graphs.on_graph_device(input_ids.device) and (use_cuda_graph is None
                                                            or bool(use_cuda_graph))
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, do_sample=do_sample)
    with torch.inference_mode():
        out = (_generate_graphed if graphed else _generate)(model, input_ids, attention_mask,
                                                            max_new_tokens, sampling,
                                                            eos_list(eos_token_id), pad_token_id,
                                                            generator, n)
    return cloned(out)


def _generate(model, input_ids, attention_mask, R, sampling, eos, pad_token_id, generator,
              n) -> RolloutOutput:
    dev = input_ids.device
    B, P = input_ids.shape
    eos_ids = torch.tensor(eos, dtype=torch.long, device=dev)
    cache = KVCache(model.config, B * n, P + R, device=dev, dtype=next(model.parameters()).dtype)
    state = DecodeState(B * n, max(R, 1), dev)
    prompt = prefill(model, cache, cache.view(rows=B), state, input_ids, attention_mask, n, R,
                     eos_ids, pad_token_id, sampling, generator)
    # each step attends over the P + t filled slots only (a graph must keep the full cache)
    steps = decode(state, R, lambda t: decode_step(model, cache.view(slots=P + t), state, eos_ids,
                                                   pad_token_id, sampling, generator))
    return trim(state, steps, eos_ids, *prompt)


def _generate_graphed(model, input_ids, attention_mask, R, sampling, eos, pad_token_id, generator,
                      n) -> RolloutOutput:
    """_generate on the model's graph engine: its cache and DecodeState, each decode step a
    replay."""
    dev = input_ids.device
    B, P = input_ids.shape
    eos_ids = torch.tensor(eos, dtype=torch.long, device=dev)
    engine = graphs.engine_for(model, B * n, P + R)
    cache, state = engine.cache, engine.static(DecodeState).rows(B * n)
    bucket = engine.bucket(B * n)
    # capture (first use only) every slot span this call will reach, before the prefill: the
    # warm-up runs scribble on the cache and the state
    replays = {S: engine.graph((bucket, S, tuple(sampling.items()), tuple(eos), pad_token_id),
                               lambda S=S: _static_step(model, engine, bucket, S, eos,
                                                        pad_token_id, sampling))
               for S in sorted({engine.span(P + t) for t in range(1, R)})}
    caller_gen = generator if generator is not None else _default_generator(dev)
    # the generator the graphs draw from takes over the caller's state
    engine.gen.set_state(caller_gen.get_state())
    # the prompt needs only its own slots
    prompt = prefill(model, cache, cache.view(rows=B, slots=P), state, input_ids, attention_mask,
                     n, R, eos_ids, pad_token_id, sampling, engine.gen)
    # each step attends over the span that holds the P + t filled slots
    steps = decode(state, R, lambda t: replays[engine.span(P + t)].replay())
    # the caller's generator advances as if it had drawn
    caller_gen.set_state(engine.gen.get_state())
    return trim(state, steps, eos_ids, *prompt)


def _static_step(model, engine, bucket, span, eos, pad_token_id, sampling):
    """The decode step a graph captures: over `bucket` rows and `span` slots of the engine's
    buffers, drawing from its generator, with the EOS ids in a tensor the graph keeps (it reads that
    address)."""
    cache, state = (engine.cache.view(rows=bucket, slots=span),
                    engine.static(DecodeState).rows(bucket))
    for t in (state.slot, state.col, state.positions, state.done):
        # the warm-up runs write at slot/column 0..1; prefill re-initialises all of it after
        t.zero_()
    eos_ids = torch.tensor(eos, dtype=torch.long, device=cache.k.device)
    return lambda: decode_step(model, cache, state, eos_ids, pad_token_id, sampling, engine.gen)


def _default_generator(dev):
    """The generator eager decoding draws from when given none."""
    if dev.type == "cuda":
        return torch.cuda.default_generators[dev.index if dev.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator


def prefill(model, cache, prompt_cache, state, input_ids, attention_mask, n, R, eos_ids,
            pad_token_id, sampling, generator):
    """1. Run the B prompts once, through `prompt_cache` (a view of the cache's first B rows);
    repeat their rows n times; sample and record the first response token (when R > 0). Returns the
    prompts' ids, mask and positions, n times each."""
    dev = input_ids.device
    B, P = input_ids.shape
    cache.reset()
    state.done.zero_()
    mask = attention_mask.bool()
    prompt_pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids, mask, prompt_pos, cache=prompt_cache,
                   cache_positions=torch.arange(P, device=dev), logits_to_keep=1)[:, -1]
    if n > 1:
        _repeat_rows(cache, B, n, P)
        logits = logits.repeat_interleave(n, 0)
        input_ids, mask, prompt_pos = (t.repeat_interleave(n, 0)
                                       for t in (input_ids, mask, prompt_pos))
    if R > 0:
        state.col.zero_()
        token, logp = sample_tokens(logits, **sampling, generator=generator)
        record(state, token, logp, eos_ids, pad_token_id)
        state.positions.copy_(mask.sum(-1, keepdim=True))  # the first response token's position
        state.slot.fill_(P)
    return input_ids, mask, prompt_pos


def decode(state, R, step):
    """2. `step(t)` for t = 1, 2, ... until R columns, or until every row has emitted an EOS.
    Returns the number of columns sampled (the prefill sampled the first; none when R = 0)."""
    steps = min(R, 1)
    check_every = 16 if state.done.device.type == "cuda" else 1
    while steps < R:
        if steps % check_every == 0 and bool(state.done.all()):
            break
        step(steps)
        steps += 1
    return steps


def trim(state, steps, eos_ids, input_ids, mask, prompt_pos) -> RolloutOutput:
    """3. Keep the columns that have a real token somewhere, and build the training inputs."""
    dev = input_ids.device
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
        prompt_length=input_ids.shape[1],
    )


def eos_list(eos_token_id):
    """None, one id or several, as a list."""
    return [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int)
                                            else list(eos_token_id))


def cloned(out):
    """Cloned outside inference mode: ordinary tensors that a training forward may use under
    autograd."""
    return RolloutOutput(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in vars(out).items()})


def _repeat_rows(cache, B, n, P):
    """Rows 0..B-1 become rows 0..B*n-1, each repeated n times in place (prompt shared n ways).
    Only the P prompt slots hold anything yet: the later slots are not copied."""
    for t, dim, slot_dim in ((cache.k, 1, 3), (cache.v, 1, 3), (cache.valid, 0, 1)):
        src = t.narrow(dim, 0, B).narrow(slot_dim, 0, P).repeat_interleave(n, dim)
        t.narrow(dim, 0, B * n).narrow(slot_dim, 0, P).copy_(src)
