"""The hyper-parameters of a Llama-family causal LM (Llama, SmolLM2, Qwen3) and the weight names.

Weights are named as in GGUF files (``token_embd.weight``, ``blk.{i}.attn_q.weight``, ...);
matrices are (out, in) like ``torch.nn.Linear``. :func:`weight_shapes` lists every tensor a
config needs, so both loaders check a file against it before anything is computed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .schema import FIELDS, ModelFileError, check_values, hf_values

__all__ = ["LlamaConfig", "UnsupportedModelError", "ModelFileError", "LINEAR_KINDS",
           "weight_shapes", "linear_names", "check_shapes", "block_count"]

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
        check_values({f: getattr(self, f) for f in FIELDS}, lambda f: f"LlamaConfig.{f}",
                     error=ValueError)
        if self.rope_freq_factors is not None and (
                len(self.rope_freq_factors) != self.head_dim // 2
                or not all(math.isfinite(f) and f > 0 for f in self.rope_freq_factors)):
            raise ValueError(f"LlamaConfig.rope_freq_factors must hold head_dim/2 = "
                             f"{self.head_dim // 2} finite positive numbers")
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
    def from_hf(cls, cfg, source: str = "config.json") -> "LlamaConfig":
        """From a Hugging Face ``config.json`` of ``LlamaForCausalLM`` or
        ``Qwen3ForCausalLM`` (``tie_word_embeddings`` defaults to false, as there).

        Every key read is checked (:func:`~bakron.models.llm.schema.hf_values`):
        :class:`~bakron.models.llm.schema.ModelFileError` names ``source`` and the key."""
        return cls(**hf_values(cfg, source, UnsupportedModelError))

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


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def block_count(num_layers: int, names, source: str, key: str, *,
                error=ModelFileError, allow_extra: bool = False) -> None:
    """``error`` unless the tensor names (GGUF names) hold exactly the blocks
    ``0 .. num_layers - 1`` (``allow_extra``: at least those): checked before anything is
    sized by ``num_layers`` (``key`` names the count in the file)."""
    blocks = {int(m.group(1)) for n in names if (m := _BLOCK.match(n))}
    extra = sorted(b for b in blocks if b >= num_layers)
    if extra and not allow_extra:
        raise error(f"{source}: {key} is {num_layers} but the file holds tensors of block "
                    f"{extra[-1]} ({len(extra)} block(s) beyond the count)")
    if len(blocks) - len(extra) < num_layers:
        missing = min(set(range(len(blocks) + 1)) - blocks)
        raise error(f"{source}: {key} is {num_layers} but the file holds tensors of "
                    f"{len(blocks)} block(s) (block {missing} is missing)")


def check_shapes(cfg: LlamaConfig, shapes: dict, *, source: str, key: str = "num_layers",
                 error=ModelFileError, allow_extra: bool = False) -> None:
    """Raise ``error`` naming the first missing or misshapen tensor of ``shapes`` ({GGUF
    name: shape}); the loaders call it on the files' tensor tables before reading any data
    (``key``: how the file names the block count)."""
    block_count(cfg.num_layers, shapes, source, key, error=error, allow_extra=allow_extra)
    want = weight_shapes(cfg)
    missing = [k for k in want if k not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise error(f"{source}: tensor {missing[0]!r} is missing{more}")
    for k, shape in want.items():
        got = tuple(int(d) for d in shapes[k])
        if got != shape:
            raise error(f"{source}: tensor {k!r} has shape {got}, the config needs {shape}")


def check_weights(cfg: LlamaConfig, weights: dict, *, source: str) -> None:
    """Raise ``ValueError`` naming the first missing or misshapen tensor of ``weights``."""
    check_shapes(cfg, {k: tuple(getattr(v, "shape", ())) for k, v in weights.items()},
                 source=source, error=ValueError, allow_extra=True)
