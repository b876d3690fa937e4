"""API keys and tenants: `/v1/*` needs `Authorization: Bearer KEY`, and each key's requests are
cached under a salt derived from its hash, so keys never share cache entries nor time each other
through them (docs/serving.md, security notes)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from hybridserve.server.errors import APIError

TENANT_SCOPE_KEY = "hybridserve.tenant"


def tenant_id(api_key: str) -> str:
    """Stable identity of a key: the first 32 hex digits of its SHA-256."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


def tenant_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The salt a request is cached under: the client's alone without a tenant, else the tenant
    combined with it (the tenant part is fixed-length, so the combination is unambiguous)."""
    if tenant is None:
        return client_salt
    return f"tenant:{tenant}" if client_salt is None else f"tenant:{tenant}:salt:{client_salt}"


def read_key_file(path: str | Path) -> list[str]:
    """Keys from a file: one per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read API key file {path}: {exc}") from exc
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    return keys


class ApiKeyring:
    """The accepted keys and the tenant each one is."""

    def __init__(self, keys: Iterable[str]) -> None:
        unique = list(dict.fromkeys(keys))
        for key in unique:
            if not key or key != key.strip():
                raise ValueError("an API key must be non-empty and without surrounding whitespace")
        self._keys = [(f"Bearer {key}".encode(), tenant_id(key)) for key in unique]

    def __len__(self) -> int:
        return len(self._keys)

    def tenant_of(self, authorization: bytes) -> str | None:
        """The tenant whose key this Authorization header carries, or None. Every key is
        compared (constant time each), so the time taken does not tell which one matched."""
        found = None
        for expected, tenant in self._keys:
            if hmac.compare_digest(authorization, expected):
                found = tenant
        return found


class TenantAuthMiddleware:
    """Requires a known bearer key on every `/v1/*` route and records its tenant in the scope
    (read by `request_tenant`)."""

    def __init__(self, app: ASGIApp, keyring: ApiKeyring) -> None:
        self.app = app
        self.keyring = keyring

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            tenant = self.keyring.tenant_of(given)
            if tenant is None:
                await APIError(401, "invalid or missing API key", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"}).send(send)
                return
            scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


def request_tenant(scope: Scope) -> str | None:
    """The tenant the auth middleware found for this request (None when keys are not used)."""
    return scope.get(TENANT_SCOPE_KEY)
