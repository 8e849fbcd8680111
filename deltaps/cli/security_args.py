"""The security flags of every `deltaps` command that talks gRPC (deltaps/security.py reads them:
`Security.from_args`, `LaunchSecurity.from_args`)."""
from __future__ import annotations

import argparse

from deltaps.security import TOKEN_ENV


def add_security_args(p: argparse.ArgumentParser, role: str) -> None:
    """role: server, client (worker, ctl) or launch. There is deliberately no flag taking the token itself."""
    g = p.add_argument_group("security")
    g.add_argument("--token-file", help=f"file holding the shared auth token (default: ${TOKEN_ENV}; "
                   + ("none = no auth)" if role == "server" else "sent on every RPC)"))
    if role == "server":
        g.add_argument("--tls-cert", help="PEM certificate (chain) to serve TLS with")
        g.add_argument("--tls-key", help="PEM private key of --tls-cert")
        g.add_argument("--tls-ca", help="PEM CA bundle: require client certificates signed by it (mTLS)")
    elif role == "client":
        g.add_argument("--tls", action="store_true", help="use TLS, verifying servers against the system roots")
        g.add_argument("--tls-ca", help="PEM CA bundle to verify the servers' certificates (implies TLS)")
        g.add_argument("--tls-cert", help="PEM client certificate, for servers that require one (implies TLS)")
        g.add_argument("--tls-key", help="PEM private key of --tls-cert")
        g.add_argument("--tls-server-name", help="name to check the server certificate against (default: the host)")
    elif role == "launch":
        g.add_argument("--tls-cert", help="PEM certificate the shards serve TLS with (must be valid for 127.0.0.1)")
        g.add_argument("--tls-key", help="PEM private key of --tls-cert")
        g.add_argument("--tls-ca", help="PEM CA the workers verify the shards against (and, with "
                       "--tls-client-cert, the shards verify the workers against)")
        g.add_argument("--tls-client-cert", help="PEM client certificate for the workers; shards then require one (mTLS)")
        g.add_argument("--tls-client-key", help="PEM private key of --tls-client-cert")
        g.add_argument("--tls-server-name", help="name the workers check the shard certificate against")
    else:
        raise ValueError(f"unknown role {role!r}")
