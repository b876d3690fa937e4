"""Transfer links and the prefill rate `hybridserve sim` prices tier movement with (no torch, so the
command's flags can show the defaults). The defaults are assumptions, stated in docs/prefix-cache.md."""

from __future__ import annotations

from typing import NamedTuple


class Link(NamedTuple):
    """A copy path between the device and a lower tier: bytes per second and seconds per transfer."""

    bandwidth: float
    latency: float

    def seconds(self, nbytes: int) -> float:
        """Time to move `nbytes` in one transfer."""
        return self.latency + nbytes / self.bandwidth


HOST_LINK = Link(25e9, 10e-6)    # assumed: PCIe 5 x16 host <-> device from pinned memory
DISK_LINK = Link(5e9, 100e-6)    # assumed: one NVMe drive (PCIe 4 x4), the slower hop of disk -> device
PREFILL_FLOPS = 400e12           # assumed prefill FLOP/s of one H100/H200-class GPU (turns FLOPs into seconds)
