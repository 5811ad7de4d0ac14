"""A candidate's scratch directory as a tree the judge walks and removes (issue 62, rows 9 and 10).

The candidate owns everything inside, so its shape is input: 3,000 nested directories made
``shutil.rmtree`` and ``os.fwalk`` (both recursive) raise RecursionError in the judge, and a worker
was lost twice with 268 MiB left on disk. Every walk here is iterative, follows no link
(``O_NOFOLLOW``, ``lstat``) and holds at most ``MAX_WALK_DEPTH`` directory descriptors; removal
holds two, whatever the depth, by hoisting each nested directory up to the top before emptying it.

Only the standard library is imported here (``kpipe.gym.confine.limits`` uses it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

# deeper than this, a walk stops and says so (``Entry.too_deep``): a tree an honest candidate never
# makes (its compile caches nest 4-6 levels), and a bound on the judge's open descriptors
MAX_WALK_DEPTH = 128
# every entry is charged at least one block of the disk quota: inodes cost the disk too, and a
# million empty files would otherwise be free
ENTRY_BYTES = 4096
OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True)
class Entry:
    """One entry of a walk: its path relative to the top, its ``lstat``; ``too_deep`` marks a
    directory past ``MAX_WALK_DEPTH``, whose contents the walk did not visit."""

    path: str
    info: os.stat_result
    too_deep: bool = False


def walk(top_fd: int, max_entries: int | None = None) -> Iterator[Entry]:
    """Every entry under the directory open as `top_fd`, depth first, without recursion and
    without following a link; at most `max_entries` of them."""
    stack: list[tuple[int, str, Iterator[os.DirEntry[str]]]] = []
    count = itertools.count(1)

    def enter(fd: int, path: str) -> None:
        stack.append((fd, path, iter(list(os.scandir(fd)))))

    try:
        enter(os.dup(top_fd), "")
        while stack:
            fd, path, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(stack.pop()[0])
                continue
            try:
                info = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
            except OSError:  # gone meanwhile
                continue
            relative = f"{path}/{entry.name}" if path else entry.name
            deep = stat.S_ISDIR(info.st_mode) and len(stack) >= MAX_WALK_DEPTH
            yield Entry(relative, info, too_deep=deep)
            if max_entries is not None and next(count) >= max_entries:
                return
            if stat.S_ISDIR(info.st_mode) and not deep:
                with contextlib.suppress(OSError):  # unreadable, or replaced by a link meanwhile
                    enter(os.open(entry.name, OPEN_DIRECTORY, dir_fd=fd), relative)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


@dataclass(frozen=True)
class Usage:
    """What a scratch directory holds: bytes on disk (allocated blocks, each entry at least
    ``ENTRY_BYTES``), entries, and whether it nests past ``MAX_WALK_DEPTH``."""

    bytes: int
    entries: int
    too_deep: bool


def disk_usage(top_fd: int, max_entries: int) -> Usage:
    """The usage of the tree under `top_fd`, counting at most `max_entries` entries. Allocated
    blocks, not sizes: a file ``fallocate``d with ``FALLOC_FL_KEEP_SIZE`` is 0 bytes long and
    holds gigabytes."""
    total, entries, too_deep = 0, 0, False
    for entry in walk(top_fd, max_entries):
        total += max(entry.info.st_blocks * 512, ENTRY_BYTES)
        entries += 1
        too_deep |= entry.too_deep
    return Usage(total, entries, too_deep)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove directory `path` and everything in it, whatever its depth, following no link and
    never recursing: each directory found inside is renamed up to the top level before it is
    emptied, so two descriptors suffice. Best effort, as ``shutil.rmtree(ignore_errors=True)``:
    what cannot be removed stays."""
    try:
        top = os.open(path, OPEN_DIRECTORY)
    except OSError:
        return
    hoisted = itertools.count()
    try:
        progress = True
        while progress:  # every pass empties the directories at the top, hoisting their subdirectories
            progress = False
            for name in os.listdir(top):
                progress |= remove_entry(top, name, hoisted)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def remove_entry(top: int, name: str, hoisted: Iterator[int]) -> bool:
    """Remove entry `name` of directory `top`; a directory has its files removed and its
    subdirectories renamed into `top` (to be removed by the next pass). Whether anything changed."""
    try:
        info = os.stat(name, dir_fd=top, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=top)
            return True
        return False
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=top)
        return True
    with contextlib.suppress(OSError):
        os.chmod(name, 0o700, dir_fd=top)  # the candidate may have made it unreadable; it is ours (no link: lstat'ed above)
    try:
        inner = os.open(name, OPEN_DIRECTORY, dir_fd=top)
    except OSError:
        return False
    changed = False
    try:
        for child in os.listdir(inner):
            try:
                child_info = os.stat(child, dir_fd=inner, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(child_info.st_mode):
                changed |= hoist(inner, child, top, hoisted)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(child, dir_fd=inner)
                    changed = True
    finally:
        os.close(inner)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=top)
        changed = True
    return changed


def hoist(parent: int, name: str, top: int, hoisted: Iterator[int]) -> bool:
    """Rename directory `name` of `parent` into `top` under a new name; whether it moved."""
    for _ in range(100):  # a name the candidate planted is skipped
        target = f".kgym-removing-{next(hoisted)}"
        with contextlib.suppress(FileNotFoundError):
            os.stat(target, dir_fd=top, follow_symlinks=False)
            continue
        try:
            os.rename(name, target, src_dir_fd=parent, dst_dir_fd=top)
            return True
        except OSError:
            continue
    return False
