"""A KV cache sharded across the ranks of a context-parallel group (docs/inference.md).

Each rank holds, for every layer and every sequence of the batch, the keys and values of the
tokens it owns, and each cached token keeps its *global* position (RoPE and the masks use it), so
shards may hold any mix of positions:

* the prefill writes the layout's shard (``burst_impl.layout.positions``: contiguous, zigzag, ...);
* later tokens are placed by ``placement``:
  ``"round_robin"``: token at position t goes to rank t mod G (vLLM's decode context parallelism);
  ``"shortest"``: each new token goes to the rank with the fewest tokens of that sequence (the
  lowest rank on a tie), which keeps shards even after a prefill of uneven length.

The placement may change between calls: nothing downstream assumes one. Every rank keeps every
rank's shard length of every sequence (``shard_lens``), so all ranks compute the same owners for
new tokens without any communication.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import comm

Tensor = torch.Tensor
PLACEMENTS = ("round_robin", "shortest")


@dataclass
class SeqShard:
    """This rank's part of one sequence at one layer: k, v (n_local, Zkv, d), pos (n_local,) int64 global
    positions; ``shard_lens``: every rank's n_local (the same list on every rank)."""

    k: Tensor
    v: Tensor
    pos: Tensor
    shard_lens: list[int]
    # preallocated rows (``ShardedKVCache.reserve``): k, v, pos are then views of their first n_local rows,
    # and an append copies into the rows after them instead of concatenating (a server's paged or
    # preallocated cache; without it every append copies the whole shard)
    spare: tuple[Tensor, Tensor, Tensor] | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        """Tokens of the sequence cached over all ranks."""
        return sum(self.shard_lens)


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is unknown; choose one of {PLACEMENTS}")


def place(placement: str, shard_lens: list[int], start: int, count: int) -> list[int]:
    """Owner rank of each of ``count`` new tokens at positions start.. of a sequence whose shards hold
    ``shard_lens`` tokens (pure: the same answer on every rank)."""
    check_placement(placement)
    g = len(shard_lens)
    if placement == "round_robin":
        return [(start + i) % g for i in range(count)]
    lens, owners = list(shard_lens), []
    for _ in range(count):
        r = min(range(g), key=lambda j: (lens[j], j))
        owners.append(r)
        lens[r] += 1
    return owners


def owned_rows(owners: list[int], rank: int) -> slice | list[int]:
    """The rows of ``owners`` that ``rank`` owns, as a slice where they are evenly spaced (every placement
    of one token, round-robin's every G-th), else as a list of indices."""
    idx = [j for j, o in enumerate(owners) if o == rank]
    if not idx:
        return slice(0, 0)
    step = idx[1] - idx[0] if len(idx) > 1 else 1
    if all(b - a == step for a, b in zip(idx, idx[1:])):
        return slice(idx[0], idx[-1] + 1, step)
    return idx


def check_cache(cache, layer: int, group) -> None:
    """``cache`` is a ``ShardedKVCache`` of this rank of ``group``, and ``layer`` one of its layers."""
    if not isinstance(cache, ShardedKVCache):
        raise ValueError(f"cache={type(cache).__name__} must be a burst_impl.inference.ShardedKVCache")
    rank, size = comm.world(group)
    if (cache.rank, cache.world_size) != (rank, size):
        raise ValueError(f"cache.rank, cache.world_size = {cache.rank}, {cache.world_size} must be this process's "
                         f"rank and size in group: {rank}, {size} (a cache built for another group)")
    cache.check_layer(layer)


def cache_state(cache, layer: int, seqs=None) -> dict:
    """What the ranks of a call must agree on about their caches (layer count, placement, every shard
    length of ``seqs`` at ``layer``); None where ``cache`` or ``layer`` is invalid (the local checks say why)."""
    if not isinstance(cache, ShardedKVCache) or not isinstance(layer, int) or layer not in range(cache.n_layers):
        return dict(n_layers=getattr(cache, "n_layers", None), placement=None, shards=None)
    seqs = range(cache.batch) if seqs is None else [b for b in seqs if b in range(cache.batch)]
    return dict(n_layers=cache.n_layers, placement=cache.placement,
                shards=[cache.layers[layer][b].shard_lens for b in seqs])


@dataclass
class ShardedKVCache:
    """Every layer's shards of a batch of ``batch`` sequences on rank ``rank`` of ``world_size``.

    Build with ``ShardedKVCache.empty``; the operators of ``burst_impl.inference`` fill it. A
    world of one rank is a single-device cache (and a tensor-parallel rank's head-sharded cache)."""

    n_layers: int
    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    rank: int
    world_size: int
    placement: str = "round_robin"
    layers: list[list[SeqShard]] = field(default_factory=list, repr=False)

    @classmethod
    def empty(cls, n_layers: int, batch: int, kv_heads: int, head_dim: int, *, dtype=torch.float32,
              device="cpu", placement: str = "round_robin", group=None, rank: int | None = None,
              world_size: int | None = None) -> "ShardedKVCache":
        """An empty cache for this rank of ``group`` (or an explicit ``rank`` of ``world_size``)."""
        for name, value in (("n_layers", n_layers), ("batch", batch), ("kv_heads", kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        check_placement(placement)
        if (rank is None) != (world_size is None):
            raise ValueError(f"rank={rank!r} and world_size={world_size!r}: give both or neither (then: the group's)")
        if rank is None:
            rank, world_size = comm.world(group)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        device = torch.device(device)
        cache = cls(n_layers, batch, kv_heads, head_dim, dtype, device, rank, world_size, placement)
        cache.layers = [[cache._empty_shard() for _ in range(batch)] for _ in range(n_layers)]
        return cache

    def _empty_shard(self) -> SeqShard:
        kv = torch.empty((0, self.kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        return SeqShard(kv, kv.clone(), torch.empty(0, dtype=torch.int64, device=self.device),
                        [0] * self.world_size)

    # ------------------------------------------------------------ reading

    def shard(self, layer: int, seq: int) -> SeqShard:
        self.check_layer(layer)
        if not 0 <= seq < self.batch:
            raise ValueError(f"seq={seq} must lie in [0, batch={self.batch})")
        return self.layers[layer][seq]

    def lengths(self, layer: int) -> list[int]:
        """Global cached length of every sequence at ``layer``."""
        self.check_layer(layer)
        return [s.length for s in self.layers[layer]]

    def check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer={layer!r} must be an int in [0, n_layers={self.n_layers}) of this cache")

    def check_layers(self, n_layers: int) -> None:
        """ValueError unless the cache was built for a model of ``n_layers`` layers."""
        if n_layers != self.n_layers:
            raise ValueError(f"cache.n_layers={self.n_layers} must equal the model's n_layers={n_layers} "
                             "(a cache built for another model)")

    def owners(self, layer: int, seq: int, count: int) -> list[int]:
        """The ranks the next ``count`` tokens of ``seq`` at ``layer`` go to (``placement``; pure)."""
        s = self.shard(layer, seq)
        return place(self.placement, s.shard_lens, s.length, count)

    def nbytes(self) -> int:
        """Bytes of K and V this rank holds (positions left out: the model's KV capacity; rows reserved but
        not yet written are not counted)."""
        return sum(comm.nbytes(s.k) + comm.nbytes(s.v) for layer in self.layers for s in layer)

    # ------------------------------------------------------------ a benchmark's hooks

    def reserve(self, tokens: int) -> None:
        """Preallocate room for ``tokens`` more rows in every shard, so that the next appends write in place
        (a benchmark's decode step then costs what a server's does, not a copy of the whole shard)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens={tokens!r} must be a non-negative int (rows to reserve per shard)")
        for layer in self.layers:
            for s in layer:
                n = s.k.shape[0]
                bufs = (s.k.new_empty((n + tokens, *s.k.shape[1:])), s.v.new_empty((n + tokens, *s.v.shape[1:])),
                        s.pos.new_empty((n + tokens,)))
                for buf, t in zip(bufs, (s.k, s.v, s.pos)):
                    buf[:n] = t
                s.spare = bufs
                s.k, s.v, s.pos = (buf[:n] for buf in bufs)

    def snapshot(self) -> list[list[tuple[int, list[int]]]]:
        """Every shard's (rows, shard_lens) now, for ``rewind``."""
        return [[(s.k.shape[0], list(s.shard_lens)) for s in layer] for layer in self.layers]

    def rewind(self, state: list[list[tuple[int, list[int]]]]) -> None:
        """Forget the tokens appended since ``snapshot`` gave ``state`` (appends only add rows after the
        existing ones, so the first rows are the snapshot's): a benchmark times every decode step at the
        same context length."""
        for layer, marks in zip(self.layers, state):
            for s, (n, lens) in zip(layer, marks):
                if n > s.k.shape[0]:
                    raise ValueError(f"rewind to {n} rows: the shard holds only {s.k.shape[0]} (not a snapshot of it)")
                s.k, s.v, s.pos, s.shard_lens = s.k[:n], s.v[:n], s.pos[:n], list(lens)

    # ------------------------------------------------------------ writing (the operators call these)

    def write(self, layer: int, seq: int, k: Tensor, v: Tensor, pos: Tensor, shard_lens: list[int]) -> None:
        """Append this rank's rows ``k``/``v`` (n, Zkv, d) at global positions ``pos`` (n,), after which
        the ranks hold ``shard_lens`` tokens of the sequence."""
        s = self.shard(layer, seq)
        n0, n = s.k.shape[0], k.shape[0]
        pos = pos.to(device=self.device, dtype=torch.int64)
        # s.k still the reserve's view: compare storages, since an empty view's data_ptr() is 0 (a cache
        # reserved before its first write, as fill_cache does, would otherwise concatenate on every append)
        if s.spare is not None and n0 + n <= s.spare[0].shape[0] and \
                s.k.untyped_storage().data_ptr() == s.spare[0].untyped_storage().data_ptr():
            for buf, t in zip(s.spare, (k.to(self.dtype), v.to(self.dtype), pos)):
                buf[n0:n0 + n] = t
            s.k, s.v, s.pos = (buf[:n0 + n] for buf in s.spare)
        else:
            s.k = torch.cat([s.k, k.to(self.dtype)])
            s.v = torch.cat([s.v, v.to(self.dtype)])
            s.pos = torch.cat([s.pos, pos])
            s.spare = None
        s.shard_lens = list(shard_lens)
        assert s.k.shape[0] == s.pos.numel() == s.shard_lens[self.rank], "cache rows and positions out of step"

    def append(self, layer: int, seq: int, k: Tensor, v: Tensor, owners: list[int]) -> Tensor:
        """Append the new tokens (k, v: (n, Zkv, d), every rank's) owned by this rank; positions continue
        the sequence. Returns their positions (n,).

        This rank's tokens are picked by a slice derived on the host (``owned_rows``), not a boolean mask
        on the device: a mask index waits for the device to count its rows, once per sequence of every
        decode step, which on a GPU serialised the host's work with the kernels'."""
        s = self.shard(layer, seq)
        pos = torch.arange(s.length, s.length + len(owners), device=self.device)
        rows = owned_rows(owners, self.rank)
        lens = list(s.shard_lens)
        for o in owners:
            lens[o] += 1
        self.write(layer, seq, k[rows], v[rows], pos[rows], lens)
        return pos
