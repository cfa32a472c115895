"""How the WAN emulator names its shared files (:mod:`meridian.workers.wan.link`), torch-free: the service's
end-of-job sweep (:func:`meridian.workers.state.snapshot_paths.remove_snapshot_dirs`) finds a killed job's files
by the same rules the emulator wrote them with."""

from __future__ import annotations

import hashlib
import re

FILE_PREFIX = "meridian-wan-"
"""Every shared file of the emulator is ``<FILE_PREFIX><key>+<what>``."""


def safe_name(name: str) -> str:
    """``name`` as it may stand in a file name: itself when short and plain, else cut and hashed."""
    if re.fullmatch(r"[A-Za-z0-9_.\-]{1,40}", name):
        return name
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)[:24] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
