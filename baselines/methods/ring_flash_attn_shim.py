"""ring-flash-attn's two ring functions, importable next to the pinned transformers.

ring-flash-attn's package ``__init__`` also imports its Hugging Face adapter, which imports names
from ``transformers.modeling_flash_attention_utils`` that transformers 5.x no longer has (0.1.8
asks for ``is_flash_attn_greater_or_equal_2_10``; older releases for ``_flash_supports_window_size``
and ``is_flash_attn_greater_or_equal``). The ring functions themselves need only torch and
flash-attn. So when the package import fails in transformers, ``load`` imports the package's
submodules without running its ``__init__``: an empty package module over the installed files,
then ``ring_flash_attn.ring_flash_attn`` and ``ring_flash_attn.zigzag_ring_flash_attn``. The HF
adapter stays unimported (we never use it); ``sys.modules["ring_flash_attn"]`` is then that
empty package, which other code importing the package's HF adapter would notice.

Any other failure (flash-attn missing, a broken install) is reported as it is (``reason``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass

PACKAGE = "ring_flash_attn"
FUNCTIONS = {"ring_flash_attn_func": "ring_flash_attn", "zigzag_ring_flash_attn_func": "zigzag_ring_flash_attn"}


@dataclass(frozen=True)
class Loaded:
    """The ring functions (None when not importable), ``reason`` why not, ``shimmed``: without its __init__."""

    module: object | None
    reason: str = ""
    shimmed: bool = False


def _transformers_failure(e: ImportError) -> bool:
    return (getattr(e, "name", None) or "").split(".")[0] == "transformers"


def _without_init() -> types.ModuleType:
    spec = importlib.util.find_spec(PACKAGE)
    pkg = types.ModuleType(PACKAGE)
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__, pkg.__package__, pkg.__file__ = spec, PACKAGE, spec.origin
    sys.modules[PACKAGE] = pkg
    for fn, sub in FUNCTIONS.items():
        setattr(pkg, fn, getattr(importlib.import_module(f"{PACKAGE}.{sub}"), fn))
    return pkg


@functools.lru_cache(maxsize=None)
def load() -> Loaded:
    """ring-flash-attn's ``ring_flash_attn_func`` and ``zigzag_ring_flash_attn_func`` (once per process)."""
    try:
        return Loaded(importlib.import_module(PACKAGE))
    except ImportError as e:
        if not _transformers_failure(e):
            return Loaded(None, f"ring_flash_attn is not importable: {type(e).__name__}: {e}")
        first = f"{type(e).__name__}: {e}"
    try:
        return Loaded(_without_init(), shimmed=True)
    except Exception as e:  # noqa: BLE001 - any failure of the submodules means "not here"
        sys.modules.pop(PACKAGE, None)
        return Loaded(None, f"ring_flash_attn's package import failed in transformers ({first}) and its ring "
                            f"functions alone did not import either: {type(e).__name__}: {e}")
