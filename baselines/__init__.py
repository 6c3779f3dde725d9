"""Baseline attention methods behind BurstAttention's call signature, and the method registry."""
from burst_impl.shape import AttnShape

from burst_impl.method import Method
from .registry import METHODS, get

__all__ = ["METHODS", "AttnShape", "Method", "get"]
