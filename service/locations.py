"""Which URLs a job may name (a dataset's, a tracker's, later a checkpoint's to resume from): only those under a
root the service's operator declared, e.g. ``meridian serve --data-root s3://bucket/prefix``.

The service and its workers open what a job names with the service's own credentials, so a URL a user chose
must not reach another bucket, another host or an internal address through them. The check is on the text of
the URL alone, before anything is fetched: the same scheme, the same host or bucket, and a path at or under the
root's, written plainly (no ``..`` or ``.`` segment, no empty segment, no percent-escape, no user name,
port, query or fragment that the root does not have). A refused URL gets the same answer whether or not
anything exists there, so the check reveals nothing about other stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit


class NotUnderRoots(ValueError):
    """A URL outside every declared root, or one written so that it cannot be compared with them."""


@dataclass(frozen=True)
class UrlRoot:
    """One declared root: ``scheme://host/path``."""

    scheme: str
    host: str
    """The bucket (object stores) or ``host[:port]`` (a server), lower-cased."""
    path: str
    """The path under the host, without leading or trailing ``/`` (``""``: the whole bucket)."""

    @classmethod
    def parse(cls, url: str) -> UrlRoot:
        """A root from the operator's ``url``; ``ValueError`` saying what is wrong with it."""
        try:
            return cls(*_parts(url))
        except NotUnderRoots as e:
            raise ValueError(f"root {url!r}: {e}") from None

    def holds(self, scheme: str, host: str, path: str) -> bool:
        return (scheme, host) == (self.scheme, self.host) and (
            not self.path or path == self.path or path.startswith(self.path + "/"))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}/{self.path}".rstrip("/")


def _parts(url: str) -> tuple[str, str, str]:
    """(scheme, host, path) of a URL written plainly; :class:`NotUnderRoots` otherwise."""
    if any(c in url for c in "\0\\%") or any(ord(c) < 0x21 for c in url):
        raise NotUnderRoots("has a control character, a space, a backslash or a percent-escape")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise NotUnderRoots(str(e)) from None
    if not parts.scheme or "://" not in url:
        raise NotUnderRoots("is not a URL (scheme://host/path)")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise NotUnderRoots("has a query or a fragment")
    if "@" in parts.netloc:
        raise NotUnderRoots("names a user (credentials come from the environment, never from a URL)")
    segments = parts.path.strip("/").split("/") if parts.path.strip("/") else []
    if any(s in ("", ".", "..") for s in segments):
        raise NotUnderRoots("has an empty, '.' or '..' path segment")
    return parts.scheme.lower(), parts.netloc.lower(), "/".join(segments)


def admit_url(url: str, roots: Sequence[UrlRoot], *, field: str, flag: str) -> str:
    """``url`` as a caller may use it (without a trailing ``/``) when it is at or under one of ``roots``; else
    :class:`NotUnderRoots` naming ``field`` and the fix (``flag``: the ``meridian serve`` option that declares
    roots), in the same words whether or not anything exists there."""
    declared = ", ".join(str(r) for r in roots) or "none declared"
    refused = NotUnderRoots(
        f"{field} {url!r} is not under a URL root this service declares ({declared}); name a location under one, "
        f"or start the service with `meridian serve {flag} SCHEME://BUCKET/PREFIX`")
    try:
        scheme, host, path = _parts(url)
    except NotUnderRoots:
        raise refused from None
    if not any(root.holds(scheme, host, path) for root in roots):
        raise refused
    return f"{scheme}://{host}/{path}".rstrip("/")
