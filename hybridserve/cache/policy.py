"""Cache policies: which GDN states to snapshot (admission) and which to drop (eviction).

Tensor-free (positions, keys and pool metadata only), so the engine and `hybridserve sim` run the
same code. docs/prefix-cache.md tables the four policies: `interval`, `last-block`, `marconi` and
`hybridserve` (the default).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from hybridserve.cache.block_pool import BlockHash, BlockPool
from hybridserve.cache.snapshots import SnapshotPool
from hybridserve.config import POLICY_NAMES

if TYPE_CHECKING:
    from hybridserve.config import ModelConfig

__all__ = ["POLICY_NAMES", "CachePolicy", "KindRates", "PrefixCost", "RequestView", "make_policy"]
AGE_TURNOVERS = 16.0  # a snapshot's value halves after this many pool turnovers without use
EVICTION_WINDOW = 256  # value-based policies score this many least-recently-used candidates
TAIL_MARKS = 4  # interval marks this close to the prompt end (in intervals) are a kind of their own
RESTORES_COUNTED = 4  # restores of one snapshot its kind's rate counts (one hot prefix is not its kind)
KIND_HALF_LIFE = 4096.0  # publications; older evidence fades so kind rates follow the workload
KIND_PRIOR_WEIGHT = 8.0  # pseudo-publications of one restore each that every kind starts with
REUSE_GAPS_KEPT = 64  # branch-point reuses whose idle gaps set how long an idle one stays protected
GHOSTS_PER_SLOT = 64  # evicted branch points remembered by key, per slot (captured again: a reuse)
KIND_GAPS_KEPT = 256  # first-reuse idle gaps kept per candidate kind (`ReuseGaps`)
KIND_GAPS_NEEDED = 16  # gaps a kind needs before its own reuse curve replaces the age horizon
FIRST_RATE_MAX = 0.95  # at most this share of a kind's snapshots counts as wanted (`ReuseGaps.first_rate`)
# Where a conversation left off: a restored one is wanted again as the conversation's turns come (a
# learned repeat curve); a restored shared prefix as often as it is popular (the age horizon).
CONTINUATION_KINDS = frozenset({"end", "resume"})
# A snapshot wanted within this many pool turnovers of its last use would still be in a pool that
# evicted the least recently used: if it was evicted, the eviction was premature.
PREMATURE_TURNOVERS = 1.0


class PrefixCost(NamedTuple):
    """What a cached prefix is worth and weighs, from the model shape."""

    linear_flops_per_token: float   # 2 x parameters touched per prompt token (no LM head)
    attention_flops_coeff: float    # causal attention FLOPs over b tokens = coeff * b^2
    kv_bytes_per_token: int
    snapshot_bytes: int

    @classmethod
    def from_model(cls, config: ModelConfig, kv_bytes_per_token: int, snapshot_bytes: int) -> PrefixCost:
        """Derive the costs of a Qwen3.5 decoder of this shape."""
        hidden = config.hidden_size
        attention = hidden * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) \
            + config.num_attention_heads * config.head_dim * hidden
        gdn = hidden * (2 * config.gdn_key_dim + 2 * config.gdn_value_dim + 2 * config.linear_num_value_heads) \
            + config.gdn_value_dim * hidden
        mlp = 3 * hidden * config.intermediate_size
        num_attn, num_gdn = len(config.attention_layer_ids), len(config.gdn_layer_ids)
        params = num_attn * attention + num_gdn * gdn + config.num_hidden_layers * mlp
        # Gated delta rule: ~4 state-sized products per token per layer (read, update, query, decay).
        gdn_state = num_gdn * 4 * config.linear_num_value_heads * config.linear_key_head_dim \
            * config.linear_value_head_dim
        linear = 2.0 * params + 2.0 * gdn_state
        coeff = 2.0 * num_attn * config.num_attention_heads * config.head_dim  # QK^T + AV, causal half
        return cls(linear, coeff, kv_bytes_per_token, snapshot_bytes)

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs to prefill `num_tokens` tokens from scratch (what a hit at that depth saves)."""
        return self.linear_flops_per_token * num_tokens + self.attention_flops_coeff * num_tokens * num_tokens


class RequestView(NamedTuple):
    """What a policy may know of a request (positions only)."""

    num_prompt_tokens: int
    num_tokens: int
    branch_point: int      # KV matched this deep but no snapshot did (0: none)
    deepest_snapshot: int  # deepest boundary with a snapshot on the request's path (hit or captured)
    resumes: bool = False  # the branch point is an earlier request's end (its cached tail continues)


class CachePolicy:
    """Base: no admission, LRU eviction, KV freed least-valuable-last. Subclasses override."""

    name = "base"
    capture_at_end = False
    learns_from_paths = False  # whether `observe_missed_path` is worth the manager's walk

    def __init__(self, block_size: int, cost: PrefixCost, interval: int) -> None:
        self.block_size = block_size
        self.cost = cost
        self.interval = interval  # tokens between interval marks (policies that take them)
        self.block_pool: BlockPool | None = None
        self.snapshot_pool: SnapshotPool | None = None
        self.kinds: Mapping[BlockHash, str] = {}

    def bind(self, block_pool: BlockPool, snapshots: SnapshotPool, kinds: Mapping[BlockHash, str] | None = None
             ) -> None:
        """Attach to the pools this policy judges (eviction callbacks included) and to the candidate
        kind of each snapshot in them (`kinds`, kept by the cache manager; see `kind_of`)."""
        self.block_pool = block_pool
        self.snapshot_pool = snapshots
        self.kinds = kinds if kinds is not None else {}
        snapshots.choose_victim = self.choose_victim if type(self).choose_victim is not CachePolicy.choose_victim \
            else None

    def captures(self, view: RequestView, start: int, length: int) -> list[int]:
        """Boundaries in (start, start + length] to snapshot during this chunk, ascending."""
        return []

    def is_opportunistic(self, view: RequestView, boundary: int, demoted: bool = False) -> bool:
        """Whether a capture may only use a free or covered slot (never evict a useful one). `demoted`:
        what a capture pushes out goes to a lower tier, where it still serves."""
        return False

    def choose_victim(self, pool: SnapshotPool) -> int | None:
        """Slot to evict (None: the pool's default, least recently used)."""
        return None

    def holds_as_branch(self, view: RequestView, boundary: int, key: BlockHash) -> bool:
        """Whether a capture at `boundary` (named `key`) counts as a branch point in the pool (a path beside the
        request's own, so a deeper snapshot never covers it)."""
        return boundary == view.branch_point

    def observe_publish(self, kind: str | None, key: BlockHash) -> None:
        """A snapshot of this candidate kind (None: unknown) was published in the device pool as `key`."""

    def observe_restore(self, kind: str | None, earlier_restores: int, key: BlockHash) -> None:
        """A request is restoring the device snapshot `key` of this kind, which had `earlier_restores`
        before (the pool has not counted this one yet)."""

    def observe_missed_end(self, key: BlockHash) -> None:
        """A request continues where an earlier request ended (`key`: that end's snapshot key), and
        the end's snapshot is gone: it was wanted after it was evicted."""

    def observe_missed_path(self, keys: Iterable[BlockHash]) -> None:
        """A request restored less deep than these boundaries of its path whose KV is cached (deepest
        first, lazily): one of them may name a snapshot that was evicted and is wanted again."""

    def evict_kv_first(self, view: RequestView) -> int | None:
        """Released KV blocks starting at or after this position are evicted first (None: none)."""
        return None

    def kv_present(self, key: bytes) -> bool:
        """Whether the KV block that ends at a snapshot's boundary is still cached."""
        return self.block_pool is None or self.block_pool.lookup(key) is not None

    def kind_of(self, view: RequestView, boundary: int) -> str:
        """What kind of candidate a capture at `boundary` is: a branch point, the prompt mark, an
        interval mark among the prompt's last few (where edits and retries of the last turn
        diverge), another interval mark, or a mark in the output (lower tiers learn restore rates by
        kind)."""
        if boundary == view.branch_point:
            return "resume" if view.resumes else "branch"
        if boundary == self._prompt_mark(view):
            return "prompt"
        if boundary > view.num_prompt_tokens:
            return "output"
        return "tail" if view.num_prompt_tokens - boundary <= TAIL_MARKS * max(self.interval, 1) else "interval"

    def _prompt_mark(self, view: RequestView) -> int:
        """The last block boundary a repeat of this prompt can restore (<= prompt length - 1)."""
        return ((view.num_prompt_tokens - 1) // self.block_size) * self.block_size


def _within(boundaries: list[int], start: int, length: int) -> list[int]:
    return sorted({b for b in boundaries if start < b <= start + length})


class IntervalPolicy(CachePolicy):
    """Every `interval` tokens crossed, in prefill and decode; LRU eviction (the original policy)."""

    name = "interval"

    def captures(self, view: RequestView, start: int, length: int) -> list[int]:
        first = (start // self.interval + 1) * self.interval
        return list(range(first, start + length + 1, self.interval))


class LastBlockPolicy(CachePolicy):
    """One state at the last block boundary at or before prompt_len - 1; LRU eviction."""

    name = "last-block"

    def captures(self, view: RequestView, start: int, length: int) -> list[int]:
        return _within([self._prompt_mark(view)], start, length)


class MarconiPolicy(CachePolicy):
    """Marconi (MLSys'25): admit request-end and branch-point states; evict, among snapshots with
    at most one child, the lowest recency + alpha * FLOP efficiency (both min-max normalised;
    efficiency = FLOPs a hit saves / bytes of the state plus its edge's KV)."""

    name = "marconi"
    capture_at_end = True
    alpha = 1.0

    def captures(self, view: RequestView, start: int, length: int) -> list[int]:
        return _within([view.branch_point], start, length)

    def choose_victim(self, pool: SnapshotPool) -> int | None:
        candidates = []
        for slot, key, tokens, last_use, _, paths, parent_tokens in pool.candidates(EVICTION_WINDOW):
            if not self.kv_present(key):
                return slot
            if paths <= 1:
                edge_bytes = self.cost.snapshot_bytes + self.cost.kv_bytes_per_token * (tokens - parent_tokens)
                candidates.append((slot, last_use, self.cost.prefill_flops(tokens) / edge_bytes))
        if not candidates:
            return next(iter(pool.evictable()))
        recency = _normalised([c[1] for c in candidates])
        efficiency = _normalised([c[2] for c in candidates])
        scores = [r + self.alpha * e for r, e in zip(recency, efficiency)]
        return candidates[min(range(len(candidates)), key=scores.__getitem__)][0]


POOLED_KINDS = {"resume": "branch"}  # a kind whose evidence also counts toward a wider one (admission)


def _counted_as(kind: str) -> tuple[str, ...]:
    pooled = POOLED_KINDS.get(kind)
    return (kind,) if pooled is None else (kind, pooled)


class KindRates:
    """Restores per published snapshot, by candidate kind (see `CachePolicy.kind_of`; request ends
    are "end"), decayed by publications. Each snapshot counts at most RESTORES_COUNTED restores, so a
    few hot shared prefixes do not make their whole kind look valuable. Every kind starts at one
    restore per snapshot, worth KIND_PRIOR_WEIGHT publications: a kind is judged worth its slot until
    its own evidence says otherwise (one held out of the pool too early would never be measured)."""

    def __init__(self) -> None:
        self._decay = 0.5 ** (1.0 / KIND_HALF_LIFE)
        self._clock = 0
        self._counts: dict[str, tuple[float, float, int]] = {}  # kind -> restores, publications, clock

    def published(self, kind: str) -> None:
        """Count one publication of `kind` (the decay clock ticks)."""
        self._clock += 1
        for counted in _counted_as(kind):
            self._add(counted, 0.0, 1.0)

    def restored(self, kind: str, earlier_restores: int) -> None:
        """Count a restore of a `kind` snapshot that had `earlier_restores` restores before it."""
        if earlier_restores < RESTORES_COUNTED:
            for counted in _counted_as(kind):
                self._add(counted, 1.0, 0.0)

    def rate(self, kind: str, prior: float = 1.0) -> float:
        """Estimated restores per published snapshot of `kind` (`prior`: the rate before evidence)."""
        restores, publications = self.evidence(kind)
        return (restores + KIND_PRIOR_WEIGHT * prior) / (publications + KIND_PRIOR_WEIGHT)

    def _add(self, kind: str, restores: float, publications: float) -> None:
        old_restores, old_publications = self.evidence(kind)
        self._counts[kind] = (old_restores + restores, old_publications + publications, self._clock)

    def evidence(self, kind: str) -> tuple[float, float]:
        """Decayed (restores, publications) counted for `kind`."""
        restores, publications, at = self._counts.get(kind, (0.0, 0.0, self._clock))
        fade = self._decay ** (self._clock - at)
        return restores * fade, publications * fade


class Ghosts:
    """Keys evicted from the snapshot pool with their last use on the pool clock and a label (such as
    the snapshot's kind), GHOSTS_PER_SLOT per slot (oldest forgotten first): when one is wanted
    again, the pool turnovers it was idle."""

    def __init__(self) -> None:
        self._last_use: OrderedDict[BlockHash, tuple[int, str]] = OrderedDict()

    def remember(self, key: BlockHash, last_use: int, num_slots: int, label: str = "") -> None:
        """Remember an evicted `key` (its last use on the pool clock)."""
        self._last_use[key] = (last_use, label)
        self._last_use.move_to_end(key)
        while len(self._last_use) > GHOSTS_PER_SLOT * max(num_slots, 1):
            self._last_use.popitem(last=False)

    def wanted(self, key: BlockHash, clock: int, num_slots: int) -> float | None:
        """Pool turnovers since `key`'s last use if it is remembered (then forgotten), else None."""
        found = self.wanted_labelled(key, clock, num_slots)
        return None if found is None else found[0]

    def wanted_labelled(self, key: BlockHash, clock: int, num_slots: int) -> tuple[float, str] | None:
        """`wanted`, with the label `key` was remembered with."""
        remembered = self._last_use.pop(key, None)
        if remembered is None:
            return None
        last_use, label = remembered
        return (clock - last_use) / max(num_slots, 1), label


class BranchProtection:
    """Which branch points the default keeps out of ordinary eviction (a protected segment, as in
    segmented LRU), learned from their reuse. A snapshot of kind "branch" (a shared prefix that
    requests left, such as a document or system prompt) is protected while it has been idle no
    longer than the longest idle gap before a reuse among the last REUSE_GAPS_KEPT reuses of branch
    points: a first restore, or a capture again of one evicted before (remembered by key). So a
    workload whose shared prefixes return after long gaps keeps them that long, and one whose branch
    points are not reused lets them go at the age horizon. Protected snapshots fill at most the
    share of the pool that branch points earn: their decayed share of all restored tokens (a
    document restored once saves what many short conversation ends do). A branch point evicted and
    captured again keeps the uses it had (its restores, and one for each capture again), and
    eviction counts them with its hits, weighted by how often branch points that came back were
    restored in their new stays (`uses_carried`): so a shared prefix that keeps coming back and
    serving (a tenant's system prompt) outweighs a deeper one never wanted since."""

    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=REUSE_GAPS_KEPT)  # pool turnovers idle before a reuse
        self._ghosts = Ghosts()  # evicted branch points
        self._uses: OrderedDict[BlockHash, int] = OrderedDict()  # branch point -> uses before its current stay
        self._decay = 0.5 ** (1.0 / KIND_HALF_LIFE)
        self._branch_restores = 0.0
        self._restores = 0.0
        self._returns = 0.0  # decayed: branch points captured again after an eviction
        self._restores_after_return = 0.0  # decayed: their restores in the stays that followed

    def horizon(self) -> float:
        """Pool turnovers a branch point stays protected while idle."""
        return max(self._gaps) if self._gaps else AGE_TURNOVERS

    def share(self) -> float:
        """The most of the pool protected snapshots may fill (a fraction of its slots): branch points'
        share of the restored tokens."""
        return self._branch_restores / max(self._restores, 1.0)

    def restored(self, branch: bool, idle_turnovers: float | None, num_tokens: int) -> None:
        """Count a restore of `num_tokens` tokens (of a branch point, or not); a branch point's first
        restore after `idle_turnovers` idle is a reuse gap."""
        self._restores = self._restores * self._decay + num_tokens
        self._branch_restores = self._branch_restores * self._decay + (num_tokens if branch else 0)
        if branch and idle_turnovers is not None:
            self._gaps.append(idle_turnovers)

    def evicted(self, key: BlockHash, last_use: int, num_slots: int, restores: int) -> None:
        """Remember an evicted branch point (its last use on the pool clock) and the uses it had: those
        of earlier stays, and this stay's `restores`."""
        self._ghosts.remember(key, last_use, num_slots)
        self._uses[key] = self._uses.pop(key, 0) + restores
        while len(self._uses) > GHOSTS_PER_SLOT * max(num_slots, 1):
            self._uses.popitem(last=False)

    def published(self, key: BlockHash, clock: int, num_slots: int) -> None:
        """A branch point was published: if it was evicted before, its return is a reuse gap and one
        more use that it carries."""
        gap = self._ghosts.wanted(key, clock, num_slots)
        if gap is not None:
            self._gaps.append(gap)
        if key in self._uses:
            self._uses[key] += 1
            self._uses.move_to_end(key)
            self._returns = self._returns * self._decay + 1.0
            self._restores_after_return *= self._decay

    def restored_after_return(self, key: BlockHash) -> None:
        """Count a restore of branch point `key` if it is in a stay that followed a capture again."""
        if self.uses(key) > 0:
            self._restores_after_return += 1.0

    def uses(self, key: BlockHash) -> int:
        """The uses a branch point had before its current stay in the pool: restores in earlier stays,
        and each capture again after an eviction (0 for one never evicted)."""
        return self._uses.get(key, 0)

    def uses_carried(self, key: BlockHash) -> float:
        """`uses`, each worth the restores per stay that branch points captured again have had
        (decayed, one pseudo-stay with one restore; at most 1): where those that come back are not
        restored again, coming back proves little."""
        uses = self.uses(key)
        if not uses:
            return 0.0
        return uses * min(1.0, (self._restores_after_return + 1.0) / (self._returns + 1.0))


class GapCurve:
    """The last KIND_GAPS_KEPT idle gaps (pool turnovers) before some kind of reuse, kept in arrival
    order and ascending."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque()  # oldest first
        self.ascending: list[float] = []      # the same gaps, ascending

    def add(self, gap: float) -> None:
        """Count one gap (the oldest is forgotten beyond KIND_GAPS_KEPT)."""
        if len(self._recent) == KIND_GAPS_KEPT:
            del self.ascending[bisect.bisect_left(self.ascending, self._recent.popleft())]
        self._recent.append(gap)
        bisect.insort(self.ascending, gap)


class ReuseGaps:
    """How long snapshots of each candidate kind sat idle before they were wanted, in pool
    turnovers: the last KIND_GAPS_KEPT gaps per kind before a first reuse, and as many before each
    later reuse of one already restored (`add_repeat`). Gaps come from restores and from snapshots
    wanted after they were evicted (remembered by key, GHOSTS_PER_SLOT per slot): an unreused
    request end that a later request continued (`end_missed`), and a reused snapshot that a later
    request's path passed beyond what it restored (`missed_on_path`). The evicted ones matter: gaps
    seen only on restores are capped by how long the pool kept things, so a curve learned from them
    alone would justify evicting ever younger snapshots. The share of a kind's gaps (`curves`,
    `repeat_curves`) longer than a snapshot's idle time is how much of its chance of (another) reuse
    is still ahead of it. The walk also finds resumes evicted before any restore (`resume_evicted`)
    and reports how long the deepest one passed was idle; the policy counts it as a missed restore
    (`HybridServePolicy.observe_missed_path`), not as a gap. Publications (`published`) against first
    reuses give the share of a kind's snapshots that are ever wanted (`first_rate`)."""

    def __init__(self) -> None:
        self._curves: dict[str, GapCurve] = {}  # kind -> its gaps before a first reuse
        self._repeat: dict[str, GapCurve] = {}  # kind -> its gaps before a later reuse
        self._end_ghosts = Ghosts()  # evicted unreused request ends
        self._reused_ghosts = Ghosts()  # evicted reused snapshots, labelled with their kind
        self._resume_ghosts = Ghosts()  # evicted resumes never restored
        self._fade = 0.5 ** (1.0 / KIND_HALF_LIFE)
        self._wanted: dict[str, tuple[float, float]] = {}  # kind -> decayed (first reuses, publications)

    def add(self, kind: str, gap: float) -> None:
        """Count a first reuse of a `kind` snapshot after `gap` pool turnovers idle."""
        self._curves.setdefault(kind, GapCurve()).add(gap)
        firsts, publications = self._wanted.get(kind, (0.0, 0.0))
        self._wanted[kind] = (firsts + 1.0, publications)

    def published(self, kind: str) -> None:
        """Count a publication of a `kind` snapshot (older counts fade over KIND_HALF_LIFE of them)."""
        firsts, publications = self._wanted.get(kind, (0.0, 0.0))
        self._wanted[kind] = (firsts * self._fade, publications * self._fade + 1.0)

    def first_rate(self, kind: str) -> float:
        """The share of published `kind` snapshots wanted at least once (first reuses, evicted ends
        continued included), at most FIRST_RATE_MAX; 0 before any publication."""
        firsts, publications = self._wanted.get(kind, (0.0, 0.0))
        return min(FIRST_RATE_MAX, firsts / publications) if publications > 0.0 else 0.0

    def add_repeat(self, kind: str, gap: float) -> None:
        """Count a later reuse of a restored `kind` snapshot after `gap` pool turnovers idle."""
        self._repeat.setdefault(kind, GapCurve()).add(gap)

    def reused_evicted(self, kind: str, key: BlockHash, last_use: int, num_slots: int) -> None:
        """Remember a restored snapshot of `kind` evicted from the pool (its last use on the pool clock)."""
        self._reused_ghosts.remember(key, last_use, num_slots, kind)

    def resume_evicted(self, key: BlockHash, last_use: int, num_slots: int) -> None:
        """Remember a resume evicted before any restore (its last use on the pool clock)."""
        self._resume_ghosts.remember(key, last_use, num_slots)

    def missed_on_path(self, keys: Iterable[BlockHash], clock: int, num_slots: int) -> float | None:
        """A request passed these boundaries (deepest first) beyond the one it restored: the deepest
        remembered reused snapshot among them was wanted again, and its idle time until now is a gap.
        Returns the pool turnovers that the deepest remembered never-restored resume deeper than it
        had been idle (None if the walk passed none): that resume was wanted too."""
        resume_idle = None
        for key in keys:
            found = self._reused_ghosts.wanted_labelled(key, clock, num_slots)
            if found is not None:
                self.add_repeat(found[1], found[0])
                return resume_idle
            if resume_idle is None:
                resume_idle = self._resume_ghosts.wanted(key, clock, num_slots)
        return resume_idle

    def end_evicted(self, key: BlockHash, last_use: int, num_slots: int) -> None:
        """Remember an unreused request end evicted from the pool (its last use on the pool clock)."""
        self._end_ghosts.remember(key, last_use, num_slots)

    def end_missed(self, key: BlockHash, clock: int, num_slots: int) -> None:
        """A request continued an evicted end: if it is remembered, its idle time until now is a gap."""
        gap = self._end_ghosts.wanted(key, clock, num_slots)
        if gap is not None:
            self.add("end", gap)

    def gaps(self, kind: str, repeat: bool = False) -> list[float]:
        """The gaps kept for `kind` before a first reuse (`repeat`: before a later one), ascending."""
        curve = (self._repeat if repeat else self._curves).get(kind)
        return list(curve.ascending) if curve is not None else []

    def curves(self) -> dict[str, list[float]]:
        """Each kind's gaps before a first reuse, ascending, for the kinds with at least
        KIND_GAPS_NEEDED of them."""
        return _known(self._curves)

    def repeat_curves(self) -> dict[str, list[float]]:
        """The same for the gaps before a later reuse."""
        return _known(self._repeat)


def _known(curves: dict[str, GapCurve]) -> dict[str, list[float]]:
    return {kind: curve.ascending for kind, curve in curves.items() if len(curve.ascending) >= KIND_GAPS_NEEDED}


class SiblingGaps:
    """How long a covered snapshot where one continuation left a turn sat idle before another
    continuation of the same turn wanted it too (a sibling, as when an agent branches or a chat
    turn is regenerated): a request end the first continuation restored, or the resume it captured
    where that end was gone (`is_sibling_point`). Gaps in pool turnovers, from restores while it was
    covered and from covered ones that a later request continued after they were evicted
    (remembered by key, GHOSTS_PER_SLOT per slot, so the curve is not capped by how long the pool
    kept them). Such a snapshot is held from insurance marks while at least half of the gaps are as
    long as its idle time."""

    def __init__(self) -> None:
        self._curve = GapCurve()
        self._ghosts = Ghosts()  # evicted covered sibling points

    @staticmethod
    def is_sibling_point(kind: str | None, restores: int) -> bool:
        """Whether a covered snapshot of `kind` with `restores` is where one continuation left a turn:
        a request end restored once, or a resume not restored yet."""
        return (kind == "end" and restores == 1) or (kind == "resume" and restores == 0)

    def holds(self, idle: float) -> bool:
        """Whether a covered sibling point, idle for `idle` pool turnovers, may still be wanted by a
        sibling (never before KIND_GAPS_NEEDED gaps are known)."""
        gaps = self._curve.ascending
        return len(gaps) >= KIND_GAPS_NEEDED and idle <= gaps[(len(gaps) - 1) // 2]

    def gaps(self) -> list[float]:
        """The gaps kept, ascending."""
        return list(self._curve.ascending)

    def restored(self, idle: float) -> None:
        """A covered sibling point was restored after `idle` pool turnovers idle."""
        self._curve.add(idle)

    def evicted(self, key: BlockHash, last_use: int, num_slots: int) -> None:
        """Remember a covered sibling point that left the pool (its last use on the pool clock)."""
        self._ghosts.remember(key, last_use, num_slots)

    def missed(self, key: BlockHash, clock: int, num_slots: int) -> None:
        """A request continued where an evicted snapshot was: if it was a covered sibling point, its
        idle time until now is a gap."""
        gap = self._ghosts.wanted(key, clock, num_slots)
        if gap is not None:
            self._curve.add(gap)


class HybridServePolicy(IntervalPolicy):
    """The default. Admits request ends, branch points, the last block boundary before the prompt end
    (a re-tokenised chat turn still hits), and every `interval` tokens into free or covered slots
    only. Learns restores per published snapshot by kind (`KindRates`): a branch point or prompt mark
    whose kind is restored less than request ends takes only free or covered slots too, so it never
    pushes out the ends that serve more. A branch point that resumes an earlier request's end is
    covered by the request's own snapshots until resumes prove worth more than ends
    (`holds_as_branch`). Evicts, cheapest loss first: a covered snapshot, then one whose KV is
    gone, then the lowest value = prefill FLOPs saved beyond the resident parent x
    (prior + hits + extra paths) x the share of its reuse still ahead (a branch point's hits include
    the uses it carries from earlier stays, weighted, `BranchProtection.uses_carried`): for a snapshot of a kind whose
    idle gaps before a first reuse (unreused) or a later one (restored; `CONTINUATION_KINDS`) are known
    (`ReuseGaps`), the share of those gaps longer than its idle time (for an unreused one, that share
    s as the chance it is still wanted given that it has not been yet: s / (1 - p (1 - s)), p the
    share of its kind ever wanted, `ReuseGaps.first_rate`), else 1 / (1 + idle pool
    turnovers / AGE_TURNOVERS); taken from the unprotected snapshots while protected branch points
    fill less than their share (`BranchProtection`). When every evictable snapshot is protected, a
    prompt mark or resume takes only a free or covered slot.
    A capture that takes only a free or covered slot passes over a covered request end restored
    once (or the resume captured where it was gone) while a sibling continuation of its turn may
    still want it (`SiblingGaps`); eviction takes such a one after the other covered slots. A
    released request's KV beyond its deepest snapshot is freed first."""

    name = "hybridserve"
    capture_at_end = True
    learns_from_paths = True

    def __init__(self, block_size: int, cost: PrefixCost, interval: int) -> None:
        super().__init__(block_size, cost, interval)
        self.kind_rates = KindRates()
        self.protection = BranchProtection()
        self._resumes_wanted: OrderedDict[BlockHash, None] = OrderedDict()
        self.reuse_gaps = ReuseGaps()
        self.sibling_gaps = SiblingGaps()

    def bind(self, block_pool: BlockPool, snapshots: SnapshotPool, kinds: Mapping[BlockHash, str] | None = None
             ) -> None:
        super().bind(block_pool, snapshots, kinds)
        snapshots.choose_covered = self.choose_covered

    def captures(self, view: RequestView, start: int, length: int) -> list[int]:
        kept = _within([self._prompt_mark(view), view.branch_point], start, length)
        marks = [b for b in super().captures(view, start, length) if b not in kept] if self.interval else []
        room = self._room()
        if room is not None and len(marks) + len(kept) > room:
            # One chunk cannot hold more reservations than the pool has slots to give; the ones past
            # that would be skipped, and they are the deepest. Drop the shallowest marks instead.
            marks = marks[max(len(marks) - max(room - len(kept), 0), 0):]
        return _within([*marks, *kept], start, length)

    def _room(self) -> int | None:
        """Snapshot slots a chunk's captures can take now (free or evictable), if bound to a pool."""
        pool = self.snapshot_pool
        return None if pool is None else pool.num_free_slots + pool.num_evictable

    def is_opportunistic(self, view: RequestView, boundary: int, demoted: bool = False) -> bool:
        """Interval marks are insurance: they never push out a snapshot that still serves; nor does a
        branch point or prompt mark while its kind is restored less per snapshot than request ends,
        nor a prompt mark or resume while every evictable snapshot is a protected branch point. With
        a lower tier (`demoted`) only the last rule holds: a demoted snapshot still serves from there."""
        if boundary not in (self._prompt_mark(view), view.branch_point):
            return not demoted
        kind = self.kind_of(view, boundary)
        if kind != "branch" and self._only_protected_evictable():
            return True
        return not demoted and self.kind_rates.rate(POOLED_KINDS.get(kind, kind)) < self.kind_rates.rate("end")

    def _only_protected_evictable(self) -> bool:
        """Whether every snapshot eviction would weigh is a protected branch point (never before branch
        points have earned a share of the pool, as in eviction)."""
        pool = self.snapshot_pool
        if pool is None or self.protection.share() == 0.0:
            return False
        protected = self._protected_test(pool)
        return all(protected(key, last_use) for _, key, _, last_use, *_ in pool.candidates(EVICTION_WINDOW))

    def _protected_test(self, pool: SnapshotPool) -> Callable[[BlockHash, int], bool]:
        """Whether a published snapshot (key, last use) is a protected branch point now."""
        kinds, oldest_use = self.kinds, pool.clock - self.protection.horizon() * max(pool.num_slots, 1)
        return lambda key, last_use: last_use >= oldest_use and kinds.get(key) == "branch"

    def holds_as_branch(self, view: RequestView, boundary: int, key: BlockHash) -> bool:
        """A capture where an earlier request ended ("resume") is a continuation: the request's own
        deeper snapshots cover it, so it goes first once they exist. That holds while resumes are
        restored no more per snapshot than request ends (resumes start at the ends' rate); once they
        are restored more (siblings and later turns fall back to them), each is a branch point. A
        resume captured again within a pool's worth of captures counts as a restore: it was wanted
        again after it was evicted or skipped; so does one evicted too early that a later request's
        path passed (`observe_missed_path`)."""
        if boundary != view.branch_point:
            return False
        if not view.resumes:
            return True
        if key in self._resumes_wanted:
            self.kind_rates.restored("resume", 0)
        self._resumes_wanted[key] = None
        self._resumes_wanted.move_to_end(key)
        while len(self._resumes_wanted) > max(self.snapshot_pool.num_slots if self.snapshot_pool else 0, 1):
            self._resumes_wanted.popitem(last=False)
        end = self.kind_rates.rate("end")
        return self.kind_rates.rate("resume", prior=end) > end

    def observe_publish(self, kind: str | None, key: BlockHash) -> None:
        self.kind_rates.published(kind or "unknown")
        self.reuse_gaps.published(kind or "unknown")
        if kind == "branch" and self.snapshot_pool is not None:
            self.protection.published(key, self.snapshot_pool.clock, self.snapshot_pool.num_slots)

    def observe_restore(self, kind: str | None, earlier_restores: int, key: BlockHash) -> None:
        self.kind_rates.restored(kind or "unknown", earlier_restores)
        pool = self.snapshot_pool
        ticks = pool.idle_ticks(key) if pool is not None else None
        idle = None if pool is None or ticks is None else ticks / max(pool.num_slots, 1)
        first_idle = idle if earlier_restores == 0 else None
        if first_idle is not None:
            self.reuse_gaps.add(kind or "unknown", first_idle)
        elif idle is not None and kind in CONTINUATION_KINDS:
            self.reuse_gaps.add_repeat(kind, idle)
        slot = pool.lookup(key) if pool is not None else None
        num_tokens = pool.num_tokens_of(slot) if pool is not None and slot is not None else 0
        self.protection.restored(kind == "branch", first_idle if kind == "branch" else None, num_tokens)
        if kind == "branch":
            self.protection.restored_after_return(key)
        if (idle is not None and pool is not None and SiblingGaps.is_sibling_point(kind, earlier_restores)
                and pool.is_covered(key)):
            self.sibling_gaps.restored(idle)

    def observe_missed_end(self, key: BlockHash) -> None:
        pool = self.snapshot_pool
        if pool is not None:
            self.reuse_gaps.end_missed(key, pool.clock, pool.num_slots)
            self.sibling_gaps.missed(key, pool.clock, pool.num_slots)

    def observe_missed_path(self, keys: Iterable[BlockHash]) -> None:
        """Learn repeat gaps from the path (`ReuseGaps.missed_on_path`). A resume evicted before any
        restore and wanted within PREMATURE_TURNOVERS of its last use counts as a restore of resumes:
        covered resumes go first, so without these their rate would show what the pool kept, not what
        was wanted, and resumes once judged covered would stay so."""
        pool = self.snapshot_pool
        if pool is None:
            return
        resume_idle = self.reuse_gaps.missed_on_path(keys, pool.clock, pool.num_slots)
        if resume_idle is not None and resume_idle <= PREMATURE_TURNOVERS:
            self.kind_rates.restored("resume", 0)

    def choose_covered(self, pool: SnapshotPool) -> int | None:
        """The covered slot an opportunistic capture takes (None: it is skipped): the least recently
        used, passing over sibling points that a sibling may still want (`SiblingGaps`)."""
        slot, _ = self._covered_unheld(pool)
        if slot is not None:
            self._note_eviction(pool, slot)
        return slot

    def _covered_victim(self, pool: SnapshotPool) -> int | None:
        """The covered slot an eviction takes first (None if none is covered): the least recently used,
        passing over sibling points that a sibling may still want while another covered slot is
        there to take. A covered snapshot costs nothing to evict, unless a sibling comes for it."""
        slot, held = self._covered_unheld(pool)
        return slot if slot is not None else held

    def _covered_unheld(self, pool: SnapshotPool) -> tuple[int | None, int | None]:
        """The least recently used covered slot that no sibling may still want, and the least recently
        used one passed over because a sibling may (`SiblingGaps.holds`)."""
        turnover, held = float(max(pool.num_slots, 1)), None
        for slot, key, _, last_use, hits, _, _ in pool.covered_candidates(EVICTION_WINDOW):
            idle = (pool.clock - last_use) / turnover
            if SiblingGaps.is_sibling_point(self.kinds.get(key), hits) and self.sibling_gaps.holds(idle):
                held = slot if held is None else held
                continue
            return slot, held
        return None, held

    def choose_victim(self, pool: SnapshotPool) -> int | None:
        slot = self._lowest_value(pool)
        if slot is not None:
            self._note_eviction(pool, slot)
        return slot

    def _note_eviction(self, pool: SnapshotPool, slot: int) -> None:
        """Remember what the policy learns from when it is evicted: a branch point, an unreused end, a
        covered sibling point, a restored end or resume, a resume never restored."""
        key = pool.key_of(slot)
        ticks = pool.idle_ticks(key)
        if ticks is None:
            return
        kind, hits = self.kinds.get(key), pool.num_hits(key)
        if kind == "branch":
            self.protection.evicted(key, pool.clock - ticks, pool.num_slots, hits)
        elif kind == "end" and hits == 0:
            self.reuse_gaps.end_evicted(key, pool.clock - ticks, pool.num_slots)
        elif SiblingGaps.is_sibling_point(kind, hits) and pool.is_covered(key):
            self.sibling_gaps.evicted(key, pool.clock - ticks, pool.num_slots)
        if hits > 0 and kind in CONTINUATION_KINDS:
            self.reuse_gaps.reused_evicted(kind, key, pool.clock - ticks, pool.num_slots)
        elif kind == "resume":
            self.reuse_gaps.resume_evicted(key, pool.clock - ticks, pool.num_slots)

    def _lowest_value(self, pool: SnapshotPool) -> int | None:
        """The victim: a covered snapshot (`_covered_victim`), one whose KV is gone, else the lowest
        value among the unprotected while protected ones fill less than their share, else among all."""
        slot = self._covered_victim(pool)
        if slot is not None:
            return slot
        best_slot, best_value = None, float("inf")
        open_slot, open_value, num_protected = None, float("inf"), 0
        protected = self._protected_test(pool)
        horizon, clock, kv_present = AGE_TURNOVERS * max(pool.num_slots, 1), pool.clock, self.kv_present
        linear, quadratic = self.cost.linear_flops_per_token, self.cost.attention_flops_coeff
        # An unproven snapshot is worth the restores per snapshot the pool has seen (at most one):
        # when slots are scarce and few snapshots are ever restored, proven ones outweigh deep guesses.
        prior = min(1.0, (pool.hits_total + 1.0) / (pool.published_total + 1.0))
        curves, repeats, kinds = self.reuse_gaps.curves(), self.reuse_gaps.repeat_curves(), self.kinds
        wanted = {kind: self.reuse_gaps.first_rate(kind) for kind in curves}
        turnover = float(max(pool.num_slots, 1))
        uses_carried = self.protection.uses_carried
        for slot, key, tokens, last_use, hits, paths, parent_tokens in pool.candidates(EVICTION_WINDOW):
            if not kv_present(key):
                return slot
            # prefill_flops(tokens) - prefill_flops(parent_tokens), factored (this loop is the
            # simulator's hottest): what a hit saves beyond the parent, where a miss falls back.
            saved = (tokens - parent_tokens) * (linear + quadratic * (tokens + parent_tokens))
            kind = kinds.get(key) or "unknown"
            # A branch point's uses in earlier stays count (weighted) as this stay's restores do.
            used = hits + uses_carried(key) if kind == "branch" else hits
            gaps = curves.get(kind) if used == 0 else repeats.get(kind)
            if gaps is None:
                ahead = 1.0 / (1.0 + (clock - last_use) / horizon)
            else:  # the share of this kind's (later) reuse gaps longer than its idle time (one pseudo-gap)
                ahead = (1.0 + len(gaps) - bisect.bisect_left(gaps, (clock - last_use) / turnover)) / (1.0 + len(gaps))
                if used == 0:  # the chance it is still wanted, given that it has not been yet
                    ahead /= 1.0 - wanted[kind] * (1.0 - ahead)
            value = saved * (prior + used + (paths - 1 if paths > 1 else 0)) * ahead
            if value < best_value:
                best_slot, best_value = slot, value
            if protected(key, last_use):
                num_protected += 1
            elif value < open_value:
                open_slot, open_value = slot, value
        if open_slot is not None and num_protected < self.protection.share() * pool.num_slots:
            return open_slot
        return best_slot

    def evict_kv_first(self, view: RequestView) -> int | None:
        return view.deepest_snapshot if view.deepest_snapshot > 0 else None


CANDIDATE_KINDS = ("interval", "tail", "prompt", "branch", "end", "output")
INITIAL_TILT = {"interval": 0.5, "tail": 0.5}  # insurance marks start below average (free or covered slots)
EVIDENCE_HALF_LIFE = 4096.0       # snapshot lives; older evidence fades so the rates follow the workload
PRIOR_WEIGHT = 8.0                # pseudo-lives a depth bucket borrows from its kind, a kind from all kinds
HORIZON_START, HORIZON_MIN, HORIZON_MAX, HORIZON_STEP = 16.0, 1.0, 256.0, 1.25  # pool turnovers
PENDING_LIMIT = 256               # captures awaiting their key (published later) before they are dropped


class RestoreRates:
    """Restores per pool turnover of residence (value per slot-time), exponentially decayed, per
    candidate kind and depth bucket (log2 of the boundary); a bucket with little evidence leans on
    its kind, a kind on all kinds."""

    def __init__(self) -> None:
        self._decay = 0.5 ** (1.0 / EVIDENCE_HALF_LIFE)
        self._clock = 0.0
        self._totals: dict[tuple[str, int], tuple[float, float, float]] = {}  # key -> restores, lives, clock

    def observe(self, kind: str, tokens: int, restores: float, lives: float = 1.0) -> None:
        """A snapshot of `kind` at `tokens` left the pool after `lives` pool turnovers of residence with
        `restores` restores (lives=0: a late restore of one already gone)."""
        self._clock += lives
        for key in ((kind, tokens.bit_length()), (kind, -1), ("", -1)):
            old_restores, old_lives = self._decayed(key)
            self._totals[key] = (old_restores + restores, old_lives + lives, self._clock)

    def _decayed(self, key: tuple[str, int]) -> tuple[float, float]:
        restores, lives, at = self._totals.get(key, (0.0, 0.0, self._clock))
        fade = self._decay ** (self._clock - at)
        return restores * fade, lives * fade

    def _rate(self, key: tuple[str, int], prior: float) -> float:
        restores, lives = self._decayed(key)
        return (restores + PRIOR_WEIGHT * prior) / (lives + PRIOR_WEIGHT)

    def relative(self, kind: str, tokens: int) -> float:
        """This kind and depth's restore rate over the average of all snapshots (1.0 before evidence,
        and whenever one kind and depth is all there is: the average is shrunk in the same two steps)."""
        overall = self._rate(("", -1), 1.0)
        return self.rate(kind, tokens) / self._rate(("", -1), self._rate(("", -1), overall))

    def has_restores(self) -> bool:
        """Whether the decayed evidence holds restores enough to rank kinds by (a prior's worth)."""
        return self._decayed(("", -1))[0] >= PRIOR_WEIGHT

    def rate(self, kind: str, tokens: int) -> float:
        """Estimated restores per life of a snapshot of this kind and depth."""
        overall = self._rate(("", -1), 1.0)
        of_kind = self._rate((kind, -1), overall * INITIAL_TILT.get(kind, 1.0))
        return self._rate((kind, tokens.bit_length()), of_kind)


class _Ghost(NamedTuple):
    """An evicted snapshot remembered by key: its kind, depth and whether age was why it went."""

    kind: str
    tokens: int
    old: bool


class AdaptiveHybridServePolicy(HybridServePolicy):
    """Experimental, not the default (it loses to `hybridserve` on most workloads; docs/benchmarks.md). Admits
    the candidates of `hybridserve` (branch points, request ends, the prompt
    mark, interval marks) and learns what they are worth: restores per snapshot life by candidate kind
    and depth (`RestoreRates`). A kind restored less than average is admitted only into free or
    covered slots. Eviction, after snapshots whose KV is gone and covered ones, takes the lowest
    ΔFLOPs x (learned prior + hits + extra paths) / (1 + idle / horizon). Evicted keys are kept as
    ghosts (ARC): one that is captured again counts as a late restore of its kind, and moves the
    horizon up if it was evicted for age (recency was overweighted) or down if not."""

    name = "hybridserve-adaptive"
    # No path walk: its eviction reads no reuse curves, and its resume rule (inherited) keeps counting
    # only restores and resumes captured again, as it was measured beside the default.
    learns_from_paths = False

    def __init__(self, block_size: int, cost: PrefixCost, interval: int) -> None:
        super().__init__(block_size, cost, interval)
        self.rates = RestoreRates()
        self.horizon = HORIZON_START
        self.snapshots: SnapshotPool | None = None
        self._labels: dict[BlockHash, tuple[str, int]] = {}  # key -> kind, pool clock when published
        self._pending: OrderedDict[int, str] = OrderedDict()  # boundary -> kind, captured, key unknown
        self._ghosts: OrderedDict[BlockHash, _Ghost] = OrderedDict()

    def bind(self, block_pool: BlockPool, snapshots: SnapshotPool, kinds: Mapping[BlockHash, str] | None = None
             ) -> None:
        super().bind(block_pool, snapshots, kinds)
        self.snapshots = snapshots

    def captures(self, view: RequestView, start: int, length: int) -> list[int]:
        self._learn_keys()
        boundaries = super().captures(view, start, length)
        for boundary in boundaries:
            self._expect(boundary, self.kind_of(view, boundary))
        return boundaries

    def is_opportunistic(self, view: RequestView, boundary: int, demoted: bool = False) -> bool:
        """A candidate whose kind is restored less than average never pushes out a useful snapshot;
        until the pool has seen restores to compare, interval marks are the insurance ones. With a
        lower tier (`demoted`) every capture may evict."""
        if demoted:
            return False
        kind = self.kind_of(view, boundary)
        if not self.rates.has_restores():
            return kind in ("interval", "tail")
        return self.rates.relative(kind, boundary) < 1.0

    def evict_kv_first(self, view: RequestView) -> int | None:
        self._learn_keys()
        if view.num_tokens > 1:
            self._expect(view.num_tokens - 1, "end")  # the request-end capture `finish` just reserved
        return super().evict_kv_first(view)

    def choose_victim(self, pool: SnapshotPool) -> int | None:
        for slot in pool.covered():
            hits, since = next(((c[4], c[3]) for c in pool.candidates(EVICTION_WINDOW) if c[0] == slot), (0, 0))
            return self._retire(pool, slot, hits, since, False)
        best_slot, best_value, best_hits, best_since, best_old = None, float("inf"), 0, 0, False
        horizon, clock, kv_present = self.horizon * max(pool.num_slots, 1), pool.clock, self.kv_present
        linear, quadratic = self.cost.linear_flops_per_token, self.cost.attention_flops_coeff
        priors: dict[tuple[str, int], float] = {}
        for slot, key, tokens, last_use, hits, paths, parent_tokens in pool.candidates(EVICTION_WINDOW):
            if not kv_present(key):
                return self._retire(pool, slot, hits, last_use, False)
            label = self._labels.get(key)
            kind = label[0] if label is not None else self._inferred_kind(tokens)
            bucket = (kind, tokens.bit_length())
            prior = priors.get(bucket)
            if prior is None:
                prior = priors[bucket] = self.rates.relative(kind, tokens)
            saved = (tokens - parent_tokens) * (linear + quadratic * (tokens + parent_tokens))
            idle = (clock - last_use) / horizon
            value = saved * (prior + hits + (paths - 1 if paths > 1 else 0)) / (1.0 + idle)
            if value < best_value:
                best_slot, best_value, best_hits, best_since, best_old = slot, value, hits, last_use, idle >= 1.0
        return self._retire(pool, best_slot, best_hits, best_since, best_old) if best_slot is not None else None

    def _inferred_kind(self, tokens: int) -> str:
        """The kind of a snapshot whose capture was not seen: request ends are the only ones inside a block."""
        if tokens % self.block_size:
            return "end"
        return "interval" if self.interval and tokens % self.interval == 0 else "prompt"

    def _retire(self, pool: SnapshotPool, slot: int, hits: int, last_use: int, old: bool) -> int:
        """Learn from a victim's stay (restores per turnover of residence; its last use bounds an
        unlabelled one's), remember it as a ghost; returns the slot."""
        key, tokens = pool.key_of(slot), pool.num_tokens_of(slot)
        kind, published = self._labels.pop(key, (self._inferred_kind(tokens), last_use))
        residence = max(pool.clock - published, 1) / max(pool.num_slots, 1)
        self.rates.observe(kind, tokens, float(hits), residence)
        self._ghosts[key] = _Ghost(kind, tokens, old)
        while len(self._ghosts) > pool.num_slots:
            self._ghosts.popitem(last=False)
        return slot

    def _expect(self, boundary: int, kind: str) -> None:
        self._pending[boundary] = kind
        self._pending.move_to_end(boundary)
        while len(self._pending) > PENDING_LIMIT:
            self._pending.popitem(last=False)

    def _learn_keys(self) -> None:
        """Label the snapshots published since the last call with their candidate kind (matched by
        boundary among the most recently used slots); a ghost captured again is a late restore."""
        pool = self.snapshots
        if pool is None or not self._pending:
            return
        recent = list(pool.evictable())[-2 * len(self._pending):]
        for slot in reversed(recent):
            key = pool.key_of(slot)
            if key in self._labels:
                continue
            kind = self._pending.pop(pool.num_tokens_of(slot), None)
            if kind is None:
                continue
            self._labels[key] = (kind, pool.clock)
            ghost = self._ghosts.pop(key, None)
            if ghost is not None:
                self.rates.observe(ghost.kind, ghost.tokens, 1.0, 0.0)
                step = HORIZON_STEP if ghost.old else 1.0 / HORIZON_STEP
                self.horizon = min(max(self.horizon * step, HORIZON_MIN), HORIZON_MAX)
        if len(self._labels) > 2 * pool.num_slots + PENDING_LIMIT:
            live = {pool.key_of(slot) for slot in pool.evictable()}
            self._labels = {key: kind for key, kind in self._labels.items() if key in live}


def _normalised(values: list[float]) -> list[float]:
    low, high = min(values), max(values)
    return [0.0 if high == low else (v - low) / (high - low) for v in values]


_POLICIES: dict[str, type[CachePolicy]] = {
    policy.name: policy for policy in (IntervalPolicy, LastBlockPolicy, MarconiPolicy, HybridServePolicy,
                                       AdaptiveHybridServePolicy)}


def make_policy(name: str, block_size: int, cost: PrefixCost, interval: int) -> CachePolicy:
    """The policy called `name` (one of POLICY_NAMES); ValueError otherwise."""
    if name not in _POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return _POLICIES[name](block_size, cost, interval)
