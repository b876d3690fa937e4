"""CPU memory in anonymous mappings: weights in transparent huge pages (Linux; one region advised
MADV_HUGEPAGE before its first touch, THP's usual `madvise` mode, the large weight storages copied
into it one at a time; elsewhere nothing moves; docs/cpu-kernels.md says why), and cache pools whose
pages are committed only when first written.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

from hybridserve import envs

HUGE_PAGE_BYTES = 2 << 20
MIN_STORAGE_BYTES = 1 << 20  # smaller storages stay where they are (most of a page would be padding)
HUGE_PAGES_ENV = envs.HUGE_PAGES.name  # "0" keeps weights in torch's allocations
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ALIGN = 4096


def huge_pages_available() -> bool:
    """Whether advised memory can get transparent huge pages here (Linux, THP not `never`, not
    disabled by HYBRIDSERVE_HUGE_PAGES=0)."""
    if not envs.huge_pages() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `num_bytes`, 2 MiB aligned, in an anonymous mapping advised
    MADV_HUGEPAGE before its first touch (the tensor keeps the mapping alive)."""
    if num_bytes <= 0:
        raise ValueError(f"huge_page_buffer: num_bytes must be positive, got {num_bytes}")
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP in this kernel: ordinary pages, same contents
        pass
    return whole[start:start + num_bytes]


def zeros_touched_as_used(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose memory is committed page by page on first write: on CPU an anonymous mapping
    (the kernel hands out zero pages lazily), so a pool sized for the worst case costs only what
    is used; elsewhere `torch.zeros`."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def move_to_huge_pages(tensors: Iterable[tuple[object, str, torch.Tensor]],
                       min_bytes: int = MIN_STORAGE_BYTES) -> int:
    """Copy the CPU storages of at least `min_bytes` behind `tensors` into one huge-page region and
    rebind each `(owner, attribute, tensor)` to its copy (a Parameter keeps its identity: its
    `.data` is replaced). Views of one storage stay views of one copy. Returns the bytes moved (0
    when huge pages are not available)."""
    by_storage: dict[int, list[tuple[object, str, torch.Tensor]]] = {}
    for owner, name, tensor in tensors:
        if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() >= min_bytes:
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append((owner, name, tensor))
    if not by_storage or not huge_pages_available():
        return 0
    arena = huge_page_buffer(sum(_aligned(slots[0][2].untyped_storage().nbytes()) for slots in by_storage.values()))
    offset = 0
    for key in list(by_storage):
        slots = by_storage.pop(key)  # nothing here holds the old storage once its tensors are rebound
        size = slots[0][2].untyped_storage().nbytes()
        arena[offset:offset + size].copy_(torch.empty(0, dtype=torch.uint8).set_(slots[0][2].untyped_storage()))
        for owner, name, tensor in slots:
            _rebind(owner, name, tensor, _view_at(arena, offset, tensor))
        del slots
        offset += _aligned(size)
    return offset


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


def _view_at(arena: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """`like`'s elements, laid out as in its storage, in the arena's bytes from `offset`."""
    element = like.element_size()
    start = arena.storage_offset() + offset
    return torch.empty(0, dtype=like.dtype).set_(arena.untyped_storage(), start // element + like.storage_offset(),
                                                 like.shape, like.stride())


def _rebind(owner: object, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    if isinstance(old, torch.nn.Parameter):
        old.data = new
    else:
        setattr(owner, name, new)
