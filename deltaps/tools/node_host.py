"""A process becomes a bench network's node: its network namespace, its own /etc files and its own host name.

`python -m deltaps.tools.node_host NAME COMMAND...`: name this UTS namespace's host NAME, then exec COMMAND — the
last step of a node's exec prefix (deltaps/tools/netns.py Topology.exec_prefix: `ip netns exec NS unshare --uts`
first). `enter(netns, hostname)`: all of that in this process, for a zygote forked into a node (deltaps/tools/
zygote.py) instead of started through the prefix.
Every node of a bench network gets a host name of its own, as machines of their own have, which the hosts file of
every namespace maps to that node's address. Programs that advertise gethostname() to their peers (torchft's
checkpoint server, through which a restarted replica heals from a live one; gloo's default device) are then
reached at the right node instead of the fetcher's own address.
"""
from __future__ import annotations

import ctypes
import os
import socket
import sys

NETNS_RUN, NETNS_ETC = "/var/run/netns", "/etc/netns"     # where `ip netns` keeps namespaces and their /etc files
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_RDONLY, MS_BIND, MS_REC, MS_SLAVE = 1, 4096, 16384, 1 << 19
MNT_DETACH = 2


def enter(netns: str, hostname: str) -> None:
    """This process (single-threaded: the kernel refuses a new mount namespace to a thread group) joins `netns`
    as `ip netns exec` does (iproute2 lib/namespace.c: the namespace, a mount namespace of its own whose changes stay
    private, /sys showing the namespace's devices, /etc/netns/<netns>/* over /etc/*), then takes a UTS namespace of
    its own named `hostname`. Raises OSError naming the step that failed."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, step: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"entering node {netns}: {step}: {os.strerror(err)}")
    fd = os.open(os.path.join(NETNS_RUN, netns), os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    check(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "make / a slave mount")
    sys_flags = MS_RDONLY if os.statvfs("/sys").f_flag & os.ST_RDONLY else 0
    check(libc.umount2(b"/sys", MNT_DETACH), "detach /sys")
    check(libc.mount(netns.encode(), b"/sys", b"sysfs", sys_flags, None), "mount the namespace's /sys")
    etc = os.path.join(NETNS_ETC, netns)
    for name in sorted(os.listdir(etc)) if os.path.isdir(etc) else []:
        check(libc.mount(os.path.join(etc, name).encode(), os.path.join("/etc", name).encode(), b"none", MS_BIND,
                         None), f"bind {etc}/{name} over /etc/{name}")
    socket.sethostname(hostname)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m deltaps.tools.node_host NAME COMMAND [ARG...]")
    name, command = argv[0], argv[1:]
    socket.sethostname(name)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
