"""Transport security: shared-token auth on every RPC, TLS, mTLS (real servers on loopback, port 0)."""
import logging
import os
import shutil
import subprocess

import grpc
import pytest
import torch
from helpers import client, named

from deltaps.security import TOKEN_ENV, LaunchSecurity, Security, TokenAuthInterceptor, load_token
from deltaps.transport import grpc_options
from protos import pb, rpc
from ps.server import start_server
from ps.shard import Shard

TOKEN = "s3cret-token-" + "9f2c4e1a7b" * 3
WRONG = "wrong-token-" + "0" * 30


# ---- certificates, made with the openssl CLI (no extra dependency) ------------------------------------
def _openssl(cwd, *args):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d, name):
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def _leaf(d, name, ca, usage, san=None):
    _openssl(d, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    ext = f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
    if san:
        ext += f"subjectAltName={san}\n"
    (d / f"{name}.ext").write_text(ext)
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if not shutil.which("openssl"):
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "otherca")
    _leaf(d, "server", "ca", "serverAuth", "IP:127.0.0.1,DNS:localhost,DNS:ps.test")
    _leaf(d, "worker", "ca", "clientAuth")
    _leaf(d, "intruder", "otherca", "clientAuth")
    return {k: str(d / k) for k in ("ca.pem", "otherca.pem", "server.pem", "server.key", "worker.pem",
                                    "worker.key", "intruder.pem", "intruder.key")}


# ---- helpers ----------------------------------------------------------------------------------------
@pytest.fixture
def serve():
    made = []

    def make(security=None, host="127.0.0.1"):
        shard = Shard(0, 1)
        server, port = start_server(shard, host, 0, security=security)
        made.append(server)
        return shard, f"127.0.0.1:{port}"

    yield make
    for s in made:
        s.stop(grace=None)


def _stub(addr, security):
    return rpc.ParameterServerStub(security.channel(addr, grpc_options()))


def _code(fn, *args, timeout=10):
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, timeout=timeout)
    return e.value.code(), e.value.details()


def server_tls(pki, mtls=False, token=None):
    return Security(token=token, tls_cert=pki["server.pem"], tls_key=pki["server.key"],
                    tls_ca=pki["ca.pem"] if mtls else None)


# ---- token ------------------------------------------------------------------------------------------
def test_missing_token_is_unauthenticated(serve):
    _, addr = serve(Security(token=TOKEN))
    code, details = _code(_stub(addr, Security()).Stats, pb.StatsRequest())
    assert code == grpc.StatusCode.UNAUTHENTICATED and details == "missing token"


def test_wrong_token_is_unauthenticated_and_never_echoed(serve):
    _, addr = serve(Security(token=TOKEN))
    code, details = _code(_stub(addr, Security(token=WRONG)).Stats, pb.StatsRequest())
    assert code == grpc.StatusCode.UNAUTHENTICATED and details == "invalid token"
    assert WRONG not in details and TOKEN not in details
    # a malformed header (no "Bearer ") counts as missing
    ch = grpc.insecure_channel(addr)
    with pytest.raises(grpc.RpcError) as e:
        rpc.ParameterServerStub(ch).Stats(pb.StatsRequest(), timeout=10, metadata=[("authorization", TOKEN)])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and TOKEN not in e.value.details()


def test_right_token_trains(serve):
    shard, addr = serve(Security(token=TOKEN))
    c = client([addr], security=Security(token=TOKEN))
    try:
        params = c.setup(named())
        c.push({n: torch.ones_like(t) for n, t in params.items()}, step=0)
        after = c.pull(min_version=1)
        for n, t in params.items():
            assert torch.allclose(after[n], t - 0.1)
        assert c.server_stats()[0]["pushes"] == 1
    finally:
        c.close()


def test_client_reads_token_from_env(serve, monkeypatch):
    _, addr = serve(Security(token=TOKEN))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    c = client([addr])          # no security given: $DELTAPS_TOKEN
    try:
        assert c.server_stats()[0]["shard_id"] == 0
    finally:
        c.close()


def test_rejected_calls_change_nothing(serve):
    """Control RPCs (SetCodec) need the token too; refused calls never reach the shard."""
    shard, addr = serve(Security(token=TOKEN))
    layout = [pb.KeySpec(key="w#0", param="w", offset=0, numel=4, dtype="float32", shard=0)]
    for sec in (Security(), Security(token=WRONG)):
        stub = _stub(addr, sec)
        assert _code(stub.SetCodec, pb.SetCodecRequest(codec="int8"))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _code(stub.Register, pb.RegisterRequest(worker_id=0, world_size=1, num_shards=1, sync="bsp",
                                                       keys=layout))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _code(stub.Push, pb.PushRequest(worker_id=0, step=0))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _code(stub.Barrier, pb.BarrierRequest(worker_id=0, name="x", timeout_s=1))[0] \
            == grpc.StatusCode.UNAUTHENTICATED
        # an unknown method is refused the same way (no probing for methods without the token)
        ch = sec.channel(addr)
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/deltaps.ParameterServer/Nope")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (shard.codec, shard.codec_epoch) == ("none", 0)
    assert shard.job is None and not shard.keys and shard.stats()["pushes"] == 0
    rep = _stub(addr, Security(token=TOKEN)).SetCodec(pb.SetCodecRequest(codec="int8"), timeout=10)
    assert (rep.codec, rep.codec_epoch) == ("int8", 1) == (shard.codec, shard.codec_epoch)


def test_no_token_configured_means_auth_off(serve):
    _, addr = serve(Security())
    assert _stub(addr, Security(token=TOKEN)).Stats(pb.StatsRequest(), timeout=10).shard_id == 0
    assert _stub(addr, Security()).Stats(pb.StatsRequest(), timeout=10).shard_id == 0


def test_token_check_is_digest_compare():
    icpt = TokenAuthInterceptor(TOKEN)
    assert icpt.check([("authorization", "Bearer " + TOKEN)]) is None
    assert icpt.check([("authorization", "Bearer " + TOKEN[:-1])]) == "invalid token"
    assert icpt.check([("authorization", "Bearer ")]) == "invalid token"
    assert icpt.check([]) == "missing token" and icpt.check(None) == "missing token"
    assert TOKEN not in repr(icpt)


# ---- TLS / mTLS -------------------------------------------------------------------------------------
def test_tls_roundtrip(serve, pki):
    _, addr = serve(server_tls(pki))
    assert _stub(addr, Security(tls_ca=pki["ca.pem"])).Stats(pb.StatsRequest(), timeout=10).shard_id == 0
    # the name checked can be overridden (certificate valid for ps.test)
    sec = Security(tls_ca=pki["ca.pem"], tls_server_name="ps.test")
    assert _stub(addr, sec).Stats(pb.StatsRequest(), timeout=10).shard_id == 0


def test_tls_client_trusting_another_ca_fails(serve, pki):
    _, addr = serve(server_tls(pki))
    assert _code(_stub(addr, Security(tls_ca=pki["otherca.pem"])).Stats, pb.StatsRequest())[0] \
        == grpc.StatusCode.UNAVAILABLE
    # the wrong name fails too; so does a plaintext client
    assert _code(_stub(addr, Security(tls_ca=pki["ca.pem"], tls_server_name="evil.test")).Stats,
                 pb.StatsRequest())[0] == grpc.StatusCode.UNAVAILABLE
    assert _code(_stub(addr, Security()).Stats, pb.StatsRequest())[0] == grpc.StatusCode.UNAVAILABLE


def test_mtls(serve, pki):
    shard, addr = serve(server_tls(pki, mtls=True))
    ok = Security(tls_ca=pki["ca.pem"], tls_cert=pki["worker.pem"], tls_key=pki["worker.key"])
    assert _stub(addr, ok).Stats(pb.StatsRequest(), timeout=10).shard_id == 0
    no_cert = Security(tls_ca=pki["ca.pem"])
    assert _code(_stub(addr, no_cert).SetCodec, pb.SetCodecRequest(codec="int8"))[0] == grpc.StatusCode.UNAVAILABLE
    other = Security(tls_ca=pki["ca.pem"], tls_cert=pki["intruder.pem"], tls_key=pki["intruder.key"])
    assert _code(_stub(addr, other).SetCodec, pb.SetCodecRequest(codec="int8"))[0] == grpc.StatusCode.UNAVAILABLE
    assert shard.codec_epoch == 0


def test_token_and_mtls_together(serve, pki):
    shard, addr = serve(server_tls(pki, mtls=True, token=TOKEN))
    base = dict(tls_ca=pki["ca.pem"], tls_cert=pki["worker.pem"], tls_key=pki["worker.key"])
    code, details = _code(_stub(addr, Security(token=WRONG, **base)).SetCodec, pb.SetCodecRequest(codec="int8"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details == "invalid token"
    assert _code(_stub(addr, Security(**base)).Stats, pb.StatsRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
    assert shard.codec_epoch == 0
    c = client([addr], security=Security(token=TOKEN, **base))
    try:
        c.setup(named())
        assert c.set_codec("int8") == 1
    finally:
        c.close()


# ---- configuration, CLI, logs, child processes ------------------------------------------------------
def test_token_sources_and_validation(tmp_path, monkeypatch, caplog):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert load_token(str(f), env={}) == TOKEN
    assert load_token(None, env={TOKEN_ENV: TOKEN}) == TOKEN
    assert load_token(str(f), env={TOKEN_ENV: WRONG}) == TOKEN      # the file wins
    assert load_token(None, env={}) is None and load_token(None, env={TOKEN_ENV: " "}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_token(str(tmp_path / "empty"), env={})
    with pytest.raises(ValueError) as e:
        load_token(None, env={TOKEN_ENV: "has space " + TOKEN})
    assert TOKEN not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_token(str(tmp_path / "missing"), env={})
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="deltaps.security"):
        load_token(str(f), env={})
    assert "chmod 600" in caplog.text and TOKEN not in caplog.text
    with pytest.raises(ValueError):
        Security(tls_cert="x.pem")                 # without --tls-key


def test_cli_has_no_token_value_flag():
    from helpers import walk_flags

    from deltaps.cli import build_parser
    flags = {o for _, o in walk_flags(build_parser())}
    assert "--token-file" in flags
    assert not {f for f in flags if "token" in f} - {"--token-file"}


def test_ctl_with_token_file(serve, tmp_path, monkeypatch, capsys):
    from deltaps.cli import main
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    shard, addr = serve(Security(token=TOKEN))
    f = tmp_path / "token"
    f.write_text(TOKEN)
    f.chmod(0o600)
    assert main(["ctl", "--servers", addr, "stats"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["ctl", "--servers", addr, "--token-file", str(f), "set-codec", "fp16"]) == 0
    assert shard.codec == "fp16"
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["ctl", "--servers", addr, "stats"]) == 0
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err


def test_token_never_logged(serve, pki, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    sec = Security(token=TOKEN, tls_cert=pki["server.pem"], tls_key=pki["server.key"])
    shard, addr = serve(sec)
    good = Security(token=TOKEN, tls_ca=pki["ca.pem"])
    _stub(addr, good).SetCodec(pb.SetCodecRequest(codec="int8"), timeout=10)
    for bad in (Security(tls_ca=pki["ca.pem"]), Security(token=WRONG, tls_ca=pki["ca.pem"])):
        _code(_stub(addr, bad).Stats, pb.StatsRequest())
    # plaintext + non-loopback: warnings, still without the token
    Security(token=TOKEN).channel("203.0.113.9:7000").close()
    serve(Security(token=TOKEN), host="0.0.0.0")
    out = capsys.readouterr()
    text = caplog.text + out.out + out.err + repr(sec) + str(sec) + repr(LaunchSecurity(sec, good))
    assert "refused" in caplog.text and "cleartext" in caplog.text
    assert TOKEN not in text and WRONG not in text


def test_non_loopback_warning(serve, pki, caplog):
    with caplog.at_level(logging.WARNING):
        serve(Security(), host="0.0.0.0")
    assert "without a token" in caplog.text and "without TLS" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        serve(Security(), host="127.0.0.1")
        serve(server_tls(pki, token=TOKEN), host="0.0.0.0")
    assert not [r for r in caplog.records if "non-loopback" in r.getMessage()]
    assert Security().exposure_warnings("::1") == [] and Security().exposure_warnings("localhost") == []
    assert len(Security().exposure_warnings("ps0.example")) == 2


def test_launch_security_args():
    import argparse
    ns = argparse.Namespace(token_file=None, tls_cert="/s.pem", tls_key="/s.key", tls_ca="/ca.pem",
                            tls_client_cert="/w.pem", tls_client_key="/w.key", tls_server_name=None)
    with pytest.raises(ValueError, match="cannot read"):    # the files are checked up front
        LaunchSecurity.from_args(ns, env={})
    ls = LaunchSecurity(Security(token=TOKEN, tls_cert="/s.pem", tls_key="/s.key", tls_ca="/ca.pem"),
                        Security(token=TOKEN, tls_cert="/w.pem", tls_key="/w.key", tls_ca="/ca.pem"))
    assert ls.server.argv("server") == ["--tls-cert", "/s.pem", "--tls-key", "/s.key", "--tls-ca", "/ca.pem"]
    assert ls.client.argv("client") == ["--tls-cert", "/w.pem", "--tls-key", "/w.key", "--tls-ca", "/ca.pem"]
    assert ls.child_env({"PATH": "/bin"}) == {"PATH": "/bin", TOKEN_ENV: TOKEN}


@pytest.mark.slow
@pytest.mark.parametrize("zygote", [True, False])
def test_launch_passes_token_by_env_and_tls_by_flags(pki, tmp_path, monkeypatch, zygote):
    """A real `deltaps launch` with token + mTLS: children get the token in their environment only (forked from the
    zygote: in the request's environment, over its private socket; fresh: in Popen's env)."""
    import deltaps.tools.launch
    from deltaps.cli import main
    from deltaps.tools.zygote import Zygote
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    f = tmp_path / "token"
    f.write_text(TOKEN)
    f.chmod(0o600)
    seen = []
    real_popen, real_spawn = subprocess.Popen, Zygote.spawn

    def cmdline(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace")

    class Spy(real_popen):
        def __init__(self, args, **kw):
            super().__init__(args, **kw)
            if "deltaps.tools.zygote" not in args:
                seen.append((list(args), kw.get("env"), cmdline(self.pid)))

    def spawn_spy(self, argv, stdout=None, env=None, stderr=None, **kw):
        proc = real_spawn(self, argv, stdout, env, stderr, **kw)
        seen.append((list(argv), env, cmdline(proc.pid)))
        return proc

    monkeypatch.setattr(deltaps.tools.launch.subprocess, "Popen", Spy)
    monkeypatch.setattr(Zygote, "spawn", spawn_spy)
    out = tmp_path / "summary.json"
    rc = main(["launch", "--servers", "1", "--workers", "1", "--steps", "3", "--no-progress", "--json", str(out),
               "--fallback-factor", "0", "--token-file", str(f), "--tls-cert", pki["server.pem"],
               "--tls-key", pki["server.key"], "--tls-ca", pki["ca.pem"], "--tls-client-cert", pki["worker.pem"],
               "--tls-client-key", pki["worker.key"], *([] if zygote else ["--no-zygote"])])
    assert rc == 0 and out.exists()
    assert len(seen) == 2
    for args, env, cmdline_seen in seen:
        assert TOKEN not in " ".join(args) and TOKEN not in cmdline_seen
        assert env[TOKEN_ENV] == TOKEN
        assert "--tls-ca" in args and "--tls-cert" in args
    assert TOKEN_ENV not in os.environ
