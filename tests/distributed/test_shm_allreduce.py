"""The shared-memory all-reduce of same-host CPU ranks (hybridserve/distributed/shm_allreduce.py)
against gloo: exact sums in rank order on every size (pieces smaller and larger than a buffer),
the same bits on every rank, bfloat16 and int32 MIN/MAX, hundreds of calls in a row, the region
unlinked after set-up, the fallbacks, and a clean error instead of a hang when the ranks are out of step.

Importing torch costs each process seconds, so the checks run in one spawn of three ranks, on all
three and then on a group of two; a failed check raises in its rank and
`torch.multiprocessing.spawn` re-raises it here.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import shutil
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridserve.distributed import shm_allreduce
from hybridserve.distributed.executor import free_port
from hybridserve.distributed.shm_allreduce import CONTROL, SHM_ALLREDUCE_ENV, ShmAllReduce, ShmAllReduceError

HAVE_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None
CPU = torch.device("cpu")
SMALL_SLOT = 4096  # bytes per buffer: 1024 float32 or 2048 bfloat16 elements per piece
TIMEOUT_S = 60.0


def _gather(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _rank_order_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum the shm all-reduce must produce: the ranks' tensors added in rank order 0..N-1
    (bfloat16 in float32, rounded once)."""
    parts = _gather(x, group)
    total = parts[0].float() if x.dtype == torch.bfloat16 else parts[0].clone()
    for part in parts[1:]:
        total += part.float() if x.dtype == torch.bfloat16 else part
    return total.to(x.dtype)


def _check_sum(shm: ShmAllReduce, x: torch.Tensor, group: Any) -> None:
    expected = _rank_order_sum(x, group)
    via_gloo = x.clone()
    dist.all_reduce(via_gloo, group=group)
    got = shm.all_reduce(x.clone())
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, expected), f"{tuple(x.shape)} {x.dtype}: not the rank-order sum"
    tolerance = {}
    if x.dtype == torch.bfloat16:  # gloo rounds to bfloat16 after each addition: a few ulps of the magnitude
        magnitude = torch.stack([part.float().abs() for part in _gather(x, group)]).sum(0).max().item()
        tolerance = {"rtol": 0.0, "atol": dist.get_world_size(group) * 2 ** -8 * magnitude}
    torch.testing.assert_close(got, via_gloo, **tolerance)
    for part in _gather(got, group):  # the same bits on every rank
        assert torch.equal(part, got)


TIMED_OUT, MISMATCH, ABORTED = (shm_allreduce._ERRORS[code] for code in (-1, -2, -4))


def _expect_error(call: Callable[[], Any], *reasons: str) -> str:
    """`call` raises ShmAllReduceError for one of `reasons` (the C side's return code, as text),
    which says why it failed: a peer's abort or a mismatch fails at once, only a peer that never
    comes costs the timeout. Returns the error's message."""
    with pytest.raises(ShmAllReduceError) as error:
        call()
    message = str(error.value)
    del error  # the traceback's frames hold the caller's group: no cycle keeps it past its destruction
    assert message.endswith(reasons), message
    return message


def _checks(group: Any) -> None:
    """Every check, on the ranks of `group` (a gloo group)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(rank)
    shm = ShmAllReduce.setup(group, CPU, TIMEOUT_S, slot_bytes=SMALL_SLOT)
    assert shm is not None and shm.world_size == world
    dist.barrier(group=group)  # rank 0 unlinks the region before its set-up returns
    assert not os.path.exists(shm.path), "rank 0 unlinks the region once every rank mapped it"
    paths: list = [None] * world
    dist.all_gather_object(paths, shm.path, group=group)
    assert len(set(paths)) == 1

    for size in (1, 2, 7, 1023, 1024, 1025, 3000, 4099):  # 1024 float32 fit one buffer
        _check_sum(shm, torch.randn(size, generator=generator) * 10.0 ** rank, group)
    _check_sum(shm, torch.randn(3, 5, generator=generator), group)
    _check_sum(shm, torch.randn(40, 70, generator=generator).t(), group)  # not contiguous
    for size in (1, 2047, 2048, 2049, 5000):                              # 2048 bfloat16 fit one buffer
        _check_sum(shm, (torch.randn(size, generator=generator) * 100).to(torch.bfloat16), group)
    _check_sum(shm, torch.randint(-2**31, 2**31 - 1, (1500,), dtype=torch.int32, generator=generator), group)

    for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        for size in (1, 5, 1500):
            flags = torch.randint(-1000, 1000, (size,), dtype=torch.int32, generator=generator)
            via_gloo = flags.clone()
            dist.all_reduce(via_gloo, op=op, group=group)
            assert torch.equal(shm.all_reduce(flags, op=op, tag=CONTROL), via_gloo)

    for i in range(400):  # sequence numbers and buffer parity over many calls, pieces of every size
        size = (1, 1500, 3, 2049)[i % 4]
        got = shm.all_reduce(torch.full((size,), float(rank + i)), tag=i % 2)
        assert torch.equal(got, torch.full((size,), float(sum(r + i for r in range(world)))))

    for x, op in ((torch.randn(9, dtype=torch.float64, generator=generator), dist.ReduceOp.SUM),
                  (torch.randn(9, generator=generator), dist.ReduceOp.MIN)):  # not in C: through gloo
        via_gloo = x.clone()
        dist.all_reduce(via_gloo, op=op, group=group)
        assert torch.equal(shm.all_reduce(x, op=op, group=group), via_gloo)
    shm.close()

    default = ShmAllReduce.setup(group, CPU, TIMEOUT_S)  # 1 MiB buffers: 300k floats take two pieces
    assert default is not None
    _check_sum(default, torch.randn(300_000, generator=generator), group)
    default.close()

    if rank == world - 1:  # one rank opts out: every rank falls back
        os.environ[SHM_ALLREDUCE_ENV] = "0"
    assert ShmAllReduce.setup(group, CPU, TIMEOUT_S) is None
    os.environ.pop(SHM_ALLREDUCE_ENV, None)
    real_identity = shm_allreduce.host_identity
    if rank == 1:  # a rank on another host: every rank falls back
        shm_allreduce.host_identity = lambda: ("elsewhere", "another boot")
    assert ShmAllReduce.setup(group, CPU, TIMEOUT_S) is None
    shm_allreduce.host_identity = real_identity

    # Out of step: different sizes, then different tags, fail on every rank instead of mixing data.
    for sizes_differ in (True, False):
        mixed = ShmAllReduce.setup(group, CPU, TIMEOUT_S, slot_bytes=SMALL_SLOT)
        assert mixed is not None
        size, tag = (4 if rank == 0 and sizes_differ else 5), (CONTROL if rank == 0 and not sizes_differ else 0)
        first = _expect_error(lambda: mixed.all_reduce(torch.ones(size), tag=tag), MISMATCH, ABORTED)
        # Broken from now on: the next call fails with the same reason, without entering the channel.
        assert _expect_error(lambda: mixed.all_reduce(torch.ones(size), tag=tag), MISMATCH, ABORTED) == first
        assert mixed.broken == first
        mixed.close()
        dist.barrier(group=group)

    # A peer that never comes: a timeout on rank 0, which also aborts the channel for the others.
    lonely = ShmAllReduce.setup(group, CPU, 0.5, slot_bytes=SMALL_SLOT)
    assert lonely is not None
    if rank == 0:
        _expect_error(lambda: lonely.all_reduce(torch.ones(3)), TIMED_OUT)
    dist.barrier(group=group)
    if rank != 0:
        _expect_error(lambda: lonely.all_reduce(torch.ones(3)), ABORTED)
    lonely.close()

    # A peer that closed its end (a worker exiting): the others fail at once, not after the timeout.
    closing = ShmAllReduce.setup(group, CPU, TIMEOUT_S, slot_bytes=SMALL_SLOT)
    assert closing is not None
    if rank == 1:
        closing.close()
    dist.barrier(group=group)
    if rank != 1:
        _expect_error(lambda: closing.all_reduce(torch.ones(3)), ABORTED)
        closing.close()


def _run(rank: int, port: int) -> None:
    """One of three ranks: every check on all three, then on a group of ranks 0 and 1.

    A rank that passed ends with `os._exit(0)` once its groups are destroyed: gloo backends that
    Python frees only at interpreter exit can abort the process there (pytorch/pytorch#190489),
    which is torch's teardown, not what this test checks. A failed check still raises, and a crash
    before the end prints every thread's Python stack (faulthandler) to the captured stderr."""
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=120))
    try:
        _checks(dist.group.WORLD)
        pair = dist.new_group([0, 1], backend="gloo")
        if rank < 2:
            _checks(pair)
        del pair
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()  # the backends go now, while the interpreter is whole
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler: the ranks all-reduce through gloo")
def test_shm_all_reduce_matches_gloo_on_every_rank() -> None:
    """Three ranks, then two of them in a subgroup (the worker's control group is one too)."""
    mp.spawn(_run, args=(free_port(),), nprocs=3)
