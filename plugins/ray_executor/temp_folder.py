"""Folders for Ray's files (a local instance's, a simulated cluster's head) whose socket
paths fit: Ray puts its sockets at ``<folder>/session_<date>_<time>_<microseconds>_<pid>/
sockets/...`` and fails to start with an OSError when such a path passes AF_UNIX's 107 bytes,
as it does under a long ``TMPDIR``."""

from __future__ import annotations

import tempfile

#: The longest path an AF_UNIX socket takes.
_SOCKET_PATH_MAX = 107
#: What Ray adds under its folder for its longest socket path.
_RAY_SOCKET_TAIL = len("/session_2026-12-03_16-58-50_101937_4194304/sockets/plasma_store")
#: Where the folder goes instead when the temporary directory's path is too long.
_SHORT_BASE = "/tmp"


def ray_temp_folder(prefix: str) -> str:
    """A new folder, named ``prefix`` and 8 random characters, under the system's temporary
    directory (``TMPDIR``), or under ``/tmp`` where that path is so long that Ray's sockets in
    the folder would not fit an AF_UNIX path."""
    base = tempfile.gettempdir()
    if len(base) + len(f"/{prefix}12345678") + _RAY_SOCKET_TAIL > _SOCKET_PATH_MAX:
        base = _SHORT_BASE
    return tempfile.mkdtemp(prefix=prefix, dir=base)
