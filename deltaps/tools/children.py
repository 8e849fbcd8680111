"""How the tools start the Python programs they time in child processes: `python -m <module> <program> <args>`
with this interpreter and this checkout first on PYTHONPATH, so the child imports the same code as its parent
whatever its cwd (children may run under `ip netns exec` from anywhere)."""
from __future__ import annotations

import os
import signal
import sys

# deltaps/tools/children.py -> the checkout holding deltaps/, ps/, worker/
CHECKOUT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checkout_env() -> dict:
    """The environment for child programs: this checkout first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": CHECKOUT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def module_command(module: str, program: str, *args) -> list[str]:
    """argv running `program` of the module's main(argv) in a fresh interpreter (args as strings)."""
    return [sys.executable, "-m", module, program, *(str(a) for a in args)]


def run_program(programs: dict, argv: list[str], module: str) -> int:
    """Dispatch `PROGRAM ARGS...` to one entry of a {name: (argument names, run)} table."""
    if not argv or argv[0] not in programs or len(argv) - 1 != len(programs[argv[0]][0]):
        usage = "\n".join(f"  python -m {module} {name} {' '.join(a.upper() for a in names)}"
                          for name, (names, _) in programs.items())
        print(f"usage:\n{usage}", file=sys.stderr)
        return 2
    programs[argv[0]][1](*argv[1:])
    return 0


def install_signal_handlers() -> dict:
    """SIGTERM/SIGHUP -> SystemExit and SIGINT -> KeyboardInterrupt, so a program's `finally` blocks run (its
    children stopped, network namespaces torn down, scratch removed) when a supervisor (timeout, systemd, a pod's
    deletion) or a Ctrl-C ends it. The first one in makes the program ignore the rest: a second Ctrl-C or a resent
    SIGTERM would cut that cleanup short. A signal the program was started ignoring (nohup's SIGHUP, a background
    job's SIGINT) stays ignored. Returns the old handlers."""
    managed = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    old = {}

    def handler(signum, _frame):
        for sig in old:
            signal.signal(sig, signal.SIG_IGN)
        old.clear()      # the program is ending: a restore on its way out must not re-arm the default (a kill)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    for sig in managed:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handler)
    return old


def restore_signal_handlers(old: dict) -> None:
    for sig, h in old.items():
        signal.signal(sig, h)
