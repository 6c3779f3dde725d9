"""What a model and a method must satisfy before a sequence-parallel step; every rule a ValueError
that names the parameter, the value and the rule, raised before any byte is sent.

* the method is a sequence-parallel operator of the registry (level "op") that runs here;
* the layout is a named one the method takes (``contiguous``, ``zigzag``, ``striped``; ``balanced``
  depends on a mask that changes per batch, which the model's positions cannot follow);
* the model's attention goes through ``AttentionInterface`` (transformers marks such model classes
  ``_supports_attention_backend = True``; others compute attention in their own code and would
  silently run single-device attention on each shard);
* the heads split as the method needs (Ulysses and USP: ``burst_impl``'s ``kv_replication`` rule);
* no attention dropout (the methods have none).
"""
from __future__ import annotations

from baselines.registry import get
from burst_impl import comm
from burst_impl.layout import LAYOUTS, chunks_per_rank
from burst_impl.shape import DTYPE_NAMES, AttnShape


def check_method(method: str, layout: str) -> None:
    m = get(method)
    if m.level != "op":
        raise ValueError(f"method={method!r} is level {m.level!r}: only sequence-parallel operators (level 'op') "
                         "go into AttentionInterface (tensor parallelism splits the layer's weights)")
    if not m.available():
        raise ValueError(f"method={method!r} is unavailable here (needs {m.external or 'an optional package'})")
    if layout not in LAYOUTS or layout not in m.layouts:
        raise ValueError(f"layout={layout!r}: the HF integration takes the named layouts "
                         f"{tuple(l for l in LAYOUTS if l in m.layouts)} for method {method!r}")


def heads_of(config) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def check_model(model, method: str, layout: str = "zigzag", group=None, **options) -> None:
    """ValueError unless ``model`` can run ``method`` over ``group`` with ``layout``."""
    check_method(method, layout)
    cls = type(model)
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(f"model={cls.__name__}: its attention does not go through transformers' "
                         f"AttentionInterface ({cls.__name__}._supports_attention_backend is False), so a "
                         "registered method would never be called; use a model class that supports "
                         "attention backends (Llama, Qwen2, Mistral, ...)")
    config = model.config
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"config.attention_dropout={dropout}: the suite's methods have no attention dropout; "
                         "set it to 0")
    heads, kv_heads, head_dim = heads_of(config)
    _, world_size = comm.world(group)
    dtype = DTYPE_NAMES.get(next(model.parameters()).dtype, "float32")
    shape = AttnShape(batch=1, seqlen=chunks_per_rank(layout) * world_size, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, world_size=world_size, dtype=dtype, layout=layout)
    try:
        get(method).validate(shape, **options)
    except ValueError as e:
        raise ValueError(f"config.num_attention_heads={heads}, config.num_key_value_heads={kv_heads} at "
                         f"world size {world_size}: method {method!r} cannot split them: {e}") from None
