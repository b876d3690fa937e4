"""All-reduce through a /dev/shm region for the tensor-parallel CPU ranks of one host (protocol in
layers/csrc/shm_allreduce.c): SUM of float32, bfloat16 and int32, MIN/MAX of int32; others via gloo."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridserve import envs
from hybridserve.layers import native

logger = logging.getLogger(__name__)

SHM_ALLREDUCE_ENV = envs.SHM_ALLREDUCE.name
SHM_DIR = "/dev/shm"
SLOT_BYTES = 1 << 20           # per rank and buffer (two each): a larger tensor is reduced in pieces
FORWARD, CONTROL = 0, 1        # tags: the forward's activations, the step's agreement flags
MAGIC = 0x48534152_53484D31    # "HSARSHM1"
_HEADER = struct.Struct("<QQQQ")  # magic, token, world size, slot bytes (the C side's header words 0..31)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int32: 2}
_OPS = {dist.ReduceOp.SUM: 0, dist.ReduceOp.MIN: 1, dist.ReduceOp.MAX: 2}
_ERRORS = {-1: "timed out waiting for another rank", -2: "the ranks called different all-reduces",
           -3: "invalid arguments", -4: "another rank aborted the shared-memory all-reduce"}


class ShmAllReduceError(RuntimeError):
    """A peer timed out, died or called a different all-reduce: the channel is unusable from now on."""


def _functions() -> tuple[Any, Any, Any] | None:
    """(shm_allreduce, shm_allreduce_region_bytes, shm_allreduce_abort) of the kernels library, or None."""
    library = native._library()
    if library is None:
        return None
    return library.shm_allreduce, library.shm_allreduce_region_bytes, library.shm_allreduce_abort


def host_identity() -> tuple[str, str]:
    """What ranks on the same host share: hostname and kernel boot id."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


def _local_obstacle(device: torch.device) -> str | None:
    """Why this rank cannot use the shared-memory all-reduce, or None."""
    if not envs.shm_allreduce():
        return f"{SHM_ALLREDUCE_ENV}=0"
    if device.type != "cpu":
        return f"device {device}"
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return f"{SHM_DIR} is not a writable directory"
    if not host_identity()[1]:
        return "no boot id to check that the ranks share a host"
    if _functions() is None:
        return "the C kernels library is unavailable"
    return None


class ShmAllReduce:
    """One rank's end of the shared-memory all-reduce (create it with the collective `setup`)."""

    def __init__(self, path: str, token: int, rank: int, world_size: int, slot_bytes: int, timeout_s: float) -> None:
        """Map the region rank 0 created at `path` and check it is the one of this group (`token`)."""
        functions = _functions()
        if functions is None:
            raise ShmAllReduceError("the C kernels library is unavailable")
        self._reduce, region_bytes, self._abort = functions
        self.path, self.rank, self.world_size, self.slot_bytes = path, rank, world_size, slot_bytes
        self.timeout_ns = int(timeout_s * 1e9)
        self.broken: str | None = None
        size = region_bytes(world_size, slot_bytes)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ShmAllReduceError(f"{path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if _HEADER.unpack_from(self._map, 0) != (MAGIC, token, world_size, slot_bytes):
            self._map.close()
            raise ShmAllReduceError(f"{path} is not this group's region (another /dev/shm?)")
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self._base = ctypes.addressof(self._anchor)

    @classmethod
    def setup(cls, group: Any, device: torch.device, timeout_s: float,
              slot_bytes: int = SLOT_BYTES) -> ShmAllReduce | None:
        """Collective: the shared-memory all-reduce if every rank can use it, else None (rank 0 logs why)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, (host_identity(), _local_obstacle(device)), group=group)
        obstacles = sorted({f"rank {r}: {why}" for r, (_, why) in enumerate(reports) if why})
        if len({identity for identity, _ in reports}) > 1:
            obstacles.append("the ranks are not all on this host")
        if obstacles:
            if rank == 0:
                logger.info("tensor-parallel all-reduce: gloo (shared memory not used: %s)", "; ".join(obstacles))
            return None
        box: list[Any] = [None]
        if rank == 0:
            box[0] = _create_region(world, slot_bytes)
        dist.broadcast_object_list(box, group=group, group_src=0)
        path, token = box[0]
        shm, error = None, path if token is None else None  # without a token, `path` is rank 0's error
        try:
            if token is not None:
                shm = cls(path, token, rank, world, slot_bytes, timeout_s)
        except (OSError, ValueError, ShmAllReduceError) as exc:
            error = f"rank {rank}: {exc}"
        errors: list[Any] = [None] * world
        dist.all_gather_object(errors, error, group=group)  # the barrier: every rank has mapped it (or failed)
        if rank == 0 and token is not None:
            _unlink(path)
        failed = [e for e in errors if e]
        if failed:
            if shm is not None:
                shm.close()
            if rank == 0:
                logger.warning("tensor-parallel all-reduce: gloo (shared memory failed: %s)", "; ".join(failed))
            return None
        if rank == 0:
            logger.info("tensor-parallel all-reduce: shared memory (%d ranks, %d KiB per rank and buffer)",
                        world, slot_bytes >> 10)
        return shm

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, tag: int = FORWARD,
                   group: Any = None) -> torch.Tensor:
        """Reduce `tensor` over the ranks in place; ShmAllReduceError once they are out of step, and after."""
        dtype, code = tensor.dtype, _OPS.get(op)
        if code is None or (code != 0 and dtype != torch.int32) or dtype not in _DTYPES or not tensor.is_cpu:
            dist.all_reduce(tensor, op=op, group=group)
            return tensor
        if self.broken is not None:
            raise ShmAllReduceError(self.broken)
        target = tensor if tensor.is_contiguous() else tensor.contiguous()
        rc = self._reduce(self._base, self.world_size, self.rank, self.slot_bytes, target.data_ptr(),
                          target.numel(), _DTYPES[dtype], code, tag, self.timeout_ns)
        if rc != 0:
            self.broken = (f"rank {self.rank}: shared-memory all-reduce of {tuple(tensor.shape)} {dtype} failed: "
                           f"{_ERRORS.get(rc, rc)}")
            raise ShmAllReduceError(self.broken)
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    def close(self) -> None:
        """Unmap the region, first marking it aborted so a peer still waiting fails at once."""
        if self._map.closed:
            return
        self._abort(self._base)
        self.broken = f"rank {self.rank}: the shared-memory all-reduce was closed"
        del self._anchor
        self._map.close()


def _create_region(world: int, slot_bytes: int) -> tuple[str, int | None]:
    """Rank 0: create and allocate the region (a full /dev/shm fails here, not with SIGBUS later)."""
    functions = _functions()
    if functions is None:
        return "rank 0: the C kernels library is unavailable", None
    size = functions[1](world, slot_bytes)
    token = int.from_bytes(os.urandom(8), "little")
    path = ""
    try:
        fd, path = tempfile.mkstemp(prefix="hybridserve-allreduce-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, _HEADER.pack(MAGIC, token, world, slot_bytes), 0)
        finally:
            os.close(fd)
    except OSError as exc:
        if path:
            _unlink(path)
        return f"rank 0: cannot create {size} bytes under {SHM_DIR}: {exc}", None
    return path, token


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
