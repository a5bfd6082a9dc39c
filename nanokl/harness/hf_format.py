"""The Hugging Face checkpoint format, and nanokl's models in and out of it.

A model directory written by `transformers` holds `config.json` (the architecture as JSON) and the
weights as `model.safetensors`, or as shards listed in `model.safetensors.index.json`. Safetensors
is a flat name -> tensor table with a JSON header: loading it runs no code, unlike a pickle, which
is why it is the only weight format nanokl reads (`torch.load` is used only with
`weights_only=True`, for optimizer state).

Two details of the format trip readers up, and both are handled here:
- `rope_theta` sits at the top level of older files and inside `rope_parameters` in files written
  by transformers 5 (`rope_scaling` moved there too).
- `transformers` drops a config field whose value equals the base-class default when it writes
  with `use_diff`, and that default for `tie_word_embeddings` is True: a missing field means tied.
  With tied embeddings the file has no `lm_head.weight` (safetensors cannot store one tensor twice).

`from_pretrained` (policy, reference), `load_value_model` (critic) and `save_pretrained` turn a
directory into nanokl's modules (nanokl/engine/model.py) and back: the module is built on the meta
device, so no memory is spent on random weights that the loaded tensors replace. A bad directory
raises `CheckpointError` naming the missing file, the unsupported architecture, or the tensor
whose name or shape is wrong. tests/test_model.py checks
both directions against `transformers` itself.
"""

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanokl.harness.config.yaml_io import UserError
from nanokl.engine.model import CausalLM, ModelConfig, RewardModel, ValueModel, rope_inv_freq

# architecture name in config.json -> (model_type, head): "lm" a causal LM, "value" a scalar head
# at every position (the critic), "reward" a bias-free scalar head at the last token (reward model)
ARCHITECTURES = {
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForTokenClassification": ("qwen2", "value"),
    "LlamaForTokenClassification": ("llama", "value"),
    "Qwen2ForSequenceClassification": ("qwen2", "reward"),
    "LlamaForSequenceClassification": ("llama", "reward"),
}
HEAD_ARCH = {"lm": "ForCausalLM", "value": "ForTokenClassification", "reward": "ForSequenceClassification"}
TYPE_PREFIX = {"qwen2": "Qwen2", "llama": "Llama"}


class CheckpointError(UserError):
    """A model directory that nanokl cannot load, with the reason in one line."""


def read_config(path, overrides=None) -> tuple[dict, str]:
    """config.json -> (ModelConfig keyword arguments, head kind "lm" | "value" | "reward"). `overrides`
    (verl's model.override_config, checked by verl_keys) replace config.json's entries; a mapping is
    merged into the entry's own (rope_scaling: {factor: 4.0} keeps its other keys)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e.msg}, line {e.lineno})") from None
    except (ValueError, RecursionError) as e:  # not UTF-8 text; nested thousands deep
        raise CheckpointError(f"{cfg_file}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(hf).__name__}")
    for k, v in (overrides or {}).items():
        hf[k] = {**hf[k], **v} if isinstance(v, dict) and isinstance(hf.get(k), dict) else v
    try:
        kw, head = _config_kwargs(hf, cfg_file)
        rope_inv_freq(ModelConfig(**kw))  # ModelConfig's checks and the RoPE variant's, here where the file is known
    except (TypeError, ValueError, LookupError, AttributeError, ZeroDivisionError, OverflowError) as e:
        # a field of the wrong type or an impossible value (4 heads over 3 key/value heads, rope_type "dgfault")
        raise CheckpointError(f"{cfg_file}: bad model configuration ({type(e).__name__}: {e})") from None
    return kw, head


def _config_kwargs(hf: dict, cfg_file) -> tuple[dict, str]:
    """config.json's fields -> (ModelConfig keyword arguments, head kind)."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    head = "lm"
    if archs:
        if archs[0] not in ARCHITECTURES:
            raise CheckpointError(
                f"{cfg_file}: unsupported architecture {archs[0]!r}; nanokl loads {', '.join(ARCHITECTURES)}")
        model_type, head = ARCHITECTURES[archs[0]]
    if model_type not in TYPE_PREFIX:
        raise CheckpointError(f"{cfg_file}: unsupported model_type {model_type!r}; nanokl loads qwen2 and llama")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{cfg_file}: use_sliding_window=true is not supported")
    rope = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    try:
        kw = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
        )
    except KeyError as e:
        raise CheckpointError(f"{cfg_file}: missing field {e.args[0]!r}") from None
    kw.update(
        num_key_value_heads=hf.get("num_key_value_heads", kw["num_attention_heads"]),
        head_dim=hf.get("head_dim"),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        initializer_range=hf.get("initializer_range", 0.02),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )
    return kw, head


def hf_config(cfg, head: str, dtype: torch.dtype) -> dict:
    """ModelConfig -> the config.json that transformers reads (both rope_theta spellings)."""
    arch = TYPE_PREFIX[cfg.model_type] + HEAD_ARCH[head]
    out = {
        "architectures": [arch],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})},
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if cfg.model_type == "llama":
        out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers)
    if head in ("value", "reward"):
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out


def load_tensors(path, device="cpu") -> dict[str, torch.Tensor]:
    """All tensors of a model directory, from one safetensors file or an index of shards."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, LookupError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{index}: not a readable safetensors index ({type(e).__name__})") from None
    else:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(f, device=str(device)))
        except (SafetensorError, OSError) as e:  # a truncated file, a bit flip in its header, a missing shard
            raise CheckpointError(f"{f}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    return tensors


def check_tensors(expected: dict, tensors: dict, path, ignore=()) -> dict:
    """Keep the tensors the module expects; name the first missing or misshapen one."""
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}")
    extra = [n for n in tensors if n not in expected and not n.endswith(".rotary_emb.inv_freq") and n not in ignore]
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} in all); wrong architecture?")
    return {n: tensors[n] for n in expected}


def save_tensors(state_dict: dict, path, dtype=None):
    """Write model.safetensors atomically (temp file + rename): a crash leaves no half file. Its mode is
    an ordinary new file's, 0o666 less the umask, as config.json's beside it (file_mode)."""
    path = Path(path)
    out = {}
    for name, t in state_dict.items():
        t = t.detach()
        out[name] = (t.to(dtype) if dtype is not None else t).cpu().contiguous()
    tmp = path / "model.safetensors.tmp"
    save_file(out, tmp, metadata={"format": "pt"})
    os.chmod(tmp, file_mode())
    os.replace(tmp, path / "model.safetensors")


def file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the process's umask. safetensors >= 0.8 writes through
    a temporary file that its Rust `tempfile` crate creates 0o600 whatever the umask, then renames it
    into place (safetensors issue #782): weights another user could not read, beside a readable
    config.json ("not a readable safetensors file" from their generate.py)."""
    try:
        with open("/proc/self/status") as f:  # Linux >= 4.7 shows the umask without changing it
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere reading it means setting it: put it back at once
    os.umask(mask)
    return 0o666 & ~mask


# ---------------------------------------------------------------------------------------------
# nanokl modules from and to a directory


def build_model(cls, cfg, tensors, path, ignore, device, dtype):
    """Build on the meta device (no memory), then adopt the loaded tensors as parameters."""
    with torch.device("meta"):
        model = cls(cfg)
    expected = {n: p.shape for n, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        ignore = (*ignore, "lm_head.weight")
    sd = check_tensors(expected, tensors, path, ignore)
    model.load_state_dict({n: t.to(dtype) for n, t in sd.items()}, strict=False, assign=True)
    if isinstance(model, CausalLM) and cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.inv_freq = rope_inv_freq(cfg).to(device)  # a buffer, not in the file
    return model.to(device)


def from_pretrained(path, device=None, dtype=None, overrides=None) -> CausalLM:
    """Load a Qwen2/Llama causal LM from a Hugging Face directory (fp32 unless `dtype` says); `overrides`
    replace config.json's entries (read_config)."""
    kw, _ = read_config(path, overrides)
    cfg = ModelConfig(**kw)
    device = torch.device(device or "cpu")
    tensors = load_tensors(path, device)
    return build_model(CausalLM, cfg, tensors, path, ("score.weight", "score.bias"), device, dtype or torch.float32)


def load_scalar_head(cls, path, device=None, dtype=None, bias=True, seed=0, overrides=None):
    """A model with a scalar `score` head (critic, reward model): from its own directory, or from a
    causal LM whose LM head is swapped for a fresh normal(0, initializer_range) row (and a zero
    bias if `cls` has one), as verl's critic gets it from `transformers`. The fresh row is drawn
    on the CPU from its own generator seeded with `seed`: the same head whatever drew from torch's
    global generator before (an SFT trained in the same process, say), on any device."""
    kw, head = read_config(path, overrides)
    cfg = ModelConfig(**kw)
    device = torch.device(device or "cpu")
    tensors = load_tensors(path, device)
    if head == "lm":
        tensors.pop("lm_head.weight", None)
        gen = torch.Generator().manual_seed(seed)
        tensors["score.weight"] = (torch.randn(1, cfg.hidden_size, generator=gen) * cfg.initializer_range).to(device)
        if bias:
            tensors["score.bias"] = torch.zeros(1, device=device)
    return build_model(cls, cfg, tensors, path, (), device, dtype or torch.float32)


def load_value_model(path, device=None, dtype=None, seed=0, overrides=None) -> ValueModel:
    """The critic: a value-model directory, or a causal LM given a fresh value head (drawn with `seed`)."""
    return load_scalar_head(ValueModel, path, device, dtype, seed=seed, overrides=overrides)


def save_pretrained(model, path, dtype=None, state_dict=None):
    """Write config.json + model.safetensors that `transformers` loads as Qwen2/Llama
    For{CausalLM,TokenClassification}. `state_dict` overrides the module's (e.g. gathered from
    FSDP shards); `dtype` casts on the way out."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sd = dict(state_dict if state_dict is not None else model.state_dict())
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # safetensors stores a shared tensor once; HF re-ties on load
    head = getattr(model, "hf_head", "lm")  # "lm" | "value" | "reward" (engine/model.py: RewardModel)
    out_dtype = dtype or next(iter(sd.values())).dtype
    (path / "config.json").write_text(json.dumps(hf_config(cfg, head, out_dtype), indent=2))
    save_tensors(sd, path, dtype)


def require_model_dir(path, key="actor_rollout_ref.model.path") -> None:
    """A one-line UserError when the model directory `path` (set by `key`) does not exist."""
    if not Path(path).is_dir():
        raise UserError(f"model directory {str(Path(path))!r} does not exist ({key})")


NORM_FILE = "reward_normalization.json"  # a reward model's (r - mean) / std, beside its weights


class TokenClassRewardModel(RewardModel):
    """A reward model saved as *ForTokenClassification with num_labels=1, the class verl loads its reward
    models with (AutoModelForTokenClassification, the score read at the last real token): RewardModel
    with transformers' token-classification head, a Linear(hidden, 1) with a bias. The reward is that
    head's output at the last real token, which is transformers' logits[:, last, 0]."""
    hf_head = "value"  # saved back as *ForTokenClassification

    def __init__(self, cfg):
        super().__init__(cfg)
        self.score = torch.nn.Linear(cfg.hidden_size, 1, bias=True)


def load_reward_model(path, device=None, dtype=None, seed=0) -> RewardModel:
    """A reward model directory, *ForSequenceClassification or *ForTokenClassification with num_labels=1
    (with its normalisation when reward_normalization.json is there), or a causal LM whose LM head is
    swapped for a fresh, bias-free `score` row (drawn with `seed`: how nanokl.supervised.reward_model
    starts one; a run refuses a causal LM as its reward model, harness/scoring.load_rm)."""
    kw, head = read_config(path)
    if head == "value":  # verl's reward model class: the score head must hold one label
        tensors = load_tensors(path, torch.device(device or "cpu"))
        w = tensors.get("score.weight")
        if w is None or w.dim() != 2 or w.shape[0] != 1:
            got = "no score.weight" if w is None else f"score.weight of shape {tuple(w.shape)}"
            raise CheckpointError(f"{path}: a ForTokenClassification model with {got}; a reward model has one "
                                  "label (num_labels=1, score.weight of shape (1, hidden_size))")
        cls = TokenClassRewardModel if "score.bias" in tensors else RewardModel
        rm = build_model(cls, ModelConfig(**kw), tensors, path, (), torch.device(device or "cpu"),
                         dtype or torch.float32)
    else:
        rm = load_scalar_head(RewardModel, path, device, dtype, bias=False, seed=seed)
    norm = Path(path) / NORM_FILE
    if head != "lm" and norm.is_file():
        stats = json.loads(norm.read_text())
        rm.reward_mean, rm.reward_std = float(stats["mean"]), float(stats["std"])
    return rm


def save_reward_model(rm, path, tokenizer=None, info=None):
    """HF weights + config.json (+ tokenizer) + reward_normalization.json {mean, std, **info}."""
    save_pretrained(rm, path)
    if tokenizer is not None:
        tokenizer.save(path)
    stats = {"mean": rm.reward_mean, "std": rm.reward_std, **(info or {})}
    (Path(path) / NORM_FILE).write_text(json.dumps(stats, indent=2))
