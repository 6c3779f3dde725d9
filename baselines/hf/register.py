"""Registry methods as transformers attention implementations: names ``burst:<method>``.

    name = register("usp", layout="zigzag", group=g, ulysses_degree=2)   # -> "burst:usp:ulysses_degree=2"
    model.set_attn_implementation(name)          # or config._attn_implementation = name before building
    names = register_all(layout="zigzag")        # {method: name} for every sequence-parallel method here
    use_method(model, "burst")                   # check_model + register + set_attn_implementation

The name carries everything bound into it: ``burst:<method>``, then ``:<layout>`` unless zigzag (the
default), ``:k=v`` per option, ``@<ranks>`` for a group other than the default one; registering the
same name again replaces the function (same binding, same behaviour). No name contains "/", so
transformers never mistakes it for a Hub kernel (``integrations.hub_kernels.is_kernel``), nor
"sdpa", "flash" or "flex", which it matches by substring.
"""
from __future__ import annotations

import torch.distributed as dist

from baselines.registry import METHODS

from .attention import Binding, attention_function, refuse_mask
from .checks import check_method, check_model

PREFIX = "burst:"


def sp_methods() -> list[str]:
    """Every sequence-parallel method of the registry that runs here (level "op", available)."""
    return [n for n, m in METHODS.items() if m.level == "op" and m.available()]


def _group_tag(group) -> str:
    if group is None or group is dist.group.WORLD:
        return ""
    return "@" + ",".join(map(str, dist.get_process_group_ranks(group)))


def default_name(binding: Binding) -> str:
    name = PREFIX + binding.method
    if binding.layout != "zigzag":
        name += f":{binding.layout}"
    name += "".join(f":{k}={v}" for k, v in sorted(binding.options.items()))
    return name + _group_tag(binding.group)


def _interfaces():
    try:
        from transformers import AttentionInterface  # noqa: PLC0415 (optional dependency)
        from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415 (optional dependency)
    except ImportError as e:
        raise ImportError(f"baselines.hf needs transformers (the [hf] extra: pip install -e '.[hf]'): {e}") from e
    return AttentionInterface, AttentionMaskInterface


def register(method: str, layout: str = "zigzag", group=None, *, name: str | None = None, **options) -> str:
    """Register ``method`` (layout, group, options bound) in ``AttentionInterface``; its name."""
    AttentionInterface, AttentionMaskInterface = _interfaces()

    check_method(method, layout)
    binding = Binding(method, layout, group, dict(options))
    name = name or default_name(binding)
    if not name.startswith(PREFIX) or any(s in name for s in ("/", "sdpa", "flash", "flex")):
        raise ValueError(f"name={name!r} must start with {PREFIX!r} and contain none of '/', 'sdpa', 'flash', "
                         "'flex' (transformers treats those as Hub kernels or its own backends)")
    AttentionInterface.register(name, attention_function(binding))
    AttentionMaskInterface.register(name, refuse_mask)       # or HF would drop a padding mask silently
    return name


def register_all(layout: str = "zigzag", group=None) -> dict[str, str]:
    """``{method: name}`` for every method of ``sp_methods()`` that takes ``layout``."""
    return {m: register(m, layout, group) for m in sp_methods() if layout in METHODS[m].layouts}


def use_method(model, method: str, layout: str = "zigzag", group=None, **options) -> str:
    """Check ``model`` (``check_model``), register ``method`` and switch the model to it; the name."""
    check_model(model, method, layout, group, **options)
    name = register(method, layout, group, **options)
    model.set_attn_implementation(name)
    return name
