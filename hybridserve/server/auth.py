"""API keys and tenants: every route but the public probes (`/health`, `/ready`) needs
`Authorization: Bearer KEY`, matched on the route the request reaches (so `--root-path` and
unknown paths cannot slip past), and each key's requests are cached under a salt derived from its
hash, so keys never share cache entries nor time each other through them (docs/serving.md,
security notes)."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from hybridserve.server.errors import APIError

TENANT_SCOPE_KEY = "hybridserve.tenant"


def tenant_id(api_key: str) -> str:
    """Stable identity of a key: the first 32 hex digits of its SHA-256."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


def tenant_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The salt a request is cached under. A client's salt alone lives under `client:`, a tenant's
    under `tenant:<id>` (combined with any client salt; the id is fixed-length, so the combination
    is unambiguous): no client salt can spell a tenant's namespace."""
    if tenant is None:
        return None if client_salt is None else f"client:{client_salt}"
    return f"tenant:{tenant}" if client_salt is None else f"tenant:{tenant}:salt:{client_salt}"


def check_key_file_mode(path: str | Path) -> None:
    """`ValueError` unless only the owner can read and write the key file (mode 0600 or 0400)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"cannot read API key file {path}: {exc.strerror or exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"API key file {path} is accessible to group or others (mode {stat.S_IMODE(mode):04o}); "
                         f"restrict it with: chmod 600 {path}")


def read_key_file(path: str | Path) -> list[str]:
    """Keys from a file only its owner may access: one per line; blank lines and lines starting
    with '#' are skipped."""
    check_key_file_mode(path)
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read API key file {path}: {exc.strerror or exc}") from exc
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


PUBLIC_PATHS = ("/health", "/ready")  # the probes a load balancer calls without a key


class TenantAuthMiddleware:
    """Requires a known bearer key on every request except those a public route (`public_routes`)
    fully matches, and records the key's tenant in the scope (read by `request_tenant`). Routes
    match as the router does (Starlette strips the root path), so the check cannot be bypassed
    by a path prefix; an unknown path needs a key too (no route discovery without one)."""

    def __init__(self, app: ASGIApp, keyring: ApiKeyring, public_routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.keyring = keyring
        self.public_routes = list(public_routes)

    def _is_public(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] is Match.FULL for route in self.public_routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._is_public(scope):
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
