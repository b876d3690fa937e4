"""Logical allocator of live GDN state slots (one per running request)."""

from __future__ import annotations

from hybridserve.cache.block_pool import check_free_list


class StateSlotPool:
    """Free list of live-state slot indices; O(1) allocate and free."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot; raises RuntimeError when none is left (callers check first)."""
        if not self._free:
            raise RuntimeError("no free GDN state slot")
        slot = self._free.pop()
        self._in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return a slot; freeing a slot that is not in use is a bug."""
        if slot not in self._in_use:
            raise ValueError(f"state slot {slot} is not in use")
        self._in_use.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        """Every slot is exactly once either free or in use."""
        check_free_list(self._free, [slot not in self._in_use for slot in range(self.num_slots)], "state slot")
