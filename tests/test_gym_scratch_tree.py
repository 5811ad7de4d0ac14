"""A candidate's scratch directory as the judge walks, measures and removes it (issue 62, rows 9 and
10; kpipe.gym.confine.scratch_tree and the disk quota of kpipe.gym.confine.limits). The attacks run end to end in
tests/test_gym_attack_robustness.py."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kpipe.gym.confine.isolate import ScratchDir
from kpipe.gym.confine.limits import MiB, ChildLimits, DiskQuota, Limits, Watchdog
from kpipe.gym.confine.scratch_tree import ENTRY_BYTES, MAX_WALK_DEPTH, disk_usage, remove_tree, walk

FALLOC_FL_KEEP_SIZE = 1


def nest(top: Path, depth: int, name: str = "d") -> None:
    """`depth` directories, each inside the last, made through descriptors (no path is that long)."""
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    Path(f"/proc/self/fd/{fd}/deepest.txt").write_text("at the bottom")
    os.close(fd)


def reserve(path: Path, nbytes: int) -> None:
    """Blocks reserved for `path` without growing it (no file-size limit sees them)."""
    with open(path, "wb") as handle:
        assert ctypes.CDLL(None, use_errno=True).fallocate(handle.fileno(), FALLOC_FL_KEEP_SIZE, ctypes.c_long(0),
                                                           ctypes.c_long(nbytes)) == 0


def open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def test_3000_nested_directories_are_removed_without_recursion(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    nest(scratch, 3000)
    os.chmod(scratch / "d", 0)  # made unreadable by the candidate: still its own, removed
    remove_tree(scratch)
    assert not scratch.exists()


def test_removal_follows_no_link(tmp_path: Path) -> None:
    outside, scratch = tmp_path / "outside", tmp_path / "scratch"
    outside.mkdir()
    (outside / "kept.txt").write_text("the judge's")
    scratch.mkdir()
    (scratch / "sub").mkdir()
    (scratch / "sub" / "to-outside").symlink_to(outside)
    (scratch / "to-outside").symlink_to(outside)
    remove_tree(scratch)
    assert not scratch.exists() and (outside / "kept.txt").read_text() == "the judge's"


def test_the_walk_stops_past_its_depth_and_says_so(tmp_path: Path) -> None:
    nest(tmp_path, 3000)
    fd = open_dir(tmp_path)
    try:
        usage = disk_usage(fd, max_entries=10_000)
        assert usage.too_deep and usage.entries == MAX_WALK_DEPTH
        assert ScratchDir(tmp_path).file_of_size(1) is None  # nothing past the depth is read, and nothing raises
    finally:
        os.close(fd)
        remove_tree(tmp_path / "d")  # pytest's own clean-up of old temporary directories recurses


def test_usage_counts_reserved_blocks_and_entries(tmp_path: Path) -> None:
    reserve(tmp_path / "reserved.bin", 64 * MiB)
    for index in range(100):
        (tmp_path / f"empty-{index}").touch()
    fd = open_dir(tmp_path)
    try:
        usage = disk_usage(fd, max_entries=10_000)
    finally:
        os.close(fd)
    assert (tmp_path / "reserved.bin").stat().st_size == 0
    assert usage.entries == 101 and usage.bytes >= 64 * MiB + 100 * ENTRY_BYTES and not usage.too_deep
    top = open_dir(tmp_path)
    try:
        assert len(list(walk(top, max_entries=3))) == 3
    finally:
        os.close(top)


def test_the_quota_names_what_the_child_left_once_it_is_gone(tmp_path: Path) -> None:
    reserve(tmp_path / "reserved.bin", 64 * MiB)
    limits = ChildLimits(Limits(None, None, None, disk_mb=32), None, tmp_path)
    try:
        assert "past the disk quota of 32 MiB" in limits.hit(0, lambda size: None)
    finally:
        limits.remove()
    within = ChildLimits(Limits(None, None, None, disk_mb=128), None, tmp_path)
    try:
        assert within.hit(0, lambda size: None) == ""
    finally:
        within.remove()


FILLS_ITS_DISK = """
import ctypes, sys, time
with open(sys.argv[1], "wb") as handle:
    ctypes.CDLL(None).fallocate(handle.fileno(), 1, ctypes.c_long(0), ctypes.c_long(64 << 20))
time.sleep(60)
"""


def test_the_watchdog_kills_a_child_past_its_disk_quota_while_it_runs(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", FILLS_ITS_DISK, str(tmp_path / "reserved.bin")], start_new_session=True)
    killed = threading.Event()

    def kill() -> None:
        os.killpg(process.pid, signal.SIGKILL)
        killed.set()

    watchdog = Watchdog(process.pid, None, None, kill, DiskQuota(open_dir(tmp_path), 32))
    watchdog.start()
    try:
        assert process.wait(timeout=60) == -signal.SIGKILL and killed.is_set()
        assert watchdog.record.startswith("disk: its scratch directory held 64 MiB"), watchdog.record
        assert watchdog.record.endswith("(killed by the judge's watchdog)")
    finally:
        watchdog.stop()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.parametrize("quota_mb", [16])
def test_a_protocol_below_the_least_quota_is_refused(quota_mb: int) -> None:
    from kpipe.gym.protocol import Protocol

    with pytest.raises(ValueError, match="disk_limit_mb"):
        Protocol(disk_limit_mb=quota_mb - 1)
