"""The per-request bounds the server enforces before anything reaches the engine, in one place
(`ServerLimits`, documented in docs/serving.md's limits table), the checks that answer a request
over one of them with a 400, and the per-tenant in-flight cap (`TenantAdmission`, 429)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from hybridserve.server.errors import APIError


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Bounds on one request's size and work; each has a name in docs/serving.md's limits table."""

    max_body_bytes: int = 4 * 1024 * 1024    # a larger body is refused with 413
    max_prompts: int = 64                    # prompts in one /v1/completions batch
    max_stop_strings: int = 16               # `stop` strings
    max_stop_string_chars: int = 256         # characters in one stop string
    max_stop_token_ids: int = 64             # `stop_token_ids`
    max_logit_bias: int = 300                # `logit_bias` entries (OpenAI's bound)
    max_tools: int = 64                      # `tools` in one chat request
    max_schema_bytes: int = 64 * 1024        # JSON of all tool schemas, or of one output constraint
    max_schema_depth: int = 32               # nesting of a tool or output schema
    max_schema_bound: int = 4096             # largest maxLength / maxItems / ... inside a schema
    tenant_queue_share: float = 0.5          # share of the waiting queue one API key may hold

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "tenant_queue_share":
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"tenant_queue_share must be in (0, 1], got {value}")
            elif not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name} must be an integer >= 1, got {value!r}")

    def prompt_cap(self, max_waiting_requests: int | None) -> int:
        """Prompts one request may submit: `max_prompts`, and at most half of the waiting queue
        (so that one request can never fill it)."""
        if max_waiting_requests is None:
            return self.max_prompts
        return max(1, min(self.max_prompts, max_waiting_requests // 2))

    def tenant_cap(self, max_waiting_requests: int | None) -> int | None:
        """Engine requests one tenant may have in flight (None: no cap without a queue limit)."""
        if max_waiting_requests is None:
            return None
        return max(1, math.floor(max_waiting_requests * self.tenant_queue_share))


DEFAULT_LIMITS = ServerLimits()
SCHEMA_BOUND_KEYS = frozenset({"maxLength", "minLength", "maxItems", "minItems", "maxProperties",
                               "minProperties", "maxContains", "minContains"})


def _too_many(what: str, count: int, limit: int, param: str) -> APIError:
    return APIError(400, f"{what}: {count} given, the limit is {limit}", param=param, code="limit_exceeded")


def check_stop(stop: str | list[str] | None, stop_token_ids: list[int] | None, vocab_size: int | None,
               limits: ServerLimits) -> None:
    """Stop strings and stop token ids: counts, lengths, and ids inside the vocabulary."""
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > limits.max_stop_strings:
        raise _too_many("too many stop strings", len(strings), limits.max_stop_strings, "stop")
    longest = max((len(s) for s in strings), default=0)
    if longest > limits.max_stop_string_chars:
        raise _too_many("stop string too long (characters)", longest, limits.max_stop_string_chars, "stop")
    ids = stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise _too_many("too many stop_token_ids", len(ids), limits.max_stop_token_ids, "stop_token_ids")
    check_token_ids(ids, vocab_size, "stop_token_ids")


def check_token_ids(ids: Iterable[int], vocab_size: int | None, param: str) -> None:
    """Every id is in [0, vocab_size) (a 400 naming the first that is not)."""
    for token in ids:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
            raise APIError(400, f"token id {_short_int(token)} is outside the vocabulary {bound}", param=param,
                           code="invalid_token_id")


def _short_int(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:20]}...({len(text)} digits)"


def check_prompt_count(count: int, max_waiting_requests: int | None, limits: ServerLimits) -> None:
    """A batch no larger than `prompt_cap`."""
    cap = limits.prompt_cap(max_waiting_requests)
    if count > cap:
        raise _too_many("too many prompts in one request", count, cap, "prompt")


def check_logit_bias(bias: dict[str, float] | None, limits: ServerLimits) -> None:
    """At most `max_logit_bias` entries."""
    if bias is not None and len(bias) > limits.max_logit_bias:
        raise _too_many("too many logit_bias entries", len(bias), limits.max_logit_bias, "logit_bias")


def check_tools(tools: Sequence[dict[str, Any]] | None, limits: ServerLimits) -> None:
    """Tool count, and the size, depth and bounds of their schemas together."""
    if not tools:
        return
    if len(tools) > limits.max_tools:
        raise _too_many("too many tools", len(tools), limits.max_tools, "tools")
    check_schema(list(tools), limits, "tools")


def check_schema(schema: Any, limits: ServerLimits, param: str) -> None:
    """A tool list or output constraint (JSON schema, regex, grammar, choices) small enough to
    compile: serialized size, nesting depth, and the repetition bounds it declares."""
    if schema is None:
        return
    size = len(schema.encode()) if isinstance(schema, str) else len(json.dumps(schema, separators=(",", ":")))
    if size > limits.max_schema_bytes:
        raise _too_many("schema or grammar too large (bytes)", size, limits.max_schema_bytes, param)
    depth = 0
    for node, level in _walk(schema):
        depth = max(depth, level)
        if depth > limits.max_schema_depth:
            raise _too_many("schema nested too deeply (levels)", depth, limits.max_schema_depth, param)
        if isinstance(node, dict):
            for key in SCHEMA_BOUND_KEYS.intersection(node):
                bound = node[key]
                if isinstance(bound, int) and bound > limits.max_schema_bound:
                    raise APIError(400, f"schema bound {key} is {_short_int(bound)}, the limit is "
                                   f"{limits.max_schema_bound}", param=param, code="limit_exceeded")


def _walk(value: Any) -> Iterator[tuple[Any, int]]:
    """Every dict and list inside `value` with its nesting level (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            yield node, level
            stack.extend((child, level + 1) for child in node.values() if isinstance(child, (dict, list)))
        elif isinstance(node, list):
            yield node, level
            stack.extend((child, level + 1) for child in node if isinstance(child, (dict, list)))


class TenantAdmission:
    """Counts each tenant's engine requests in flight and refuses (429) a request that would take
    a tenant past its cap, so one key cannot hold the whole waiting queue while others wait."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        """Engine requests of `tenant` admitted and not yet released."""
        return self._in_flight.get(tenant, 0)

    def admit(self, tenant: str | None, count: int) -> TenantTicket:
        """Take `count` places for `tenant` (no cap without a tenant or a queue limit)."""
        if tenant is None or self.cap is None:
            return TenantTicket(self, None, 0)
        held = self.in_flight(tenant)
        if held + count > self.cap:
            raise APIError(429, f"this API key has {held} requests in flight and may hold at most {self.cap}; "
                           "retry later", code="tenant_limit", headers={"Retry-After": "1"})
        self._in_flight[tenant] = held + count
        return TenantTicket(self, tenant, count)

    def _release(self, tenant: str, count: int) -> None:
        left = self._in_flight.get(tenant, 0) - count
        if left > 0:
            self._in_flight[tenant] = left
        else:
            self._in_flight.pop(tenant, None)


class TenantTicket:
    """Places a request holds in `TenantAdmission`; `release` gives them back once (idempotent)."""

    def __init__(self, admission: TenantAdmission, tenant: str | None, count: int) -> None:
        self._admission = admission
        self._tenant = tenant
        self._count = count

    def release(self) -> None:
        """Give the places back (later calls do nothing)."""
        if self._tenant is not None and self._count:
            self._admission._release(self._tenant, self._count)
        self._count = 0
