"""Transport security for deltaps' gRPC: a shared token on every RPC, optional TLS and mutual TLS.

One `Security` object describes one process' settings, as a server or as a client, and is the only place
channels and server ports are made:

    sec = Security.from_args(args, "client")        # --token-file / $DELTAPS_TOKEN, --tls-* flags
    channel = sec.channel("ps0:7000", grpc_options())
    server, port = start_server(shard, host, port, security=Security.from_args(args, "server"))

Token: read from the file named by --token-file, else from $DELTAPS_TOKEN (never a command-line value, so it
never shows in `ps`; never logged, never echoed in an error). Clients send it as `authorization: Bearer
<token>` metadata on every call (an interceptor); servers check it in a grpc.ServerInterceptor, comparing
SHA-256 digests with hmac.compare_digest, and refuse with UNAUTHENTICATED ("missing token" / "invalid
token") before the request is even parsed. A server with no token configured does not check (auth off).

TLS: a server with --tls-cert/--tls-key serves TLS; with --tls-ca too it requires and verifies client
certificates signed by that CA (mTLS). A client uses TLS when given --tls, --tls-ca (verify the server
against this CA instead of the system roots) or --tls-cert/--tls-key (its client certificate).

Out of scope: the Prometheus /metrics endpoints (plain HTTP, bind 127.0.0.1 by default) and the allreduce
mode's torch.distributed traffic.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass, field

import grpc

from deltaps.ratelimit import RefusalLog

log = logging.getLogger("deltaps.security")

TOKEN_ENV = "DELTAPS_TOKEN"
AUTH_HEADER = "authorization"
_BEARER = "Bearer "


# ---- token ---------------------------------------------------------------------------------------
def _check_token(token: str, source: str) -> str:
    token = token.strip()
    if not token:
        raise ValueError(f"{source}: the token is empty")
    if any(not (0x21 <= ord(ch) <= 0x7E) for ch in token):   # gRPC metadata: visible ASCII, no spaces
        raise ValueError(f"{source}: the token must be printable ASCII without spaces")
    if token.lower().startswith(("change-me", "changeme")):
        log.warning("%s: the token is still the placeholder from the examples; set a random one", source)
    elif len(token) < 16:
        log.warning("%s: the token is shorter than 16 characters; use e.g. `openssl rand -hex 32`", source)
    return token


def load_token(token_file: str | None = None, env=None) -> str | None:
    """The shared token: the contents of token_file if given, else $DELTAPS_TOKEN (empty = unset), else None."""
    env = os.environ if env is None else env
    if token_file:
        try:
            st = os.stat(token_file)
            with open(token_file) as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --token-file {token_file}: {e.strerror}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("token file %s is accessible by group/others (mode %o); chmod 600 it",
                        token_file, stat.S_IMODE(st.st_mode))
        return _check_token(raw, f"--token-file {token_file}")
    value = env.get(TOKEN_ENV, "")
    return _check_token(value, f"${TOKEN_ENV}") if value.strip() else None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None


def is_loopback(host: str) -> bool:
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # a hostname or a wildcard: assume reachable from elsewhere


def _target_host(target: str) -> str:
    target = target.split("://", 1)[-1]
    host, sep, port = target.rpartition(":")
    return host if sep and port.isdigit() else target


# ---- interceptors --------------------------------------------------------------------------------
class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str):
        self._header = (AUTH_HEADER, _BEARER + token)

    def __repr__(self):
        return "TokenClientInterceptor(<token>)"

    def _details(self, d):
        md = [(k, v) for k, v in (d.metadata or ()) if k != AUTH_HEADER]
        return _CallDetails(d, md + [self._header])

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)


# grpc.health.v1 (Kubernetes grpc probes cannot send metadata); it only tells SERVING / NOT_SERVING.
AUTH_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call (known method or not, except the health service) without the right token:
    UNAUTHENTICATED, before the request is parsed."""

    def __init__(self, token: str, log_every_s: float = 10.0, exempt_prefixes=AUTH_EXEMPT_PREFIXES,
                 on_refusal=None):
        self._digest = _digest(token)
        self._on_refusal = on_refusal
        self._exempt = tuple(exempt_prefixes)
        self.refusals = RefusalLog(log, log_every_s)   # one line per (peer, reason) per log_every_s

    def __repr__(self):
        return "TokenAuthInterceptor(<token>)"

    def check(self, metadata) -> str | None:
        """None when authorized, else the reason ("missing token" / "invalid token")."""
        value = next((v for k, v in (metadata or ()) if k == AUTH_HEADER), None)
        if value is None:
            return "missing token"
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if not value.startswith(_BEARER):
            return "missing token"
        ok = hmac.compare_digest(_digest(value[len(_BEARER):]), self._digest)   # constant time, fixed length
        return None if ok else "invalid token"

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        reason = None if method.startswith(self._exempt) else self.check(handler_call_details.invocation_metadata)
        if reason is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)

        def refuse(_request, context):
            self._note(method, context.peer(), reason)
            if self._on_refusal is not None:
                self._on_refusal(method.rsplit("/", 1)[-1], "UNAUTHENTICATED")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        # No request deserializer: a refused request is never parsed.
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return grpc.unary_unary_rpc_method_handler(refuse)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        return grpc.unary_stream_rpc_method_handler(refuse)

    def _note(self, method: str, peer: str, reason: str) -> None:
        self.refusals.refused(peer, reason, f"refused {method} from {peer}: {reason}")


# ---- settings ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Security:
    """Token and TLS settings of one process. All fields optional; Security() = plaintext, no auth.

    As a server: tls_cert + tls_key -> TLS; + tls_ca -> clients must present a certificate signed by it.
    As a client: tls (system roots) or tls_ca (this CA) -> TLS; tls_cert + tls_key -> client certificate;
    tls_server_name overrides the name checked against the server certificate."""
    token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls: bool = False
    tls_server_name: str | None = None

    def __post_init__(self):
        if self.token is not None:
            object.__setattr__(self, "token", _check_token(self.token, "token"))
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")

    def __repr__(self):
        parts = [f"token={'<set>' if self.token else None}"]
        parts += [f"{k}={getattr(self, k)!r}" for k in ("tls_cert", "tls_key", "tls_ca", "tls", "tls_server_name")
                  if getattr(self, k)]
        return f"Security({', '.join(parts)})"

    # construction
    @classmethod
    def from_env(cls, env=None) -> "Security":
        """Token from $DELTAPS_TOKEN, no TLS (PSClient's default when given no security)."""
        return cls(token=load_token(None, env))

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str = "client", env=None) -> "Security":
        """From the flags add_security_args(parser, role) added (missing attributes = unset)."""
        g = lambda name: getattr(args, name, None)  # noqa: E731
        sec = cls(token=load_token(g("token_file"), env), tls_cert=_abs(g("tls_cert")), tls_key=_abs(g("tls_key")),
                  tls_ca=_abs(g("tls_ca")), tls=bool(g("tls")) and role == "client",
                  tls_server_name=g("tls_server_name") if role == "client" else None)
        if role == "server" and sec.tls_ca and not sec.tls_cert:
            raise ValueError("server --tls-ca (require client certificates) needs --tls-cert and --tls-key")
        sec._load_files()   # fail now, with a clear message, rather than at the first RPC
        return sec

    def _load_files(self) -> None:
        for path, what in ((self.tls_cert, "--tls-cert"), (self.tls_key, "--tls-key"), (self.tls_ca, "--tls-ca")):
            _read(path, what)

    # properties
    @property
    def client_tls(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert)

    @property
    def server_tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def mtls(self) -> bool:
        """As a server: client certificates required."""
        return bool(self.tls_cert and self.tls_ca)

    def describe(self, role: str = "server") -> str:
        tls = ("mTLS" if self.mtls else "TLS" if self.server_tls else "plaintext") if role == "server" \
            else ("TLS" + (" + client cert" if self.tls_cert else "") if self.client_tls else "plaintext")
        return f"{tls}, {'token auth' if self.token else 'no token auth'}"

    # client side
    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca, "--tls-ca"),
                                            private_key=_read(self.tls_key, "--tls-key"),
                                            certificate_chain=_read(self.tls_cert, "--tls-cert"))

    def channel(self, target: str, options=()) -> grpc.Channel:
        """A channel to target with these settings: TLS if configured, the token on every call."""
        opts = list(options)
        if self.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        if self.client_tls:
            ch = grpc.secure_channel(target, self.channel_credentials(), options=opts)
        else:
            ch = grpc.insecure_channel(target, options=opts)
            if self.token and not is_loopback(_target_host(target)):
                _warn_once(f"client:{target}", "sending the deltaps token to %s without TLS: it travels in "
                           "cleartext (use --tls-ca)", target)
        if self.token:
            ch = grpc.intercept_channel(ch, TokenClientInterceptor(self.token))
        return ch

    # server side
    def server_credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.tls_ca, "--tls-ca")
        return grpc.ssl_server_credentials([(_read(self.tls_key, "--tls-key"), _read(self.tls_cert, "--tls-cert"))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def server_interceptors(self, on_refusal=None) -> list[grpc.ServerInterceptor]:
        """on_refusal(rpc, reason): called for every call the interceptor refuses (the server's counter)."""
        return [TokenAuthInterceptor(self.token, on_refusal=on_refusal)] if self.token else []

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Bind address (TLS when configured); returns the port (0 = failed)."""
        if self.server_tls:
            return server.add_secure_port(address, self.server_credentials())
        return server.add_insecure_port(address)

    def exposure_warnings(self, host: str) -> list[str]:
        """What is wrong with serving on host with these settings (nothing on loopback)."""
        if is_loopback(host):
            return []
        out = []
        if not self.token and not self.mtls:
            out.append(f"serving on non-loopback address {host} without a token or client certificates: anyone "
                       f"who can reach it can read and overwrite the model and switch its codec "
                       f"(set ${TOKEN_ENV} or --token-file, and --tls-cert/--tls-key)")
        if not self.server_tls:
            out.append(f"serving on non-loopback address {host} without TLS: parameters, gradients"
                       f"{' and the token' if self.token else ''} travel in cleartext (--tls-cert/--tls-key)")
        return out

    # child processes (deltaps launch)
    def argv(self, role: str) -> list[str]:
        """Flags that give a child process these settings. Never the token (see child_env)."""
        out = []
        if role == "client" and self.tls and not (self.tls_ca or self.tls_cert):
            out.append("--tls")
        for flag, value in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if value:
                out += [flag, value]
        if role == "client" and self.tls_server_name:
            out += ["--tls-server-name", self.tls_server_name]
        return out

    def child_env(self, base=None) -> dict:
        """Environment for a child process: base (default os.environ) with $DELTAPS_TOKEN = this token."""
        env = dict(os.environ if base is None else base)
        if self.token:
            env[TOKEN_ENV] = self.token
        return env


@dataclass(frozen=True)
class LaunchSecurity:
    """`deltaps launch`: what the shards get (server) and what the workers get (client); one token."""
    server: Security = Security()
    client: Security = Security()

    @classmethod
    def from_args(cls, args: argparse.Namespace, env=None) -> "LaunchSecurity":
        g = lambda name: getattr(args, name, None)  # noqa: E731
        token = load_token(g("token_file"), env)
        cert, key, ca = _abs(g("tls_cert")), _abs(g("tls_key")), _abs(g("tls_ca"))
        ccert, ckey = _abs(g("tls_client_cert")), _abs(g("tls_client_key"))
        if (ca or ccert) and not cert:
            raise ValueError("launch --tls-ca / --tls-client-cert need --tls-cert and --tls-key (the shards' certificate)")
        if bool(ccert) != bool(ckey):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if ccert and not ca:
            raise ValueError("launch --tls-client-cert needs --tls-ca (the CA the shards verify it against)")
        server = Security(token=token, tls_cert=cert, tls_key=key, tls_ca=ca if ccert else None)
        client = Security(token=token, tls_cert=ccert, tls_key=ckey, tls_ca=ca, tls=bool(cert) and not ca,
                          tls_server_name=g("tls_server_name"))
        server._load_files()
        client._load_files()
        return cls(server, client)

    def child_env(self, base=None) -> dict:
        return self.server.child_env(base)


def _abs(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None


_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)
