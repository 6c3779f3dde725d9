"""Context-parallel inference: a KV cache sharded across ranks, prefill into it, decode on it
(docs/inference.md)."""
from .bytes import continue_bytes, decode_bytes, prefill_bytes
from .decode import MERGES, decode
from .kv_cache import PLACEMENTS, SeqShard, ShardedKVCache, place
from .partial import decode_mask, merge_all, partial_attention
from .prefill import continuation_owners, prefill, prefill_continue

__all__ = ["MERGES", "PLACEMENTS", "SeqShard", "ShardedKVCache", "continuation_owners", "continue_bytes", "decode",
           "decode_bytes", "decode_mask", "merge_all", "partial_attention", "place", "prefill", "prefill_bytes",
           "prefill_continue"]
