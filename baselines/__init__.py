"""Baseline attention methods behind BurstAttention's call signature, and the method registry."""
from .registry import METHODS, AttnShape, Method, get, register

__all__ = ["METHODS", "AttnShape", "Method", "get", "register"]
