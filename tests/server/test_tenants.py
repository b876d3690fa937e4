"""Tenant isolation: several API keys, each key's requests salted with its identity; the
SHA-256 block hash option. CPU, float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridserve.engine.async_engine import AsyncLLMEngine
from hybridserve.engine.engine import LLMEngine
from hybridserve.server.app import build_app
from hybridserve.server.auth import ApiKeyring, read_key_file, tenant_cache_salt, tenant_id
from hybridserve.server.cli import api_keys_from, build_parser
from tests.helpers.live_server import ServerThread, random_ids

KEYS = ("key-of-tenant-a", "key-of-tenant-b")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerThread]:
    config = EngineConfig(device="cpu", dtype="float32",
                          cache=CacheConfig(kv_cache_mib=16, prefix_cache_mib=16, snapshot_interval=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512))
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting_requests=16)
    with ServerThread(build_app(engine, model_name="tiny", api_keys=list(KEYS))) as server:
        yield server
    engine.shutdown()


def _cached(server: ServerThread, key: str, prompt: list[int], salt: str | None = None) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_keys_with_identical_prompts_never_share_cached_tokens(keyed_server: ServerThread) -> None:
    prompt = random_ids(901, 200)
    assert _cached(keyed_server, KEYS[0], prompt) == 0
    assert _cached(keyed_server, KEYS[0], prompt) == 192      # the same tenant hits its own cache
    assert _cached(keyed_server, KEYS[1], prompt) == 0        # the other tenant does not
    assert _cached(keyed_server, KEYS[1], prompt) == 192
    # a client cache_salt is combined with the tenant, never replacing it
    assert _cached(keyed_server, KEYS[0], prompt, salt="shared") == 0
    assert _cached(keyed_server, KEYS[1], prompt, salt="shared") == 0
    assert _cached(keyed_server, KEYS[1], prompt, salt="shared") == 192


def test_every_key_is_accepted_and_others_refused(keyed_server: ServerThread) -> None:
    for key in KEYS:
        response = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
    refused = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": "Bearer key-of-tenant-c"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200  # not under /v1


def test_salt_combination_is_unambiguous() -> None:
    a, b = tenant_id("a"), tenant_id("b")
    assert len(a) == 32 and a != b and a == tenant_id("a")  # a stable digest, not the key
    assert tenant_cache_salt(None, None) is None and tenant_cache_salt(None, "s") == "client:s"
    # a client-only salt lives in its own namespace: spelling a tenant's salt (alone or combined)
    # never lands in that tenant's namespace
    forged = [tenant_cache_salt(None, f"tenant:{a}"), tenant_cache_salt(None, f"tenant:{a}:salt:x")]
    salts = {tenant_cache_salt(a, None), tenant_cache_salt(a, "x"), tenant_cache_salt(b, "x"),
             tenant_cache_salt(a, ""), *forged}
    assert len(salts) == 6
    assert all(salt is not None and not salt.startswith("tenant:") for salt in forged)
    ring = ApiKeyring(KEYS)
    assert ring.tenant_of(b"Bearer key-of-tenant-b") == tenant_id(KEYS[1])
    assert ring.tenant_of(b"Bearer key-of-tenant-") is None
    with pytest.raises(ValueError, match="non-empty"):
        ApiKeyring([" padded "])


def test_keys_from_flags_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# tenants\nfile-key-1\n\n  file-key-2  \n")
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="accessible to group or others.*chmod 600"):
        read_key_file(key_file)
    key_file.chmod(0o600)
    assert read_key_file(key_file) == ["file-key-1", "file-key-2"]
    args = build_parser().parse_args(["--api-key", "k1", "--api-key", "k2", "--api-key-file", str(key_file)])
    assert api_keys_from(args) == ["k1", "k2", "file-key-1", "file-key-2"]
    monkeypatch.setenv("HYBRIDSERVE_API_KEY", "from-env")
    assert api_keys_from(build_parser().parse_args([])) == ["from-env"]
    (tmp_path / "empty.txt").write_text("# nothing\n")
    (tmp_path / "empty.txt").chmod(0o400)
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(tmp_path / "empty.txt")


def test_sha256_block_hash(text_checkpoint: Path) -> None:
    llm = LLM(model=str(text_checkpoint), device="cpu", dtype="float32", kv_cache_mib=16, prefix_cache_mib=8,
              snapshot_interval=32, block_hash="sha256")
    prompt = random_ids(77, 100)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt], params)[0]
    assert warm.num_cached_tokens == 96 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    pool = llm.llm_engine.cache.block_pool
    hashes = [pool.block_hash(b) for b in range(pool.num_blocks) if pool.block_hash(b) is not None]
    assert hashes and all(len(h) == 32 for h in hashes)
    llm.llm_engine.check_integrity()
