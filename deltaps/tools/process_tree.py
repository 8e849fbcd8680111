"""Processes the launchers start: their trees on Linux (/proc), which the launchers kill and the CPU figures count,
how they are stopped, and how one past its deadline is asked where it waits (a leaf: no deltaps imports)."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (Linux /proc), children before their children."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except FileNotFoundError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def stat_fields(pid: int, task: int | None = None) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, parent pid, ... as proc(5) numbers them from 3), or
    /proc/PID/task/TASK/stat's (one thread's); None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    """pid exists and is not a zombie (exited, not yet reaped)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def kill_descendants(pid: int) -> None:
    """SIGKILL every live descendant of pid (not pid itself): torchrun's agent runs its worker in a session of its
    own, which a kill of the agent alone would leave running."""
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_processes(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM all of them at once, then wait for each within one shared grace; SIGKILL whoever outlasts it."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stop_children(pids: list[int], grace: float = 10.0) -> None:
    """Children of this process known by pid (a zygote's forks): SIGTERM all at once, reap them within one shared grace,
    SIGKILL whoever outlasts it and whatever it started."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    left, deadline = set(pids), time.monotonic() + grace
    while left:
        for pid in list(left):
            try:
                gone = os.waitpid(pid, os.WNOHANG)[0] == pid
            except ChildProcessError:       # reaped already
                gone = True
            if gone:
                left.discard(pid)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        kill_descendants(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


STACKS_SIGNAL = signal.SIGUSR1      # a deltaps worker writes every thread's stack to its log on it (faulthandler)


def catches(pid: int, sig: int) -> bool:
    """Whether process pid has a handler for sig (/proc/PID/status SigCgt); False once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


def ask_for_stacks(procs, settle_s: float = 0.5) -> int:
    """Workers still running past their deadline: ask each for its threads' stacks (STACKS_SIGNAL; `deltaps worker`
    registers it), so the log the error quotes shows where it waits. Only a process that catches the signal is asked
    (its default action ends a process: a torchrun agent, a worker still starting). The number asked."""
    alive = [p for p in procs if p.poll() is None and catches(p.pid, STACKS_SIGNAL)]
    for p in alive:
        p.send_signal(STACKS_SIGNAL)
    if alive:
        time.sleep(settle_s)        # faulthandler writes from its signal handler at once; leave it that long
    return len(alive)
