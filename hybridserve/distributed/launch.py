"""Where the tensor-parallel ranks run: one `WorkerSpec` per local rank, spawned by the engine; under
`torchrun` `RANK` 0 becomes the controller and every other process its rank's worker."""

from __future__ import annotations

import os

import torch

from hybridserve.config import EngineConfig, ModelConfig
from hybridserve.distributed.sharding import validate_tensor_parallel
from hybridserve.distributed.worker import LOCAL_RENDEZVOUS, worker_main
from hybridserve.engine.threads import available_cores
from hybridserve.engine.worker import WorkerSpec


def distributed_env() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) from a torchrun-style environment, or None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def tensor_parallel_specs(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                          device: torch.device, dtype: torch.dtype, num_threads: int, chunk_size: int
                          ) -> list[WorkerSpec]:
    """Validate the plan (ValueError saying why, before any process starts) and return the specs of
    the ranks this process spawns; under torchrun a process of rank > 0 serves as its rank and exits."""
    world = config.tensor_parallel_size
    env = distributed_env()
    if env is not None and env[1] != world:
        raise ValueError(f"--tensor-parallel-size {world} differs from WORLD_SIZE={env[1]} in the environment")
    local_world = env[3] if env is not None else world
    num_devices = (torch.cuda.device_count() if device.type == "cuda" else available_cores())
    validate_tensor_parallel(model_config, world, device.type, num_devices if env is None else None)
    if env is not None and local_world > num_devices:
        raise ValueError(f"{local_world} ranks on this node but only {num_devices} {device.type} devices/cores")
    threads = max(1, num_threads // local_world) if device.type == "cpu" else 1
    dtype_name = str(dtype).removeprefix("torch.")

    def spec(rank: int, local_rank: int, init_method: str) -> WorkerSpec:
        rank_device = f"cuda:{local_rank}" if device.type == "cuda" else str(device)
        return WorkerSpec(rank, world, init_method, config, model_config, max_model_len, threads, rank_device,
                          dtype_name, chunk_size, broadcast_commands=env is not None)

    if env is None:  # the executor binds the rendezvous store (port 0, held) and fills in its address
        return [spec(rank, rank, LOCAL_RENDEZVOUS) for rank in range(world)]
    rank, _, local_rank, _ = env
    if rank != 0:
        worker_main(spec(rank, local_rank, "env://"), None)
        raise SystemExit(0)
    return [spec(0, local_rank, "env://")]
