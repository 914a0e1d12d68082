"""Atomic directories and files: write everything into a temporary sibling, fsync it, then rename it into place.

A kill at any moment leaves either the complete directory (the old one, or the new one) or a
temporary directory named `TEMP_PREFIX...`, which readers ignore and writers clean up. Used
for checkpoints and for the weights published to generation servers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from asyncgrpo.errors import AsyncGRPOError

TEMP_PREFIX = ".tmp-"


def leftover_temporaries(parent: Path, *, except_pid: int | None = None) -> list[Path]:
    """Temporary entries under `parent` that an interrupted atomic write of asyncgrpo left behind
    (named exactly as this module names them), except those of process `except_pid`, which may be
    writing right now. Nothing else matches, so cleaning these up never touches a user's files."""
    if not parent.is_dir():
        return []
    found = []
    for entry in parent.iterdir():
        match = _TEMP_NAME.match(entry.name)
        if match and int(match.group("pid")) != except_pid:
            found.append(entry)
    return found


def is_temporary(name: str) -> bool:
    """True for a name this module gives its temporary entries."""
    return _TEMP_NAME.match(name) is not None


_TEMP_NAME = re.compile(rf"^{re.escape(TEMP_PREFIX)}(old-)?.+-(?P<pid>\d+)-[0-9a-f]{{8}}$")


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `final`; when the block succeeds, its files are
    fsynced and it replaces `final`. When the block raises, it is removed and `final` is untouched."""
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{TEMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            trash = parent / f"{TEMP_PREFIX}old-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` to a temporary sibling, fsync it, and rename it over `path`."""
    tmp = path.parent / f"{TEMP_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def library_write_errors_as_os_errors(target: Path) -> Iterator[None]:
    """Make a library's failed write an OSError naming `target`, so disk faults are handled in one place.

    Libraries report them in their own words: safetensors raises SafetensorError "... I/O error:
    No space left on device (os error 28)", torch.save a RuntimeError ("unexpected pos 64 vs 0")."""
    try:
        yield
    except (OSError, AsyncGRPOError):  # asyncgrpo's own errors (a trainer rank lost mid-write) keep their diagnosis
        raise
    except Exception as exc:
        code = re.search(r"os error (\d+)", str(exc))
        number = int(code.group(1)) if code else errno.EIO
        why = os.strerror(number) if code else f"{type(exc).__name__}: {exc}"
        raise OSError(number, why, str(target)) from exc


def fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
