"""A process's tree on Linux (/proc): what the launchers kill and the CPU figures count (a leaf: no deltaps imports)."""
from __future__ import annotations

import os
import signal


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


def kill_descendants(pid: int) -> None:
    """SIGKILL every live descendant of pid (not pid itself): torchrun's agent runs its worker in a session of its
    own, which a kill of the agent alone would leave running."""
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
