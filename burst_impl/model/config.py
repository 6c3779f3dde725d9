"""Model configurations: LLaMA-style decoders, as typed dataclasses keyed by the names YAML uses.

The paper's models (docs/papers.md §3, "Models") are LLaMA-2 7B and 13B, and BurstEngine's
"14B" = the 13B shape with a 120K vocabulary (we use 122880 = 120 * 1024).
``n_kv_heads < n_heads`` gives grouped-query attention (LLaMA-3 8B is listed
for that). The ``tiny*`` sizes are for CPU tests: 12 heads split over 1, 2,
3 and 4 ranks, an FFN width divisible by 1..4 (tensor parallelism), a
vocabulary small enough that the loss visibly falls in 30 steps.

    cfg = get_config("llama2_7b")        # ValueError for an unknown name
    cfg = replace(cfg, n_layers=2)       # dataclasses.replace for variants; validated on creation
    cfg = replace(cfg, loss="fused", checkpoint="seq")   # the training-memory choices (issue 11)
    cfg = replace(cfg, mask="window:4096:0")             # causal attention intersected with a mask (issue 37)
"""
from __future__ import annotations

from dataclasses import dataclass

from burst_impl import masks
from burst_impl.loss_modes import get_loss_mode

# Activation checkpointing of the blocks (``checkpoint.py`` says what each mode keeps and recomputes).
CHECKPOINT_MODES = ("none", "full", "seq", "whole")


def check_mode(mode) -> str:
    """``mode`` if it is a checkpoint mode, else ValueError naming ``checkpoint=``."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={mode!r} is unknown; choose one of {CHECKPOINT_MODES}")
    return mode


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    hidden: int            # H = Z * d
    n_heads: int           # Z
    n_kv_heads: int        # Zkv (GQA when < Z)
    ffn_hidden: int        # SwiGLU inner width F
    vocab_size: int        # V
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Training-memory choices (issue 11), not architecture: the LM head + cross-entropy
    # implementation (burst_impl.loss_modes: unfused, fused, liger, cce) and the activation
    # checkpointing of the blocks (CHECKPOINT_MODES: none, full, seq, whole).
    loss: str = "unfused"
    checkpoint: str = "none"
    # The attention mask (issue 37), a burst_impl.masks spec string over global positions, always
    # intersected with the causal mask (a causal language model): "" = plain causal, "window:L:0" a
    # sliding window of L keys before the query (Mistral's 4096, BurstEngine's sparse runs), "docs:..."
    # packed documents, "bsparse:..." block-sparse. Sizes are checked against N when a step runs.
    mask: str = ""

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def validate(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer (model {self.name!r})")
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by n_heads={self.n_heads} "
                             f"(head_dim = hidden / n_heads; model {self.name!r})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                             f"(each kv head serves n_heads/n_kv_heads query heads; model {self.name!r})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} (hidden/n_heads) must be even: RoPE rotates pairs "
                             f"of channels (model {self.name!r})")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must be positive")
        get_loss_mode(self.loss)            # ValueError naming loss= for an unknown mode
        check_mode(self.checkpoint)         # ValueError naming checkpoint= for an unknown mode
        why = masks.check_spec(self.mask) if self.mask else None
        if why:
            raise ValueError(f"mask={self.mask!r} (model {self.name!r}): {why}")


CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (
    ModelConfig("llama2_7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, ffn_hidden=11008,
                vocab_size=32000),
    ModelConfig("llama2_13b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40, ffn_hidden=13824,
                vocab_size=32000),
    # BurstEngine's "14B": the 13B shape with a 120K vocabulary (the paper gives no exact size).
    ModelConfig("burstengine_14b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40, ffn_hidden=13824,
                vocab_size=122880),
    ModelConfig("llama3_8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                vocab_size=128256, rope_theta=500000.0),
    # Llama 3 70B (issue 36's decode model on H100): meta-llama/Meta-Llama-3-70B config.json on Hugging Face
    # (num_hidden_layers 80, hidden_size 8192, num_attention_heads 64, num_key_value_heads 8,
    # intermediate_size 28672, vocab_size 128256, rope_theta 500000); the Llama 3 paper (Dubey et al. 2024,
    # arXiv 2407.21783) Table 3 lists the same layers, width, FFN width and heads.
    ModelConfig("llama3_70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                vocab_size=128256, rope_theta=500000.0),
    # LLaMA-2 7B's block and vocabulary with 2 of its 32 layers: the GPU check's model step (experiments/
    # gpu_memory.py), every layer at the paper's size, one step in well under a second on one GPU.
    ModelConfig("llama2_7b_2l", n_layers=2, hidden=4096, n_heads=32, n_kv_heads=32, ffn_hidden=11008,
                vocab_size=32000),
    # CPU sizes. tiny: MHA, 12 heads of 8 (splits over G = 1..4 for every method), F = 192.
    ModelConfig("tiny", n_layers=2, hidden=96, n_heads=12, n_kv_heads=12, ffn_hidden=192, vocab_size=64),
    # tiny_gqa: 8 query heads sharing 2 kv heads (G = 1, 2, 4).
    ModelConfig("tiny_gqa", n_layers=2, hidden=64, n_heads=8, n_kv_heads=2, ffn_hidden=128, vocab_size=64),
    # cpu_small: the CPU mirrors' model (timed runs on the emulated cluster), about 2.1M parameters:
    # 8 heads x 32 (the attention-level CPU specs' shape, so the emulator's calibration fits both),
    # 2 layers and a 1K vocabulary so that a 1K-token training step takes well under a second on 2 cores.
    ModelConfig("cpu_small", n_layers=2, hidden=256, n_heads=8, n_kv_heads=8, ffn_hidden=688,
                vocab_size=1024),
)}


def get_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"model={name!r} is unknown; registered: {sorted(CONFIGS)}")
    return CONFIGS[name]


def layer_params(cfg: ModelConfig) -> int:
    """Weights of one decoder block: attention projections, SwiGLU MLP, two norms."""
    h, d = cfg.hidden, cfg.head_dim
    attn = h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + cfg.n_heads * d * h
    return attn + 3 * h * cfg.ffn_hidden + 2 * h


def param_numels(cfg: ModelConfig) -> list[int]:
    """Elements of every parameter in ``model.named_parameters()`` order: the embedding; per block
    the attention norm, wq, wk, wv, wo, the FFN norm, w1, w3, w2; the final norm; the LM head. (The
    gradient buckets of ``parallel.sync_grads`` follow this order; ``memory.step_memory`` uses it.)"""
    h, q, kv, f = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    block = [h, q * h, kv * h, kv * h, h * q, h, f * h, f * h, h * f]
    return [cfg.vocab_size * h] + block * cfg.n_layers + [h, cfg.vocab_size * h]


def num_params(cfg: ModelConfig) -> int:
    """All parameters: embedding, blocks, final norm, untied LM head."""
    return cfg.vocab_size * cfg.hidden * 2 + cfg.n_layers * layer_params(cfg) + cfg.hidden


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that multiply every token (the 6*P*tokens convention): the blocks' projections
    and the LM head. Not the embedding (a table lookup) and not the norms (elementwise)."""
    return cfg.n_layers * (layer_params(cfg) - 2 * cfg.hidden) + cfg.vocab_size * cfg.hidden
