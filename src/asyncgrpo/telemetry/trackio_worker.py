"""trackio in a process of its own, so that each run's trackio store is the folder the run chooses.

trackio reads its store's folder from `TRACKIO_DIR` once, when it is first imported, into constants of several of
its modules (trackio, trackio.utils, trackio.sqlite_storage, trackio.run, ...), and `trackio.init` has no option
for it: a process that has imported trackio once (a second run in one Python process, a notebook) cannot point it
at another folder. So telemetry/sinks.py's TrackioTracker runs this file as a script, with `TRACKIO_DIR` set in
its environment, and relays the run's calls to it; it imports nothing of asyncgrpo (it runs by path, with the
same Python, wherever asyncgrpo itself was imported from).

Protocol, one JSON document per line: requests on stdin, `["init", kwargs]`, `["log", values, step]`,
`["finish"]`; one reply per request on the stdout it was started with, `null` when the call returned, or
`[error type, error text]` when it raised. trackio's own messages go to stderr (stdout is the reply channel).

Invariants:
- Each request gets exactly one reply, in order; after `finish` the process exits.
- The end of stdin (the parent closed it, or died, however) ends the process, and trackio's own exit hook
  finishes its run, keeping what was logged: the process never outlives its parent's pipe.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any


def serve(requests: Any, replies: Any) -> None:
    """Answer `requests` (lines of JSON) on `replies` until `finish` or the end of `requests`."""
    trackio: Any = None
    for line in requests:
        action, *args = json.loads(line)
        try:
            if action == "init":
                trackio = importlib.import_module("trackio")  # here, where an error has a reply to go to
                trackio.init(**args[0])
            elif action == "log":
                trackio.log(args[0], step=args[1])
            else:  # "finish"
                trackio.finish()
            reply = None
        except Exception as exc:  # noqa: BLE001 - any of trackio's errors goes back to the run, named
            reply = [type(exc).__name__, str(exc)]
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
        if action == "finish":
            return


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # trackio's prints (and any library's) go to stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
