"""A caller of a zygote that dies without stopping it (as a launcher killed -9 would): starts the zygote at SOCKET,
prints the zygote's pid once it serves, then sleeps 60 s.

    python tests/zygote_parent.py SOCKET
"""
import sys
import time

from deltaps.tools.zygote import Zygote

if __name__ == "__main__":
    zygote = Zygote(sys.argv[1]).ready()
    print(zygote.proc.pid, flush=True)
    time.sleep(60)
