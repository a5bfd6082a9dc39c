"""LoRA: the reference is the base weights, the policy is what the adapters add.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685)
freezes a pretrained matrix W [d_out, d_in] and trains a low-rank update beside it:

    y = W x + b + (alpha / r) · B A x        A [r, d_in], B [d_out, r], r << min(d_in, d_out)

B starts at 0, so the adapted model *is* the base model at step 0: π = π_ref exactly and the KL is
0. A starts small and random so that B's first gradient, (alpha/r)·Σ (∂L/∂y)(A x)ᵀ, is not 0.
Here A ~ Kaiming-uniform(a = √5) = U(±1/√d_in), nn.Linear's own default, which is what PEFT's
default (`init_lora_weights=True`) and the paper's code (microsoft/LoRA, loralib) draw; the
paper's text says "random Gaussian" (PEFT's `"gaussian"` option). Either works: A's scale sets
the size of the features A x that B learns from, so how fast π first leaves π_ref. The scale
alpha/r keeps the update's size roughly independent of r, so alpha need not be retuned when r
changes. (rsLoRA, Kalajdzievic 2023, uses alpha/√r; not here.)

Why the reference is free. For KL-regularized PPO this is the cleanest statement of what the
reference is: π_ref uses W, π uses W + (alpha/r)·B·A, and KL(π‖π_ref) measures only what the
adapters add. So no second model is needed: verl's ref worker, under LoRA, runs the actor inside
PEFT's `disable_adapter()` (verl/workers/fsdp_workers.py, `compute_ref_log_prob`). Here that is
`adapters_off`: each `LoRALinear` then *skips* its branch and returns base_layer(x), the very call
the base model makes, so the reference log-probs equal the base model's bit for bit. Multiplying
the branch by 0 would also give W x in value, but would still pay for it, and 0 · inf is NaN.

Merging, for the rollout and the export. A sampler wants one plain matrix per layer:

    W' = W + (alpha / r) · B A                                   (`merged_state_dict`)

W' x and W x + s·B(A x) are the same number summed in another order: equal to rounding in fp32.
In bf16 the merged W' is rounded to W's grid, and a ΔW entry below half an ulp of W is lost: early
in training a bf16 merged copy samples from a policy nearer the base than the one being trained.

Memory. The optimizer holds state only for A and B: per adapted matrix r·(d_in + d_out)
parameters (Adam: 2·r·(d_in + d_out) moments) instead of d_in·d_out. For the Qwen2.5-0.5B shape,
every projection at r = 8 trains 4.40M parameters against the projections' 358M (1.2%); the
frozen weights need no gradient and no moments, and the reference needs no copy of its own.

Which matrices. verl's keys (actor_rollout_ref.model.*) go to PEFT's LoraConfig: `lora_rank` (r),
`lora_alpha`, `target_modules` and `exclude_modules`. A list entry names a module whose dotted name
equals it or ends with "." + it ("q_proj" is every layer's q_proj); another string is a regular
expression the whole name must match; "all-linear" is every nn.Linear but the output head
(lm_head, or a critic's `score`), as PEFT does. Only nn.Linear is adapted here. Unlike PEFT, every
list entry must match some nn.Linear, in target_modules and in exclude_modules: a typo is a
ValueError naming it, not a silently different set of matrices.

An adapted model's own state dict names W `<module>.base_layer.weight`, as PEFT does;
`merged_state_dict` gives the plain names back. A checkpoint needs only A and B
(`adapter_state_dict`), plus r and alpha from the config: the base comes from the base checkpoint.

How the trainer uses it (nanokl/harness/lora_run.py; actor_rollout_ref.model.lora_rank > 0). The
actor gets adapters after it loads; the optimizer holds A and B alone; `run.ref` is `AdaptersOff`,
the actor itself run with its adapters skipped (no reference copy), and the reference check
(harness/ref_check.py) checksums the frozen base weights. A checkpoint's actor/ holds the merged
export (what transformers and generate.py load) and actor/lora_adapters.safetensors (A and B, with
r, alpha and the targets in lora_adapters.json); a resume loads the base from model.path, adds the
adapters and loads them. A rollout copy (CUDA) receives the merged weights.

tests/test_lora.py checks, in float64, the gradients of A and B against a dense W + s·B·A path;
the bit-for-bit reference under `adapters_off` and at B = 0; the merged weights loaded into a
plain model; `targets`; the parameter count's closed form; and the adapter state's round trip.
"""

import math
import re
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

HEAD_NAMES = ("lm_head", "score")  # the output heads "all-linear" leaves alone


class LoRALinear(nn.Module):
    """base_layer(x) + (alpha/r) · B A dropout(x), the base frozen; `enabled = False` skips the
    branch. The base nn.Linear is kept as is (same module, same Parameters) as `base_layer`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {rank}")
        self.base_layer = base.requires_grad_(False)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **like))  # π = π_ref at 0
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)  # U(±1/√d_in)
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x):
        y = self.base_layer(x)
        if not self.enabled:
            return y  # the reference: the branch is not run at all
        return y + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scale

    def delta_weight(self):
        """(alpha/r) · B A, [d_out, d_in]: what merging adds to W."""
        return self.scale * (self.lora_B @ self.lora_A)

    def extra_repr(self):
        return f"rank={self.lora_A.shape[0]}, scale={self.scale:g}, enabled={self.enabled}"


def _matches(name: str, entry: str, regex: bool) -> bool:
    if regex:
        return re.fullmatch(entry, name) is not None
    return name == entry or name.endswith("." + entry)


def _select(linear: list, spec, what: str) -> set:
    """The names in `linear` that `spec` (a list of names, or one regular expression) picks."""
    if isinstance(spec, str):
        hit = {n for n in linear if _matches(n, spec, regex=True)}
        if not hit:
            raise ValueError(f"{what} {spec!r} matches no nn.Linear module of the model")
        return hit
    hit = set()
    for entry in spec:
        found = {n for n in linear if _matches(n, entry, regex=False)}
        if not found:
            raise ValueError(f"{what} entry {entry!r} matches no nn.Linear module of the model")
        hit |= found
    return hit


def targets(model: nn.Module, target_modules="all-linear", exclude_modules=None) -> list:
    """Dotted names of the nn.Linear modules to adapt, in the model's order (see the docstring's
    "Which matrices"). Raises ValueError naming an entry that matches nothing."""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if target_modules == "all-linear":
        chosen = {n for n in linear if n not in HEAD_NAMES}
    else:
        chosen = _select(linear, target_modules, "target_modules")
    if exclude_modules:
        chosen -= _select(linear, exclude_modules, "exclude_modules")
    if not chosen:
        raise ValueError("target_modules minus exclude_modules leaves no module to adapt")
    return [n for n in linear if n in chosen]


def add_adapters(model: nn.Module, rank: int, alpha: float, target_modules="all-linear",
                 exclude_modules=None, dropout: float = 0.0, generator: torch.Generator = None):
    """Replace each target nn.Linear of `model` by a LoRALinear around it, in place, and freeze
    every other parameter (only lora_A and lora_B train, as in verl/PEFT). Returns the adapted
    names, in the model's order."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters")
    names = targets(model, target_modules, exclude_modules)
    owners = {}  # how many modules hold each weight: a tied weight cannot take one module's ΔW
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    for name in names:
        if owners[id(model.get_submodule(name).weight)] > 1:
            raise ValueError(f"cannot adapt {name}: its weight is tied to another module's")
    model.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, LoRALinear(getattr(holder, child), rank, alpha, dropout, generator))
    return names


def adapters(model: nn.Module) -> dict:
    """{module name: LoRALinear} of the model, in order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextmanager
def adapters_off(model: nn.Module):
    """Every adapter skipped inside the block (the reference forward); each one's previous state
    restored after, also on an exception."""
    mods = list(adapters(model).values())
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, on in zip(mods, before):
            m.enabled = on


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict:
    """The plain model's state dict (base names, no lora_ keys) with W + (alpha/r)·B A folded into
    every adapted weight: what a rollout copy or a `transformers` export loads. Folded in
    float32 (or wider) and stored in W's dtype. The adapters count whether enabled or not."""
    mods = adapters(model)
    out = {}
    for key, value in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        if module.endswith(".base_layer") or module == "base_layer":
            owner = module[: -len("base_layer")].rstrip(".")
            if leaf == "weight":
                wide = torch.promote_types(value.dtype, torch.float32)
                delta = mods[owner].delta_weight().to(wide)
                value = (value.to(wide) + delta).to(value.dtype)
            key = f"{owner}.{leaf}" if owner else leaf
        out[key] = value
    return out


def adapter_state_dict(model: nn.Module) -> dict:
    """Only the adapters: {"<module>.lora_A": A, "<module>.lora_B": B} (tensors shared with the
    model, as `state_dict` shares them)."""
    out = {}
    for name, m in adapters(model).items():
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = m.lora_A.detach(), m.lora_B.detach()
    return out


@torch.no_grad()
def load_adapter_state_dict(model: nn.Module, state: dict):
    """Copy A and B from `state` (as adapter_state_dict wrote it) into the model's adapters. The
    keys must be exactly the model's and the shapes equal; otherwise a ValueError naming them."""
    mine = adapter_state_dict(model)
    missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or extra:
        raise ValueError(f"adapter state does not fit the model: missing {missing[:3]}"
                         f"{' ...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                         f"{' ...' if len(extra) > 3 else ''}")
    for key, t in mine.items():
        if state[key].shape != t.shape:
            raise ValueError(f"adapter {key}: shape {tuple(state[key].shape)}, the model has "
                             f"{tuple(t.shape)} (another lora_rank?)")
        t.copy_(state[key])
    return model


def trainable_parameters(model: nn.Module) -> int:
    """How many parameters the optimizer holds (requires_grad), each shared one once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class AdaptersOff(nn.Module):
    """The reference under LoRA: the adapted `model` run with every adapter skipped. The model is
    held, not registered: this module's parameters are the base ones (`base_parameters`), so that
    the reference's checksum reads the frozen base and no adapter."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", model)  # not a submodule: .eval() / .to() leave it be

    def forward(self, *args, **kwargs):
        with adapters_off(self.policy):
            return self.policy(*args, **kwargs)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        return base_parameters(self.policy, prefix)

    def parameters(self, recurse=True):
        return (p for _, p in self.named_parameters())


def base_parameters(model: nn.Module, prefix=""):
    """(name, parameter) of every parameter but the adapters' A and B: the frozen base."""
    for name, p in model.named_parameters(prefix):
        if name.rpartition(".")[2] not in ("lora_A", "lora_B"):
            yield name, p


@torch.no_grad()
def reset_adapters(model: nn.Module):
    """B = 0 in every adapter: the adapted model is the base model again (π = π_ref)."""
    for m in adapters(model).values():
        m.lora_B.zero_()
