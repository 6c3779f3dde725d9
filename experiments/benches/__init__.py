"""Benchmarks of BurstEngine's training-memory features: the fused loss, the checkpoint modes, the ablation."""
