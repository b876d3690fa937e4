"""The tensor-parallel rendezvous port is bound by the controller before any rank starts and held,
so no other process can take it between choosing and binding."""

from __future__ import annotations

import socket

import pytest

from hybridserve.config import EngineConfig
from hybridserve.distributed.executor import _rendezvous_store
from hybridserve.distributed.worker import LOCAL_RENDEZVOUS, STORE_SCHEME
from hybridserve.engine.worker import WorkerSpec
from hybridserve.models.builtin import BUILTIN_MODEL_CONFIG


def _specs(init_method: str) -> list[WorkerSpec]:
    return [WorkerSpec(rank, 2, init_method, EngineConfig(), BUILTIN_MODEL_CONFIG, 64, 1, "cpu", "float32", 16)
            for rank in range(2)]


def test_local_ranks_join_a_store_the_controller_holds() -> None:
    store, specs = _rendezvous_store(_specs(LOCAL_RENDEZVOUS))
    assert store is not None
    addresses = {spec.init_method for spec in specs}
    assert addresses == {f"{STORE_SCHEME}127.0.0.1:{store.port}"}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))  # the port is held, not merely chosen
    store.set("probe", "1")
    assert store.get("probe") == b"1"


def test_torchrun_specs_pass_through() -> None:
    store, specs = _rendezvous_store(_specs("env://"))
    assert store is None and all(spec.init_method == "env://" for spec in specs)
