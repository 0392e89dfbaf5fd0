"""The real memory limit (:mod:`harness.memlimit`): a memory cgroup with a hard limit, and RLIMIT_AS.

Real cgroups on this machine (v1 ``memory`` or v2, as root): a child that allocates past the limit is
OOM-killed and the group's counters say so; one below it survives with its peak counted; the group is
gone after the ``with``, after Ctrl-C, and (swept by the next run) after its owner was SIGKILLed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from harness.child import run_child
from harness.errors import EXIT_NO_MEMLIMIT
from harness.memlimit import (
    PREFIX,
    MemoryCgroup,
    address_limit_preexec,
    address_space,
    cgroup_support,
    limit_address_space,
    sweep_stale,
)

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _alloc(mib: int) -> list[str]:
    """A child that touches ``mib`` MiB of anonymous memory, then says so."""
    return [sys.executable, "-c", f"b = bytearray({mib} << 20); print('allocated', len(b) >> 20)"]


def _ours() -> list[str]:
    support = cgroup_support()
    assert support is not None
    return sorted(p.name for p in support[1].iterdir() if p.name.startswith(PREFIX))


def test_this_machine_has_a_writable_memory_cgroup() -> None:
    """The CI machine is root on a machine with cgroup v1 ``memory`` (or v2): nothing here may skip."""
    support = cgroup_support()
    assert support is not None, "no writable memory cgroup (v1 memory or v2 memory controller) on this machine"
    assert support[0] in (1, 2) and support[1].is_dir()


def test_the_limit_is_applied_and_the_group_removed() -> None:
    with MemoryCgroup(limit_bytes=96 * MIB) as cg:
        path = cg.path
        assert path is not None and path.is_dir() and path.name.startswith(PREFIX)
        c = cg.counters()
        assert c.limit_bytes == 96 * MIB
        assert c.oom_kills == 0
        cg.set_limit(200 * MIB)
        assert cg.counters().limit_bytes == 200 * MIB
        cg.set_limit(64 * MIB)  # lowering keeps v1's memsw >= limit rule
        assert cg.counters().limit_bytes == 64 * MIB
        cg.set_limit(None)
        assert cg.counters().limit_bytes is None
    assert not path.exists()


def test_a_child_past_the_limit_is_oom_killed_and_seen_as_such() -> None:
    with MemoryCgroup(limit_bytes=64 * MIB) as cg:
        r = run_child(_alloc(256), timeout=60, preexec=cg.preexec)
        c = cg.counters()
        path = cg.path
    assert r.status == "signalled" and r.signal == "SIGKILL", r.describe() + r.stderr[-300:]
    assert "allocated" not in r.stdout
    assert c.oom_kills == 1, c
    assert c.peak_bytes <= 64 * MIB
    assert c.peak_bytes > 32 * MIB  # it did get up to the limit
    assert path is not None and not path.exists()


def test_a_child_below_the_limit_survives_with_its_peak_counted() -> None:
    with MemoryCgroup(limit_bytes=256 * MIB) as cg:
        r = run_child(_alloc(100), timeout=60, preexec=cg.preexec)
        c = cg.counters()
    assert r.status == "exited" and r.returncode == 0 and "allocated 100" in r.stdout, r.describe()
    assert c.oom_kills == 0
    assert 100 * MIB <= c.peak_bytes <= 256 * MIB, c


def test_the_peak_is_reset_before_the_part_measured() -> None:
    with MemoryCgroup(limit_bytes=512 * MIB) as cg:
        r = run_child(_alloc(150), timeout=60, preexec=cg.preexec)
        assert r.returncode == 0
        assert cg.peak() >= 150 * MIB
        cg.reset_peak()
        assert cg.peak() < 150 * MIB  # the child is gone: the peak starts over from what is left


_OWNER = textwrap.dedent(
    """
    import subprocess, sys, time
    from harness.interrupt import guard
    from harness.memlimit import MemoryCgroup
    with guard():
        with MemoryCgroup(limit_bytes=256 << 20) as cg:
            # no PR_SET_PDEATHSIG: the sweep itself must kill what is left in a stale group
            p = subprocess.Popen(["sleep", "300"], preexec_fn=cg.preexec, start_new_session=True)
            print(cg.path, p.pid, flush=True)
            try:
                time.sleep(300)
            finally:
                p.kill()
                p.wait()
    """
)


def _start_owner() -> tuple[subprocess.Popen[str], Path, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", _OWNER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line, proc.stderr.read() if proc.stderr else ""
    return proc, Path(line[0]), int(line[1])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_group_left_by_a_sigkilled_owner_is_swept_by_the_next_run() -> None:
    proc, path, child = _start_owner()
    try:
        assert path.is_dir() and child in [int(x) for x in (path / "cgroup.procs").read_text().split()]
        proc.kill()  # kill -9 of the harness: no cleanup runs
        proc.wait()
        assert path.is_dir(), "a SIGKILLed owner cannot remove its group"
        assert path.name in sweep_stale()
        assert not path.exists()
        deadline = time.monotonic() + 5
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), "the process left in the stale group was not killed"
        with MemoryCgroup():  # a new run sweeps too; our own live groups are never swept
            assert path.name not in _ours()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sweep_stale()


def test_ctrl_c_removes_the_group_and_its_processes() -> None:
    proc, path, child = _start_owner()
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) != 0
        assert not path.exists()
        assert _gone(child)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sweep_stale()


def test_no_cgroup_is_one_line_with_its_own_exit_code() -> None:
    """A machine without a memory cgroup, made for real: a private mount namespace whose cgroup v1 ``memory``
    and cgroup v2 mounts are gone. The command says why in one line and exits 5 before any build."""
    assert shutil.which("unshare"), "util-linux's unshare is needed to hide the cgroup mounts"
    hide = " && ".join(f"umount -l {m}" for m in _cgroup_mounts())
    script = f"{hide} && exec {sys.executable} -P -m harness oom --mode cgroup"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)  # fmt: skip
    assert r.returncode == EXIT_NO_MEMLIMIT == 5, r.stderr[-500:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no memory limit can be set on this machine"), lines
    assert "cgroup v1" in lines[0] and "cgroup v2" in lines[0] and "Traceback" not in r.stderr


def _cgroup_mounts() -> list[str]:
    """Mount points of the cgroup v1 ``memory`` hierarchy and of cgroup v2."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, opts = right.split()[:3]
        if fstype == "cgroup2" or (fstype == "cgroup" and "memory" in opts.split(",")):
            out.append(left.split()[4])
    return out


def test_rlimit_as_turns_an_allocation_past_it_into_an_error_the_child_sees() -> None:
    code = "try:\n b = bytearray(512 << 20)\n print('allocated')\nexcept MemoryError:\n print('MemoryError')\n"
    r = run_child([sys.executable, "-c", code], timeout=60, preexec=address_limit_preexec(256 * MIB))
    assert r.status == "exited" and "MemoryError" in r.stdout, r.describe() + r.stderr[-300:]


def test_rlimit_as_on_a_running_process() -> None:
    code = (
        "import sys\nsys.stdin.readline()\n"
        "try:\n b = bytearray(512 << 20)\n print('allocated', flush=True)\n"
        "except MemoryError:\n print('MemoryError', flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdin is not None
        limit_address_space(p.pid, address_space(p.pid) + 128 * MIB)
        out, _ = p.communicate("go\n", timeout=60)
        assert "MemoryError" in out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
