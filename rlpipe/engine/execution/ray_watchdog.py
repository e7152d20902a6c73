"""A watchdog for the local Ray a driver starts: when the driver dies without shutting Ray down (SIGKILL, the
kernel's OOM killer), the processes it left are ended within a bound.

Ray ends most of a local cluster when its driver dies, but not all: after a ``kill -9`` of the driver its
dashboard and runtime-env agents ran on for minutes (measured here), holding memory and ports. The watchdog
is a small process of its own session (so it outlives the driver and is not in its process group), started
by :func:`rlpipe.engine.execution.ray_runtime.init_ray` when it starts a Ray of its own (never when it joins a
cluster). It notes the driver's descendants every :data:`POLL_S` seconds (Ray's processes, the workers' engine
servers); once the driver is gone it sends each one still running SIGTERM, then SIGKILL after
:data:`GRACE_S`. A driver that shut Ray down leaves nothing for it to end. psutil compares start times, so a
reused pid is never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 1.0
"""How often the watchdog looks at the driver and notes its descendants."""
GRACE_S = 3.0
"""How long a process left behind gets after SIGTERM before SIGKILL."""


def start(driver_pid: int) -> subprocess.Popen:
    """Start the watchdog of ``driver_pid`` (in a session of its own, quiet)."""
    return subprocess.Popen([sys.executable, "-m", "rlpipe.engine.execution.ray_watchdog", str(driver_pid)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def watch(driver_pid: int) -> int:
    """Watch ``driver_pid`` until it ends; end what it left; returns how many processes were ended."""
    import psutil

    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return 0
    noted: dict[int, psutil.Process] = {}
    me = os.getpid()  # the driver started this process: it is one of its descendants
    while True:
        try:
            if driver.status() == psutil.STATUS_ZOMBIE:
                break
            for child in driver.children(recursive=True):
                if child.pid != me:
                    noted.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        time.sleep(POLL_S)
    left = []
    for process in noted.values():
        try:
            if process.is_running():  # same pid and start time: the process noted, not a newcomer
                left.append(process)
                left.extend(process.children(recursive=True))  # started since the last look
        except psutil.NoSuchProcess:
            pass
    for process in left:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return len(left)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
