"""The launcher of a command agent: it starts the agent's program and takes its whole process group down with the run.

Job: `python launcher.py <run pid> <command...>` (agents/command.py runs it by path, as the leader of a new session,
so a process group of its own) starts the command as its child, in that group, waits for it and exits as it did. If
the run dies first, SIGKILL goes to the whole group: the command and whatever it started there. The kernel's
parent-death signal alone (PR_SET_PDEATHSIG on the command) would end the command but orphan what it started.

How: the kernel sends this process SIGHUP when the run's thread that started it dies (PR_SET_PDEATHSIG; Linux), and its
handler sends SIGKILL to the group (this process included). A run that was gone before that took effect is seen by the
parent pid check, with the same ending. The run's own signals go to the whole group (agents/command.py): SIGTERM,
the cancellation, is the command's to act on (this process waits for the command's exit), SIGKILL ends everyone.

Invariants: it runs only as the leader of its own process group (else it exits 1 at once, signalling no one); the
command runs with the signal dispositions the run gave this process (handlers reset by exec); its
ending is this process's: the same exit status, or death by the same signal (a command that cannot be executed exits
127, as a shell's "command not found"); standard library only and nothing of asyncgrpo imported, so it starts in a few
tens of milliseconds; it outlives the command only until it has seen the command's exit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
NOT_FOUND = 127


def _kill_group(signum: int, frame: object) -> None:
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> None:
    run_pid, command = int(argv[1]), argv[2:]
    if os.getpgrp() != os.getpid():  # the group it would kill is its caller's
        sys.exit("launcher.py must lead a process group of its own (start it with start_new_session=True)")
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the command's to act on; a handler, so exec resets it
    signal.signal(signal.SIGHUP, _kill_group)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGHUP, 0, 0, 0)
    if os.getppid() != run_pid:  # the run died before the death signal was asked for
        _kill_group(signal.SIGHUP, None)
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(command[0], command)
        except OSError as error:
            print(f"cannot execute {command[0]!r}: {error}", file=sys.stderr)
        os._exit(NOT_FOUND)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code < 0:  # killed by a signal: end by the same one
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv)
