"""The training loops read nothing from the GPU inside a micro-batch loop (skipped without a GPU;
bench/gpu_check.sh runs it on a lent one).

Every pass of a step (old log-probs, reference, values, the actor and critic updates) runs with
`torch.cuda.set_sync_debug_mode("error")`: any operation that makes the host wait for the device
(`.item()`, `bool(t)`, `.tolist()`, `nonzero`, a boolean-mask index, a blocking copy) raises. The
reads the loops are designed to make are let through and counted: the attention mask once per pass
(`batching.host_mask`) and one read per mini-batch (`workers._step`, where the optimizer step must
know whether the gradient is finite). Packed micro-batches under a token budget and the chunked LM
head, the GPU config's settings. On CPU, tests/test_update_ops.py proves the same on the meta device.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from nanokl import forwards
from nanokl import workers as W
from nanokl.engine.batching import Batching
from nanokl.engine.model import ValueModel

from test_workers import VANILLA, rollout_batch, tiny

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@contextlib.contextmanager
def sync_mode(mode):
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def allowed(fn, calls):
    """fn, run with syncs allowed and counted: a read the loop makes on purpose."""
    def wrapper(*args, **kwargs):
        calls.append(fn.__name__)
        with sync_mode(0):
            return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("spec", [Batching(token_budget=40, packed=True, chunk=8), Batching(micro_size=2)])
def test_no_sync_inside_the_micro_batch_loops(monkeypatch, spec):
    cpu_actor = tiny().eval()
    batch, _ = rollout_batch(cpu_actor, B=8)
    batch = {k: v.cuda() for k, v in batch.items()}
    actor, critic, ref = tiny().cuda(), tiny(ValueModel, seed=1).cuda(), tiny().cuda().eval()
    calls = []
    for module in (forwards, W):  # the forwards' loop reads it, and the updates'
        monkeypatch.setattr(module, "host_mask", allowed(module.host_mask, calls))
    monkeypatch.setattr(W, "_step", allowed(W._step, calls))
    g = torch.Generator(device="cuda").manual_seed(0)
    mask = batch["response_mask"]
    a = SimpleNamespace(loss_mode="ppo", policy_loss=VANILLA, loss_agg_mode="token-mean", clip_ratio_low=0.2,
                        clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=True,
                        kl_loss_type="low_var_kl", ppo_epochs=1, shuffle=True, grad_clip=1.0)
    c = SimpleNamespace(loss_agg_mode="token-mean", cliprange_value=0.5, ppo_epochs=1, shuffle=False, grad_clip=1.0)
    with sync_mode("error"):
        batch["old_log_probs"], _ = forwards.compute_log_probs(actor, batch, 1.0, spec, with_entropy=True)
        batch["ref_log_probs"], _ = forwards.compute_log_probs(ref, batch, 1.0, spec)
        batch["values"] = forwards.compute_values(critic, batch, Batching(**{**vars(spec), "chunk": None}))
        batch["advantages"] = torch.randn(mask.shape, device="cuda", generator=g)
        batch["returns"] = batch["values"] + batch["advantages"]
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-3)
        W.update_actor(actor, opt, batch, a, 1.0, mini_size=4, spec=spec, horizon=mask.shape[1], kl_loss_coef=0.1,
                       record_entropy=True, generator=torch.Generator().manual_seed(0))
        W.update_critic(critic, torch.optim.AdamW(critic.parameters(), lr=1e-3), batch, c, mini_size=4,
                        spec=Batching(**{**vars(spec), "chunk": None}), horizon=mask.shape[1])
    # one mask read per pass (5), one read per mini-batch (2 mini-batches of 4 in each update)
    assert calls.count("host_mask") == 5 and calls.count("_step") == 4, calls

