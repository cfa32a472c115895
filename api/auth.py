"""Bearer-token auth: who is calling, and may they touch this job.

Tokens are random 256-bit strings shown once by ``meridian token create``; the token file keeps only their
SHA-256 (a fast hash is enough for high-entropy secrets: there is nothing to brute-force the way there is for
passwords). A token is never logged, never stored in plain text and never echoed in an error.

Auth is on when the settings say so, and always when the service binds a non-loopback address: the service
refuses to start there without tokens (:func:`check_bind`). With auth off every caller is the anonymous
owner ``""``, who sees every job (a workstation). With auth on, a token may expire, may be revoked (``meridian
token revoke``: the running service reads the file again within :data:`RELOAD_S`), and may be an admin's, whose
caller sees and acts on every owner's jobs and sets their quotas.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from meridian.service.errors import JobNotFound, Unauthorized
from meridian.service.store import JobRecord

TOKEN_PREFIX = "mrd_"
OWNER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}$"
RELOAD_S = 0.5
"""A running service looks at its token file's change time this often: a revoked token is refused within it."""


class UnsafeDeployment(ValueError):
    """The service would serve a non-loopback address without auth."""


def hash_token(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenEntry:
    owner: str
    hash: str
    created_at: float
    expires_at: float | None = None
    """After this (epoch seconds) the token is refused; ``None``: it does not expire."""
    admin: bool = False
    """The token's caller sees every owner's jobs and sets quotas."""

    @property
    def id(self) -> str:
        """A short name of the token for listing and revoking (from its hash: it says nothing of the token)."""
        return self.hash.removeprefix("sha256:")[:12]

    def valid_at(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


def read_tokens(path: str | Path) -> tuple[TokenEntry, ...]:
    """The entries of a token file (missing file: none)."""
    p = Path(path)
    if not p.exists():
        return ()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read token file {p}: {e.strerror}") from None
    try:
        data = json.loads(text)
        return tuple(TokenEntry(owner=e["owner"], hash=e["hash"], created_at=float(e.get("created_at", 0)),
                                expires_at=float(e["expires_at"]) if e.get("expires_at") is not None else None,
                                admin=bool(e.get("admin", False)))
                     for e in data["tokens"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"token file {p} is not a Meridian token file ({e}); fix or remove it") from None


def _write_tokens(p: Path, entries: list[TokenEntry]) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    # Owner-only permissions from the first byte: the hashes are not secrets, but the owner list is private.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"tokens": [e.__dict__ for e in entries]}, f, indent=2)
    os.replace(tmp, p)  # whole or not at all: a running service never reads half a file


def create_token(path: str | Path, owner: str, *, expires_in_s: float | None = None, admin: bool = False) -> str:
    """Add a new token for ``owner`` to the token file (only its hash) and return the token itself."""
    if not re.match(OWNER_PATTERN, owner):
        raise ValueError(f"owner {owner!r} must match {OWNER_PATTERN}")
    if expires_in_s is not None and expires_in_s <= 0:
        raise ValueError(f"expires_in_s must be > 0, got {expires_in_s}")
    p = Path(path)
    entries = list(read_tokens(p))
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = time.time()
    entries.append(TokenEntry(owner=owner, hash=hash_token(token), created_at=now, admin=admin,
                              expires_at=now + expires_in_s if expires_in_s is not None else None))
    _write_tokens(p, entries)
    return token


def revoke_token(path: str | Path, token_id: str) -> TokenEntry:
    """Remove the token whose :attr:`TokenEntry.id` is ``token_id`` (or starts with it, if only one does); the
    entry removed. A running service refuses it within :data:`RELOAD_S`."""
    p = Path(path)
    entries = list(read_tokens(p))
    found = [e for e in entries if e.id.startswith(token_id)] if token_id else []
    if len(found) != 1:
        known = ", ".join(f"{e.id} ({e.owner})" for e in entries) or "none"
        what = "no token" if not found else f"{len(found)} tokens"
        raise ValueError(f"{what} in {p} with id {token_id!r}; the ids there: {known} (`meridian token list`)")
    _write_tokens(p, [e for e in entries if e is not found[0]])
    return found[0]


class TokenBook:
    """The token file as the running service knows it: read again whenever the file changed (its modification
    time, size or inode), looked at no more than every :data:`RELOAD_S`. A file that cannot be read keeps the
    tokens read last (a half-edited file must not lock everyone out) and says so in :attr:`error`."""

    def __init__(self, path: str, entries: tuple[TokenEntry, ...] = ()) -> None:
        self.path = path
        self._by_hash = {e.hash: e for e in entries}
        self._seen: tuple[float, int, int] | None = self._stat()
        self._checked = time.monotonic()
        self._lock = threading.Lock()
        self.error = ""

    def _stat(self) -> tuple[float, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._checked < RELOAD_S:
                return
            self._checked = time.monotonic()
            seen = self._stat()
            if seen == self._seen:
                return
            try:
                entries = read_tokens(self.path)
            except ValueError as e:
                self.error = str(e)
                return
            self._by_hash, self._seen, self.error = {e.hash: e for e in entries}, seen, ""

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry of ``token`` if it is known and has not expired."""
        self._refresh()
        entry = self._by_hash.get(hash_token(token))
        return entry if entry is not None and entry.valid_at(time.time()) else None

    def __len__(self) -> int:
        return len(self._by_hash)


@dataclass(frozen=True, kw_only=True)
class AuthSettings:
    enabled: bool = False
    token_file: str = ""
    """JSON file of token hashes (``meridian token create`` writes it); read again when it changes."""
    book: TokenBook | None = field(default=None, compare=False)
    """The tokens, kept current with the file (``None`` with auth off)."""

    @property
    def hashes(self) -> dict[str, str]:
        """token hash → owner, as the file holds them now."""
        return {h: e.owner for h, e in (self.book._by_hash.items() if self.book else ())}

    @classmethod
    def load(cls, *, enabled: bool, token_file: str) -> AuthSettings:
        entries = read_tokens(token_file) if enabled else ()
        if enabled and not entries:
            raise UnsafeDeployment(
                f"auth is on but {token_file} holds no tokens: create one with "
                f"`meridian token create --owner NAME --token-file {token_file}`")
        return cls(enabled=enabled, token_file=token_file, book=TokenBook(token_file, entries) if enabled else None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname that may resolve anywhere: treat as exposed


def check_bind(host: str, auth: AuthSettings) -> None:
    """Refuse to serve a non-loopback address without auth (anyone on the network could run jobs)."""
    if not is_loopback(host) and not auth.enabled:
        raise UnsafeDeployment(
            f"refusing to serve {host} without auth: anyone who can reach it could run and cancel jobs. "
            "Pass --auth with a token file (`meridian token create`), or bind 127.0.0.1")


def host_name(host_header: str) -> str:
    """The name of a ``Host`` header without its port (``[::1]:8080`` → ``::1``)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:].split("]", 1)[0]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class LoopbackHostOnly:
    """With auth off, answer only requests addressed to a loopback name (``localhost``, ``*.localhost``,
    ``127.0.0.1``, ``::1``): a web page on another site that rebinds its own DNS name to 127.0.0.1 sends its
    own name as ``Host`` and is refused, so it cannot drive a workstation's unauthenticated service."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), "")
            name = host_name(host)
            if not (is_loopback(name) or name.endswith(".localhost")):
                from meridian.api.errors import send_problem

                await send_problem(send, 403, f"Host {host[:100]!r} is not a loopback name: with auth off this "
                                              "service only answers requests addressed to localhost or 127.0.0.1 "
                                              "(protection against DNS rebinding). Use http://127.0.0.1:<port>, or "
                                              "serve with --auth", instance=scope.get("path", ""))
                return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Caller:
    owner: str
    """``""`` when auth is off: the workstation user, who sees every job."""
    authenticated: bool
    admin: bool = False
    """An admin's token: sees and acts on every owner's jobs, and sets quotas."""

    def check_owns(self, job: JobRecord) -> JobRecord:
        """The job, if the caller may see it; another owner's job answers exactly like a missing one (404),
        so job ids of other owners cannot be probed."""
        if self.authenticated and not self.admin and job.owner != self.owner:
            raise JobNotFound(job.id)
        return job

    @property
    def owner_filter(self) -> str | None:
        return self.owner if self.authenticated and not self.admin else None

    @property
    def may_administer(self) -> bool:
        """May set quotas: an admin, or anyone on a workstation with auth off."""
        return self.admin or not self.authenticated


_bearer = HTTPBearer(auto_error=False, description="a token from `meridian token create`")


def get_caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    auth: AuthSettings = request.app.state.auth
    if not auth.enabled:
        return Caller(owner="", authenticated=False)
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise Unauthorized("this endpoint needs a bearer token: send 'Authorization: Bearer <token>' "
                           "(create one with `meridian token create`; the CLI reads $MERIDIAN_TOKEN)")
    entry = auth.book.lookup(credentials.credentials) if auth.book is not None else None
    if entry is None:
        raise Unauthorized("the bearer token is not valid here (unknown, revoked or expired); create a new one with "
                           "`meridian token create`")
    return Caller(owner=entry.owner, authenticated=True, admin=entry.admin)


CallerDep = Annotated[Caller, Depends(get_caller)]
