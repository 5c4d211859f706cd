"""Stop a launched server's process group when the process that launched it dies, however it dies.

``python -m backends.parent_guard PARENT_PID SERVER_PID GRACE_S`` runs beside a server that leads its own
process group (see :class:`backends.launcher.ServerProcess`, which kills the guard when it stops the
server). It blocks on a pidfd of ``PARENT_PID``; when that process exits (a SIGKILL included, which no
``finally`` can catch) it sends SIGTERM to the server's group, and SIGKILL when the server is still there
after ``GRACE_S``. A pidfd names the process, not the
thread that forked the server, so a server started from a worker thread outlives that thread (which
``PR_SET_PDEATHSIG`` would not allow). Imports only the standard library: it starts in milliseconds.
"""

from __future__ import annotations

import os
import select
import signal
import sys


def main(parent: int, server: int, grace_s: float) -> None:
    try:
        watched = os.pidfd_open(parent)
    except ProcessLookupError:
        watched = None  # already gone
    if watched is not None and os.getppid() == parent:  # still our parent, not a reused pid
        select.select([watched], [], [])
    try:
        os.killpg(server, signal.SIGTERM)
        select.select([os.pidfd_open(server)], [], [], grace_s)
        os.killpg(server, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
