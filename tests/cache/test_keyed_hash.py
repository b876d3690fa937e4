"""The engine's default block hash is keyed by a secret seed, stable only where it must be."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from hybridserve.cache.block_pool import (
    SEED_FILE_NAME,
    KeyedHash,
    block_hash_key_id,
    block_hashes_for,
    engine_block_hash,
    hash_block,
    hash_tail,
    parse_seed,
)
from hybridserve.engine_args import add_engine_arguments, engine_config_from_args

TOKENS = list(range(64))


@pytest.fixture(autouse=True)
def no_seed_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDSERVE_BLOCK_HASH_SEED", raising=False)


def test_keyed_hash_differs_from_unkeyed_and_by_seed() -> None:
    unkeyed = block_hashes_for(TOKENS, 16)
    first, second = KeyedHash(1), KeyedHash(2)
    keyed = block_hashes_for(TOKENS, 16, algorithm=first)
    assert keyed != unkeyed and keyed != block_hashes_for(TOKENS, 16, algorithm=second)
    assert keyed == block_hashes_for(TOKENS, 16, algorithm=KeyedHash(1))
    assert len(keyed[0]) == 16


def test_keyed_chain_matches_block_by_block_and_tails() -> None:
    keyed = KeyedHash(0xDEADBEEF)
    chain = block_hashes_for(TOKENS, 16, ("tenant:a",), algorithm=keyed)
    parent = None
    for i, expected in enumerate(chain):
        parent = hash_block(parent, TOKENS[16 * i:16 * (i + 1)], ("tenant:a",), keyed)
        assert parent == expected
    assert hash_tail(chain[0], TOKENS[:5], (), keyed) != hash_tail(chain[0], TOKENS[:5], ())


def test_repr_hides_the_seed() -> None:
    assert "12345" not in repr(KeyedHash(12345)) and "12345" not in KeyedHash(12345).key_id()


def test_engine_default_is_keyed_and_random_per_start() -> None:
    first, second = engine_block_hash("xxh3_128"), engine_block_hash("xxh3_128")
    assert isinstance(first, KeyedHash) and isinstance(second, KeyedHash)
    assert first.seed != second.seed
    assert engine_block_hash("sha256") == "sha256"
    assert block_hash_key_id("xxh3_128") is None


def test_seed_from_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_block_hash("xxh3_128", 7) == KeyedHash(7)
    monkeypatch.setenv("HYBRIDSERVE_BLOCK_HASH_SEED", "0x10")
    assert engine_block_hash("xxh3_128") == KeyedHash(16)
    assert engine_block_hash("xxh3_128", 7) == KeyedHash(7)  # the flag wins
    assert block_hash_key_id("xxh3_128") == KeyedHash(16).key_id()
    monkeypatch.setenv("HYBRIDSERVE_BLOCK_HASH_SEED", "not a number")
    with pytest.raises(ValueError, match="integer"):
        engine_block_hash("xxh3_128")
    with pytest.raises(ValueError, match="64-bit"):
        parse_seed(str(1 << 64))


def test_disk_tier_keeps_its_seed_in_a_private_file(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = engine_block_hash("xxh3_128", disk_cache_dir=str(disk))
    again = engine_block_hash("xxh3_128", disk_cache_dir=str(disk))
    assert isinstance(first, KeyedHash) and first == again  # survives a restart
    seed_file = disk / SEED_FILE_NAME
    assert stat.S_IMODE(seed_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(disk.stat().st_mode) & 0o077 == 0
    assert block_hash_key_id("xxh3_128", disk_cache_dir=str(disk)) == first.key_id()
    assert engine_block_hash("xxh3_128", disk_cache_dir=str(tmp_path / "other")) != first


def test_loose_seed_file_is_refused(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    engine_block_hash("xxh3_128", disk_cache_dir=str(disk))
    os.chmod(disk / SEED_FILE_NAME, 0o644)
    with pytest.raises(ValueError, match="0600"):
        engine_block_hash("xxh3_128", disk_cache_dir=str(disk))


def test_seed_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--block-hash-seed", "0xff"])
    assert engine_config_from_args(args).cache.block_hash_seed == 255


def test_bad_seed_flag_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-hash-seed", "-1"])
    assert "64-bit" in capsys.readouterr().err
