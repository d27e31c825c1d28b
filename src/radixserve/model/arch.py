"""The shape of a Llama-family network (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Qwen3-MoE),
read from an HF config.json: the one place that knows both the transformers v4 and v5 spellings
of its fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # rope_type plus that type's parameters (factor, low_freq_factor, ...)
    rope_scaling: Mapping[str, Any] = field(default_factory=dict)
    moe: MoEArch | None = None  # routed experts (qwen3_moe); None: every layer dense

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` routes to experts: transformers' rule for Qwen3-MoE (not in
        ``mlp_only_layers``, and every ``decoder_sparse_step``-th layer counting from 1)."""
        m = self.moe
        if m is None or index in m.mlp_only_layers:
            return False
        return (index + 1) % m.decoder_sparse_step == 0

    @property
    def rope_type(self) -> str:
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelArch:
        """Parse an HF config.json; raises ValueError for what this engine cannot run."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if _sliding(cfg, model_type):
            raise ValueError(f"sliding-window attention ({model_type}) is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _rope_params(cfg)
        arch = cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            moe=MoEArch.from_hf_config(cfg) if model_type == "qwen3_moe" else None,
        )
        arch._check()
        return arch

    def _check(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )


@dataclass(frozen=True, slots=True)
class MoEArch:
    """Qwen3-MoE's routed experts: ``top_k`` of ``num_experts`` per token, each a SwiGLU MLP of
    width ``intermediate_size``; the top-k softmax weights renormalised to 1 when
    ``norm_topk_prob``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> MoEArch:
        # transformers v5 writes num_local_experts, the released checkpoints num_experts
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not experts or "num_experts_per_tok" not in cfg or "moe_intermediate_size" not in cfg:
            raise ValueError(
                "qwen3_moe config lacks num_experts, num_experts_per_tok or moe_intermediate_size"
            )
        moe = cls(
            num_experts=int(experts),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )
        if not 0 < moe.top_k <= moe.num_experts:
            raise ValueError(f"num_experts_per_tok {moe.top_k} not in 1..{moe.num_experts}")
        return moe


def _sliding(cfg: Mapping[str, Any], model_type: str) -> bool:
    """Whether any layer attends within a window (Qwen's switch, Mistral's window, or a
    transformers v5 ``layer_types`` entry)."""
    if cfg.get("use_sliding_window") or (model_type == "mistral" and cfg.get("sliding_window")):
        return True
    return any(t != "full_attention" for t in cfg.get("layer_types") or ())


def _rope_params(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict): transformers v5 writes ``rope_parameters``, v4 writes
    ``rope_theta`` and ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if params.get("rope_type", params.get("type", "default")) == "default":
        return theta, {}
    return theta, params
