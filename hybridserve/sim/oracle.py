"""The clairvoyant reference row of `hybridserve sim --oracle` (Belady's MIN over snapshot restores;
docs/prefix-cache.md, Simulator): a reference, not a bound (that is `bound.py`)."""

from __future__ import annotations

import math
from bisect import bisect_right

from hybridserve.cache.block_pool import BlockHash
from hybridserve.cache.snapshots import Reservation, ReserveStatus, SnapshotPool
from hybridserve.sim.shapes import ModelShape
from hybridserve.sim.simulator import AccountingRun, SimConfig, SimResult, simulate
from hybridserve.sim.trace import TraceTokens

ORACLE = "oracle"
LEARNING_POLICY = "hybridserve"  # the admission whose candidates the oracle filters

RestoreTimes = dict[BlockHash, list[int]]  # snapshot key -> replay positions (ascending) of the requests restoring it


class _ReplayPool(SnapshotPool):
    """A snapshot pool that knows which request of the replay is being served."""

    position = 0

    def at_request(self, position: int) -> None:
        """The replay is about to serve its `position`-th request."""
        self.position = position


class RestoreRecorder(_ReplayPool):
    """A snapshot pool that notes which request restores each key (the learning replay)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.restores: RestoreTimes = {}

    def record_hit(self, key: BlockHash) -> None:
        super().record_hit(key)
        self.restores.setdefault(key, []).append(self.position)


class OracleSnapshotPool(_ReplayPool):
    """A snapshot pool that admits only states restored later and evicts the one restored last."""

    def __init__(self, num_slots: int, restores: RestoreTimes) -> None:
        super().__init__(num_slots)
        self._restores = restores

    def next_restore(self, key: BlockHash) -> int | None:
        """Position of the next request after the current one that restores `key` (None: none)."""
        times = self._restores.get(key)
        if not times:
            return None
        index = bisect_right(times, self.position)
        return times[index] if index < len(times) else None

    def reserve(self, key: BlockHash, num_tokens: int, parent: BlockHash | None = None,
                opportunistic: bool = False, branch: bool = False) -> Reservation:
        """As `SnapshotPool.reserve`, but a state no later request restores is skipped, and one that
        is restored is admitted even where the policy asked for an opportunistic slot."""
        if key not in self._published and key not in self._reserved:
            upcoming = self.next_restore(key)
            if upcoming is None or (not self.num_free_slots and upcoming > self._furthest()[1]):
                self.skipped_total += 1  # never restored, or after everything it would displace
                return Reservation(ReserveStatus.SKIPPED, None, key, num_tokens)
        return super().reserve(key, num_tokens, parent, opportunistic=False, branch=branch)

    def furthest_next_restore(self, pool: SnapshotPool) -> int | None:
        """Belady's choice: an evictable slot never restored again, else the one restored last."""
        return self._furthest()[0]

    def _furthest(self) -> tuple[int | None, float]:
        """The evictable slot whose next restore lies furthest ahead, and when (inf: never; -1
        with no slot: nothing evictable)."""
        best_slot, best_time = None, -1.0
        for slot in self.evictable():
            time = self.next_restore(self.key_of(slot))
            if time is None:
                return slot, math.inf
            if time > best_time:
                best_slot, best_time = slot, time
        return best_slot, best_time


def learn_restores(tokens: TraceTokens, shape: ModelShape, config: SimConfig, progress: bool = False) -> RestoreTimes:
    """Replay under `config`'s KV budget with `hybridserve`'s admission and a pool that never
    evicts a snapshot; which requests restored each key."""
    # More slots than the replay can reserve: per request at most one per interval crossed, plus
    # its prompt mark, branch point and end.
    slots = sum((r.input_length + r.output_length) // config.interval + 3 for r in tokens.records) + 1
    learning = config._replace(policy=LEARNING_POLICY, snapshot_bytes=slots * shape.cost.snapshot_bytes)
    run = AccountingRun(learning, shape, snapshot_pool=RestoreRecorder)
    recorder = run.snapshots
    assert isinstance(recorder, RestoreRecorder)
    simulate(tokens, shape, learning, progress=progress, run=run, on_request=recorder.at_request)
    return recorder.restores


def simulate_oracle(tokens: TraceTokens, shape: ModelShape, config: SimConfig, restores: RestoreTimes,
                    progress: bool = False, check: bool = False) -> SimResult:
    """Replay under `config`'s budgets with the oracle pool (`restores` from `learn_restores` on
    the same requests and KV budget); the result is labelled policy "oracle"."""
    admission = config._replace(policy=LEARNING_POLICY)
    run = AccountingRun(admission, shape, snapshot_pool=lambda num_slots: OracleSnapshotPool(num_slots, restores))
    pool = run.snapshots
    assert isinstance(pool, OracleSnapshotPool)
    pool.choose_victim = pool.furthest_next_restore  # after the policy's binding, which set its own
    result = simulate(tokens, shape, admission, progress=progress, check=check, run=run, on_request=pool.at_request)
    return result._replace(config=config._replace(policy=ORACLE))
