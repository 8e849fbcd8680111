"""`python -m deltaps.tools.node_host NAME COMMAND...`: name this UTS namespace's host NAME, then exec COMMAND.

The last step of a netns node's exec prefix (deltaps/tools/netns.py Topology.exec_prefix, after `unshare --uts`):
every node of a bench network gets a host name of its own, as machines of their own have, which the hosts file of
every namespace maps to that node's address. Programs that advertise gethostname() to their peers (torchft's
checkpoint server, through which a restarted replica heals from a live one; gloo's default device) are then
reached at the right node instead of the fetcher's own address.
"""
from __future__ import annotations

import os
import socket
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m deltaps.tools.node_host NAME COMMAND [ARG...]")
    name, command = argv[0], argv[1:]
    socket.sethostname(name)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
