"""`deltaps lighthouse --bind HOST:PORT --min-replicas N [--quorum-tick-ms MS]`: torchft's Lighthouse (torchft's own
`LighthouseServer`, as its `torchft_lighthouse` program runs it) as a deltaps command, so a local cluster (bench
compare, launch) forks it from a zygote that has torch imported (deltaps/tools/zygote.py) instead of starting a fresh
interpreter that imports torch with torchft (~1.2 s of a core per torchft run, while its replicas wait for it).
Serves until SIGTERM or SIGINT."""
from __future__ import annotations

import importlib.util
import signal
import threading


def torchft_missing() -> str | None:
    """Why torchft's Lighthouse cannot run here, or None."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft's Lighthouse needs the torchft package (pip install 'deltaps[peers]')"
    return None


def add_parser(sub) -> None:
    p = sub.add_parser("lighthouse", help="torchft's Lighthouse: the quorum service of --mode torchft replicas")
    p.add_argument("--bind", required=True, help="HOST:PORT to serve on (port 0: any free one)")
    p.add_argument("--min-replicas", type=int, required=True, help="replicas a quorum needs")
    # torchft_lighthouse's defaults, given explicitly: torchft's Python LighthouseServer takes None as a 100 ms join
    # timeout, which drops a heartbeating replica a little late for a round (it must then heal)
    p.add_argument("--quorum-tick-ms", type=int, default=100, help="how often a forming quorum is checked "
                   "(torchft_lighthouse's default: 100)")
    p.add_argument("--join-timeout-ms", type=int, default=60000, help="how long a quorum waits for more than "
                   "--min-replicas heartbeating replicas to join (torchft_lighthouse's default: 60000)")


def run(args) -> int:
    why = torchft_missing()
    if why:
        raise ValueError(why)
    if args.min_replicas < 1:
        raise ValueError(f"--min-replicas must be >= 1, got {args.min_replicas}")
    from torchft._torchft import LighthouseServer
    server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                              quorum_tick_ms=args.quorum_tick_ms)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):     # after the server: its runtime's own handlers would replace ours
        signal.signal(sig, lambda *_: stop.set())
    print(f"deltaps lighthouse: serving at {server.address()}", flush=True)
    stop.wait()
    server.shutdown()
    return 0
