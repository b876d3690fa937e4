"""Content-addressed paged KV blocks (tensor-free): chained block hashes, refcounts, an LRU free list."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import struct
import sys
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import xxhash

from hybridserve import envs

BlockHash = bytes
"""A chained content hash of one full KV block and its whole prefix: 16 bytes (xxh3-128) or 32
bytes (SHA-256, for deployments that need collision resistance against chosen inputs)."""


class Hasher(Protocol):
    """The incremental hash object both algorithms return."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


HASH_FUNCTIONS: dict[str, tuple[Callable[..., Hasher], int]] = {
    "xxh3_128": (xxhash.xxh3_128, 16), "sha256": (hashlib.sha256, 32)}
"""Block hash algorithms by name: (constructor taking the first bytes, digest size)."""

SEED_FILE_NAME = "block-hash-seed"
"""The file (mode 0600) in `--disk-cache-dir` that keeps the block hash seed stable across restarts."""


@dataclass(frozen=True)
class KeyedHash:
    """xxh3_128 keyed by a secret 64-bit seed: without the seed, a client cannot choose inputs whose
    block hashes collide (so one tenant cannot make another's prefix match its own blocks). Its
    repr never shows the seed."""

    seed: int = field(repr=False)
    name: str = "xxh3_128"

    def __post_init__(self) -> None:
        if self.name != "xxh3_128":
            raise ValueError(f"only xxh3_128 takes a seed, not {self.name!r}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError("the block hash seed must be an unsigned 64-bit integer")

    def new(self, data: bytes = b"") -> Hasher:
        """A hasher seeded with this key, fed `data` first."""
        return xxhash.xxh3_128(data, seed=self.seed)

    def key_id(self) -> str:
        """A name for the seed that does not reveal it (for fingerprints of stored objects)."""
        return hashlib.sha256(b"hybridserve-block-hash-seed" + self.seed.to_bytes(8, "little")).hexdigest()[:16]


HashAlgorithm = str | KeyedHash
"""A block hash: an algorithm name of `HASH_FUNCTIONS` (unkeyed), or a `KeyedHash`."""


def _hash_function(algorithm: HashAlgorithm) -> tuple[Callable[..., Hasher], int]:
    if isinstance(algorithm, KeyedHash):
        return algorithm.new, 16
    return HASH_FUNCTIONS[algorithm]


def _one_shot(algorithm: HashAlgorithm) -> Callable[[bytes], bytes]:
    """The digest of one whole message in one call (what `_hash_function`'s hasher gives when fed
    the same bytes): one C call per block instead of several for a long prompt."""
    if isinstance(algorithm, KeyedHash):
        seed = algorithm.seed
        return lambda data: xxhash.xxh3_128_digest(data, seed)
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_digest
    constructor = HASH_FUNCTIONS[algorithm][0]
    return lambda data: constructor(data).digest()


def _seed_from_file(directory: Path) -> int:
    """The seed kept in `directory` (created 0600 with a fresh random seed when missing); a file
    another user could have written or read is refused with `ValueError`."""
    path = directory / SEED_FILE_NAME
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as out:
            out.write(f"{secrets.randbits(64)}\n")
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ValueError(f"block hash seed file {str(path)!r} must be a regular file of this user with mode 0600")
    try:
        return int(path.read_text().strip())
    except ValueError as error:
        raise ValueError(f"block hash seed file {str(path)!r} does not hold an integer") from error


def parse_seed(text: str) -> int:
    """A seed given as decimal or 0x-hex text (`--block-hash-seed`, `HYBRIDSERVE_BLOCK_HASH_SEED`)."""
    try:
        seed = int(text.strip(), 0)
    except ValueError as error:
        raise ValueError(f"block hash seed must be an integer, got {text!r}") from error
    if not 0 <= seed < 1 << 64:
        raise ValueError("the block hash seed must be an unsigned 64-bit integer")
    return seed


def _stable_seed(seed: int | None, disk_cache_dir: str | None) -> int | None:
    """`seed`, else `HYBRIDSERVE_BLOCK_HASH_SEED`, else the seed file in `disk_cache_dir`; None
    when none is configured."""
    if seed is None:
        text = envs.read_str(envs.BLOCK_HASH_SEED).strip()
        seed = parse_seed(text) if text else None
    if seed is None and disk_cache_dir is not None:
        seed = _seed_from_file(Path(disk_cache_dir).expanduser())
    return seed


def engine_block_hash(name: str, seed: int | None = None, disk_cache_dir: str | None = None) -> HashAlgorithm:
    """The block hash an engine uses: SHA-256 as named, else xxh3_128 keyed by `seed`, else by
    `HYBRIDSERVE_BLOCK_HASH_SEED`, else (with a disk tier, whose entries must match after a restart)
    by the seed file in `disk_cache_dir`, else by a random seed drawn now (once per engine start)."""
    if name != "xxh3_128":
        return name
    stable = _stable_seed(seed, disk_cache_dir)
    return KeyedHash(secrets.randbits(64) if stable is None else stable)


def block_hash_key_id(name: str, seed: int | None = None, disk_cache_dir: str | None = None) -> str | None:
    """A name, not revealing it, for the seed `engine_block_hash` keys the hash with when that seed
    is stable across processes (so stored objects are fingerprinted with it); None for SHA-256 or
    a random per-start seed."""
    stable = _stable_seed(seed, disk_cache_dir) if name == "xxh3_128" else None
    return None if stable is None else KeyedHash(stable).key_id()

_ROOT_TAG = b"\x00hybridserve-root"
_PARENT_TAG = b"\x01"
_TAIL_TAG = b"\x02hybridserve-tail"


def _encode_key(key: object, out: bytearray) -> None:
    """Append an unambiguous, type-tagged, length-prefixed encoding of ``key``."""
    if key is None:
        out += b"N"
    elif isinstance(key, bool):
        out += b"T" if key else b"F"
    elif isinstance(key, int):
        raw = str(key).encode("ascii")
        out += b"I" + struct.pack("<Q", len(raw)) + raw
    elif isinstance(key, str):
        raw = key.encode("utf-8")
        out += b"S" + struct.pack("<Q", len(raw)) + raw
    elif isinstance(key, (bytes, bytearray)):
        out += b"B" + struct.pack("<Q", len(key)) + bytes(key)
    elif isinstance(key, tuple):
        out += b"U" + struct.pack("<Q", len(key))
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(f"unsupported extra key type: {type(key).__name__}")


def encode_extra_keys(extra_keys: tuple[object, ...]) -> bytes:
    """Canonical byte encoding of ``extra_keys`` (so ``("ab",) != ("a", "b")``): ``None``, ``bool``,
    ``int``, ``str``, ``bytes`` and nested tuples of those."""
    out = bytearray()
    _encode_key(tuple(extra_keys), out)
    return bytes(out)


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, prefixed by their count (`struct` packs a list several
    times faster than `array` builds one)."""
    try:
        return struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids)
    except struct.error:
        pass
    arr = array("q", token_ids)  # the error `array` gives: OverflowError outside int64, TypeError
    if sys.byteorder != "little":
        arr.byteswap()
    return struct.pack("<Q", len(arr)) + arr.tobytes()


def _digest(prefix: bytes, token_ids: Sequence[int], extra_keys: tuple[object, ...],
            algorithm: HashAlgorithm) -> BlockHash:
    hasher = _hash_function(algorithm)[0](prefix)
    hasher.update(_encode_tokens(token_ids))
    hasher.update(encode_extra_keys(extra_keys))
    return hasher.digest()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] = (),
    algorithm: HashAlgorithm = "xxh3_128",
) -> BlockHash:
    """Chained hash of one block given its parent block's hash (``None`` for the first block); any
    difference in parent, tokens or extra keys (the cache salt) gives a different hash."""
    size = _hash_function(algorithm)[1]
    if parent is not None and len(parent) != size:
        raise ValueError(f"parent hash must be {size} bytes, got {len(parent)}")
    return _digest(_ROOT_TAG if parent is None else _PARENT_TAG + parent, token_ids, extra_keys, algorithm)


def hash_tail(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] = (),
              algorithm: HashAlgorithm = "xxh3_128") -> BlockHash:
    """Hash of a *partial* block after `parent`: names a prefix that ends inside a block (a request
    end), tagged apart from full-block hashes so it never matches a full one."""
    return _digest(_TAIL_TAG + (parent or b""), token_ids, extra_keys, algorithm)


def block_hashes_for(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[object, ...] = (),
    start: list[BlockHash] | None = None,
    algorithm: HashAlgorithm = "xxh3_128",
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids``, as a new list. ``start`` holds already-computed
    hashes of leading blocks (not modified); only the remaining blocks are hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full = len(token_ids) // block_size
    hashes: list[BlockHash] = list(start) if start else []
    if len(hashes) > num_full:
        raise ValueError(
            f"start has {len(hashes)} hashes but token_ids has only {num_full} full blocks"
        )
    parent = hashes[-1] if hashes else None
    first = len(hashes)
    if first == num_full:
        return hashes
    # Same byte stream as `hash_block`, but the tokens and extra keys are encoded once for all blocks.
    tokens = _encode_tokens(token_ids[first * block_size: num_full * block_size])
    count = struct.pack("<Q", block_size)
    extra = encode_extra_keys(extra_keys)
    digest = _one_shot(algorithm)
    width = 8 * block_size
    for offset in range(8, len(tokens), width):
        parent = digest((_ROOT_TAG if parent is None else _PARENT_TAG + parent)
                        + count + tokens[offset:offset + width] + extra)
        hashes.append(parent)
    return hashes


_NO_TAILS: dict[BlockHash, int] = {}


def check_index(index: int, size: int, what: str) -> int:
    """``index`` if it lies in [0, size), else ``IndexError`` naming ``what``."""
    if not 0 <= index < size:
        raise IndexError(f"{what} {index} out of range [0, {size})")
    return index


def check_free_list(free: Iterable[int], is_free: Iterable[bool], what: str) -> None:
    """Integrity check: ``free`` lists each id whose ``is_free`` flag is set, once, and no other."""
    assert sorted(free) == [index for index, flag in enumerate(is_free) if flag], f"{what} free list out of step"


class BlockPoolStats(NamedTuple):
    """Snapshot of :class:`BlockPool` occupancy and counters."""

    total: int
    used: int
    free: int
    cached_free: int
    evictions: int
    hash_entries: int
    touched: int
    registered: int


class BlockPool:
    """Reference-counted, content-addressed pool of ``num_blocks`` KV block ids: a block is on the LRU
    free list iff its ref count is 0, and a free block that still holds a hash is *cached* (matchable
    until reallocated); one block per hash. ``on_evict(hash)`` hears every hash dropped when a
    cached block is reclaimed (before its hash is dropped), so state keyed by that prefix (a GDN snapshot) can
    go with it or be copied down a tier."""

    def __init__(self, num_blocks: int, on_evict: Callable[[BlockHash], None] | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_count: list[int] = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # LRU order: first = least recently freed (evicted first), last = MRU.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._index: dict[BlockHash, int] = {}
        # Tails: hash -> (parent hash or b"" at the root, tokens); parent -> {hash: tokens}.
        self._tail_of: dict[BlockHash, tuple[BlockHash, int]] = {}
        self._tails: dict[BlockHash, dict[BlockHash, int]] = {}
        self.on_evict = on_evict
        self.num_cached_free_blocks = 0  # free blocks that still hold a hash (matchable until reallocated)
        self.num_evictions = 0
        self.num_touched = 0
        self.num_registered = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_count == 0`` (including cached ones: they are reclaimable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ``ref_count > 0``."""
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of ``block_id``."""
        return self._ref_count[self._check_id(block_id)]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """Hash held by ``block_id`` (``None`` if unregistered or evicted)."""
        return self._block_hash[self._check_id(block_id)]

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks can be allocated now (cached free blocks included)."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh blocks (``ref_count`` 1), oldest-freed first, evicting the hashes of
        reclaimed cached blocks; all or nothing (``RuntimeError`` if fewer than ``n`` are free)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: requested {n}, free {len(self._free)}")
        out: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            evicted = self._block_hash[block_id]
            if evicted is not None:
                if self.on_evict is not None:
                    self.on_evict(evicted)  # the block still holds the hash (a lower tier may copy it)
                self.num_cached_free_blocks -= 1
                self._drop_hash(block_id)
                self.num_evictions += 1
            self._ref_count[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a fork); a free cached block
        leaves the free list. Touching a free block without a hash (meaningless content) raises."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_count[block_id] == 0 and self._block_hash[block_id] is None:
                raise ValueError(f"touch of free, uncached block {block_id}")
        for block_id in block_ids:
            if self._ref_count[block_id] == 0:
                del self._free[block_id]
                if self._block_hash[block_id] is not None:
                    self.num_cached_free_blocks -= 1
            self._ref_count[block_id] += 1
            self.num_touched += 1

    def free(self, block_ids: Sequence[int], evict_first: bool = False) -> None:
        """Drop one reference on each block; blocks reaching 0 go to the MRU end (pass a request's
        blocks tail first), keeping their hash, or with ``evict_first`` to the LRU *front* (blocks a
        policy judges worth little). Dropping a reference that does not exist raises ``ValueError``."""
        counts = Counter(block_ids) if len(set(block_ids)) != len(block_ids) else dict.fromkeys(block_ids, 1)
        for block_id, count in counts.items():
            if self._ref_count[self._check_id(block_id)] < count:
                raise ValueError(f"double free of block {block_id}")
        for block_id in (reversed(block_ids) if evict_first else block_ids):
            self._ref_count[block_id] -= 1
            if self._ref_count[block_id] == 0:
                self._free[block_id] = None
                if evict_first:
                    self._free.move_to_end(block_id, last=False)
                if self._block_hash[block_id] is not None:
                    self.num_cached_free_blocks += 1

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a full, computed, in-use block matchable under ``block_hash``; ``False`` when another
        block already holds the hash (this one stays unhashed). A different hash on a hashed block,
        or a free block, raises ``ValueError``."""
        self._check_id(block_id)
        if self._ref_count[block_id] == 0:
            raise ValueError(f"register of free block {block_id}")
        current = self._block_hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already holds a different hash")
            return True
        if block_hash in self._index:
            return False
        self._block_hash[block_id] = block_hash
        self._index[block_hash] = block_id
        self.num_registered += 1
        return True

    def register_tail(self, block_id: int, tail_hash: BlockHash, parent: BlockHash | None, num_tokens: int) -> bool:
        """Make a partial, computed, in-use block matchable as the `num_tokens`-token tail after
        `parent` (``None`` at the root). The block must never be written again: whoever extends
        the prefix copies it first (copy-on-write). Same return and errors as :meth:`register`."""
        if not 0 < num_tokens:
            raise ValueError(f"a tail holds at least one token, got {num_tokens}")
        if not self.register(block_id, tail_hash):
            return False
        if tail_hash not in self._tail_of:
            parent_key = parent or b""
            self._tail_of[tail_hash] = (parent_key, num_tokens)
            self._tails.setdefault(parent_key, {})[tail_hash] = num_tokens
        return True

    def tails_after(self, parent: BlockHash | None) -> dict[BlockHash, int]:
        """Registered tails following `parent` (``None``: the root), as {tail hash: tokens}.
        Read-only view; empty when there are none."""
        return self._tails.get(parent or b"", _NO_TAILS)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Block currently holding ``block_hash`` (in use or free-cached), else ``None``."""
        return self._index.get(block_hash)

    def holds_all(self, hashes: Iterable[BlockHash]) -> bool:
        """Whether a block holds each of `hashes` now (in use or free-cached); no references taken."""
        return all(map(self._index.__contains__, hashes))

    def longest_cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids for the longest run of leading ``hashes`` that are all present (no references
        taken: :meth:`touch` them)."""
        out: list[int] = []
        for block_hash in hashes:
            block_id = self._index.get(block_hash)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def evict_all_cached(self) -> int:
        """Drop the hashes of all free blocks (in-use ones keep theirs); returns how many."""
        dropped = 0
        for block_id in self._free:
            if self._block_hash[block_id] is not None:
                self._drop_hash(block_id)
                dropped += 1
        self.num_cached_free_blocks = 0
        return dropped

    def reset_prefix_cache(self) -> int:
        """Alias of :meth:`evict_all_cached`."""
        return self.evict_all_cached()

    def stats(self) -> BlockPoolStats:
        """Current occupancy and counters."""
        return BlockPoolStats(total=self.num_blocks, used=self.num_used_blocks, free=self.num_free_blocks,
                              cached_free=self.num_cached_free_blocks, evictions=self.num_evictions,
                              hash_entries=len(self._index), touched=self.num_touched,
                              registered=self.num_registered)

    def check_integrity(self) -> None:
        """Verify every invariant; raises ``AssertionError`` on any inconsistency."""
        assert min(self._ref_count) >= 0, "negative ref_count"
        check_free_list(self._free, [ref == 0 for ref in self._ref_count], "block")
        hashed = [(block_id, h) for block_id, h in enumerate(self._block_hash) if h is not None]
        assert all(self._index.get(h) == block_id for block_id, h in hashed), "the index maps a hash elsewhere"
        assert len(hashed) == len(self._index), "hash index size != hashed blocks"
        cached_free = sum(block_id in self._free for block_id, _ in hashed)
        assert cached_free == self.num_cached_free_blocks, f"cached-free count != {cached_free}"
        for tail_hash, (parent_key, num_tokens) in self._tail_of.items():
            assert tail_hash in self._index, "tail index lists a hash no block holds"
            assert self._tails[parent_key][tail_hash] == num_tokens, "tail index out of step"
        assert sum(map(len, self._tails.values())) == len(self._tail_of), "stale tail entries"

    def _check_id(self, block_id: int) -> int:
        return check_index(block_id, self.num_blocks, "block id")

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        assert block_hash is not None
        del self._index[block_hash]
        self._block_hash[block_id] = None
        tail = self._tail_of.pop(block_hash, None)
        if tail is not None:
            siblings = self._tails[tail[0]]
            del siblings[block_hash]
            if not siblings:
                del self._tails[tail[0]]

    def __repr__(self) -> str:
        """Short summary for debugging."""
        s = self.stats()
        return f"BlockPool(total={s.total}, used={s.used}, free={s.free}, cached_free={s.cached_free}, " \
            f"evictions={s.evictions})"
