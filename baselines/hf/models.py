"""Small Llama, Qwen2 and Mistral causal LMs built from configs (never a Hub download).

    model = build("llama", dtype=torch.float64)                 # 2 layers, hidden 48, 12 heads x 4
    model = build("qwen2", sliding_window=8, max_window_layers=1)  # layer 1 sliding, layer 0 full

The three families differ where the integration must get things right: Llama is MHA
(12 query, 12 kv heads), Qwen2 GQA (12 / 2, with q/k/v biases; optionally sliding layers above
``max_window_layers``), Mistral multi-query (12 / 1) with a sliding window of 8 tokens on every
layer by default. 12 heads split over 2, 3 and 4 ranks (Ulysses); Qwen2's 2 kv heads do not split
over 3 (nor divide it), Mistral's 1 is replicated. Weights are drawn with ``torch.manual_seed(seed)``
in fp32 and then cast, so every rank and dtype starts from the same values.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

FAMILIES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class TinyConfig:
    family: str
    vocab_size: int = 64
    hidden_size: int = 48
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 4
    max_position_embeddings: int = 256
    sliding_window: int | None = None
    max_window_layers: int | None = None     # Qwen2: layers >= this one use the sliding window

    def hf_config(self):
        import transformers  # noqa: PLC0415 (optional dependency)

        kw = {k: v for k, v in asdict(self).items() if k not in ("family", "sliding_window", "max_window_layers")}
        kw.update(tie_word_embeddings=False, attention_dropout=0.0)
        if self.family == "llama":
            return transformers.LlamaConfig(**kw)
        if self.family == "mistral":
            return transformers.MistralConfig(sliding_window=self.sliding_window, **kw)
        if self.family == "qwen2":
            sliding = self.sliding_window is not None
            return transformers.Qwen2Config(use_sliding_window=sliding, sliding_window=self.sliding_window,
                                            max_window_layers=self.max_window_layers or 0, **kw)
        raise ValueError(f"family={self.family!r} is unknown; choose one of {FAMILIES}")


DEFAULTS = {
    "llama": TinyConfig("llama"),
    "qwen2": TinyConfig("qwen2", num_key_value_heads=2),
    "mistral": TinyConfig("mistral", num_key_value_heads=1, sliding_window=8),
}


def tiny_config(family: str, **overrides) -> TinyConfig:
    if family not in DEFAULTS:
        raise ValueError(f"family={family!r} is unknown; choose one of {FAMILIES}")
    return replace(DEFAULTS[family], **overrides)


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str = "sdpa",
          **overrides):
    """The causal LM of ``tiny_config(family, **overrides)`` with seeded weights, in ``dtype``."""
    import transformers  # noqa: PLC0415 (optional dependency)

    cfg = tiny_config(family, **overrides).hf_config()
    cfg._attn_implementation = attn_implementation
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(cfg)
    return model.to(dtype)
