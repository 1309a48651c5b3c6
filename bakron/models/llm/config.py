"""The hyper-parameters of a Llama-family causal LM (Llama, SmolLM2, Qwen3) and the weight names.

Weights are named as in GGUF files (``token_embd.weight``, ``blk.{i}.attn_q.weight``, ...);
matrices are (out, in) like ``torch.nn.Linear``. :func:`weight_shapes` lists every tensor a
config needs, so both loaders check a file against it before anything is computed.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LlamaConfig", "UnsupportedModelError", "LINEAR_KINDS", "weight_shapes",
           "linear_names"]

#: The linear layers of one block, in forward order (attention, then the SwiGLU FFN).
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

ARCHITECTURES = ("llama", "qwen3")


class UnsupportedModelError(ValueError):
    """The model file holds an architecture, tensor type or tokenizer this loader does not
    implement."""


@dataclass(frozen=True)
class LlamaConfig:
    """Decoder-only transformer with RMSNorm, RoPE (HF "rotate_half"), GQA and SwiGLU.

    ``arch`` is ``"llama"`` (Llama 2/3, SmolLM2) or ``"qwen3"`` (adds a per-head RMSNorm of
    q and k before RoPE: ``qk_norm``). ``head_dim`` may differ from
    ``hidden_size / num_heads`` (Qwen3). ``max_positions`` is the context length.
    ``rope_scaling`` holds Llama 3's frequency stretch (``rope_type = "llama3"``) when the
    model uses it; a GGUF file stores the same stretch as one divisor per rotary frequency
    (``rope_freq_factors``, llama.cpp's ``rope_freqs`` tensor).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    qk_norm: bool
    max_positions: int
    bos_id: int | None = None
    eos_id: int | None = None
    rope_scaling: tuple | None = None   # sorted (key, value) pairs of HF's rope_scaling
    rope_freq_factors: tuple | None = None   # llama.cpp's rope_freqs: inv_freq_i / factor_i

    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` as the dict :func:`bakron.hessian.rope_inv_freq` takes."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {self.arch!r} is not supported (only "
                                        f"{', '.join(ARCHITECTURES)})")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_positions"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LlamaConfig.{f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError(f"LlamaConfig: rope_theta and rms_eps must be > 0, got "
                             f"{self.rope_theta!r} and {self.rms_eps!r}")
        if self.rope_freq_factors is not None and (
                len(self.rope_freq_factors) != self.head_dim // 2
                or not all(f > 0 for f in self.rope_freq_factors)):
            raise ValueError(f"LlamaConfig.rope_freq_factors must hold head_dim/2 = "
                             f"{self.head_dim // 2} positive numbers")
        if self.rope_scaling is not None and self.rope_freq_factors is not None:
            raise ValueError("LlamaConfig: give rope_scaling or rope_freq_factors, not both")
        if self.qk_norm != (self.arch == "qwen3"):
            raise ValueError(f"LlamaConfig: qk_norm={self.qk_norm} does not match arch "
                             f"{self.arch!r} (only qwen3 has the per-head q/k norm)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` of ``LlamaForCausalLM`` or
        ``Qwen3ForCausalLM`` (``tie_word_embeddings`` defaults to false, as there)."""
        archs = cfg.get("architectures") or []
        kind = archs[0] if archs else cfg.get("model_type", "?")
        if kind in ("LlamaForCausalLM", "llama"):
            arch = "llama"
        elif kind in ("Qwen3ForCausalLM", "qwen3"):
            arch = "qwen3"
        else:
            raise UnsupportedModelError(
                f"config.json describes {kind!r}; only LlamaForCausalLM and Qwen3ForCausalLM "
                f"are supported")
        # transformers >= 5 keeps theta and the scaling in "rope_parameters"; older configs
        # have "rope_theta" and "rope_scaling" at the top level
        params = cfg.get("rope_parameters") or None
        if params is not None and not isinstance(params, dict):
            raise UnsupportedModelError("config.json: rope_parameters is not one dict (per "
                                        "layer-type RoPE is not implemented)")
        rope_scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta", 10000.0)
        if params is not None:
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", params.get("type")) not in (None, "default"):
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind in (None, "default"):
                rope_scaling = None
            elif kind != "llama3":
                raise UnsupportedModelError(
                    f"config.json asks for RoPE scaling {rope_scaling!r}; only plain RoPE and "
                    f"Llama 3's 'llama3' scaling are implemented")
            else:
                rope_scaling = tuple(sorted((k, v) for k, v in rope_scaling.items()
                                            if isinstance(v, (int, float, str))))
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("config.json sets use_sliding_window=true; only full "
                                        "causal attention is implemented")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise UnsupportedModelError(f"config.json sets {key}=true; biases are not "
                                            f"implemented")
        try:
            d = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            tie = cfg.get("tie_word_embeddings", False)
            return cls(
                arch=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=d,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or d // heads),
                rope_theta=float(theta),
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(tie), qk_norm=(arch == "qwen3"),
                max_positions=int(cfg.get("max_position_embeddings", 2048)),
                bos_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
                eos_id=None if eos is None else int(eos), rope_scaling=rope_scaling)
        except KeyError as exc:
            raise ValueError(f"config.json has no {exc.args[0]!r}") from None

    def to_hf(self) -> dict:
        """The Hugging Face ``config.json`` of this model (``LlamaForCausalLM`` or
        ``Qwen3ForCausalLM``); :meth:`from_hf` reads it back to an equal config.

        RoPE is written both ways: ``rope_parameters`` (transformers >= 5) and the older
        top-level ``rope_theta`` / ``rope_scaling``. A model whose RoPE stretch is only known
        as llama.cpp's per-frequency divisors (``rope_freq_factors``) has no Hugging Face form
        here: ``UnsupportedModelError``.
        """
        if self.rope_freq_factors is not None:
            raise UnsupportedModelError(
                "the model's RoPE is stretched by llama.cpp's rope_freqs divisors; the "
                "Hugging Face rope_scaling parameters they came from cannot be recovered")
        scaling = self.rope_scaling_dict()
        params = {"rope_type": "default", "rope_theta": self.rope_theta}
        if scaling is not None:
            params = {**scaling, "rope_theta": self.rope_theta}
        llama = self.arch == "llama"
        out = {
            "architectures": ["LlamaForCausalLM" if llama else "Qwen3ForCausalLM"],
            "model_type": self.arch, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta,
            "rope_scaling": scaling, "rope_parameters": params,
            "tie_word_embeddings": self.tie_embeddings, "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id, "use_cache": True}
        if llama:
            out["mlp_bias"] = False
        else:
            out.update({"use_sliding_window": False, "sliding_window": None})
        return out


def linear_names(cfg: LlamaConfig) -> list[str]:
    """``blk.{i}.attn_q`` ... ``blk.{i}.ffn_down`` for every block, in forward order."""
    return [f"blk.{i}.{k}" for i in range(cfg.num_layers) for k in LINEAR_KINDS]


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, GGUF names, matrices (out, in)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": (d,), b + "attn_q.weight": (cfg.q_size, d),
            b + "attn_k.weight": (cfg.kv_size, d), b + "attn_v.weight": (cfg.kv_size, d),
            b + "attn_output.weight": (d, cfg.q_size), b + "ffn_norm.weight": (d,),
            b + "ffn_gate.weight": (f, d), b + "ffn_up.weight": (f, d),
            b + "ffn_down.weight": (d, f)})
        if cfg.qk_norm:
            out[b + "attn_q_norm.weight"] = (hd,)
            out[b + "attn_k_norm.weight"] = (hd,)
    return out


def check_weights(cfg: LlamaConfig, weights: dict, *, source: str) -> None:
    """Raise ``ValueError`` naming the first missing or misshapen tensor."""
    want = weight_shapes(cfg)
    missing = [k for k in want if k not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: tensor {missing[0]!r} is missing{more}")
    for k, shape in want.items():
        got = tuple(weights[k].shape)
        if got != shape:
            raise ValueError(f"{source}: tensor {k!r} has shape {got}, the config needs {shape}")
