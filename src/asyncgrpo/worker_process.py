"""Start a Python worker process linked to this one by a socket pair.

Job: `start_worker(module)` runs `python -c "<import module>; main()" <fd>` in a session of its
own (so a kill of its process group stops whatever it started), with stdin closed and the child's
end of a socket pair as its one extra file descriptor, and returns the process and the parent's
stream pair. Used by the reward worker pool (rewards/pool.py) and the environment's worker process
(environments/process_host.py); what is said over the link is theirs.

Invariants: the child's end is closed in this process whatever happens; if the link cannot be
opened the process is killed before the error goes on (it is never left running unseen).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[1])  # the directory holding the asyncgrpo package


async def start_worker(module: str) -> tuple[asyncio.subprocess.Process, asyncio.StreamReader, asyncio.StreamWriter]:
    """Start `module.main()` in a fresh interpreter, given the socket's fd as its first argument."""
    boot = f"import sys; sys.path.insert(0, {_SRC!r}); from {module} import main; main()"
    parent, child = socket.socketpair()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", boot, str(child.fileno()),
            stdin=asyncio.subprocess.DEVNULL, pass_fds=(child.fileno(),), start_new_session=True,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    try:
        reader, writer = await asyncio.open_connection(sock=parent)
    except BaseException:
        parent.close()
        proc.kill()
        raise
    return proc, reader, writer
