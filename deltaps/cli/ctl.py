"""`deltaps ctl`: control a running job (rollback switch, counters)."""
from __future__ import annotations

import json
import sys

from deltaps.cli.env import server_list
from deltaps.cli.security_args import add_security_args


def add_parser(sub) -> None:
    c = sub.add_parser("ctl", help="control a running job")
    c.add_argument("--servers", type=server_list, required=True, help="comma-separated host:port of every shard")
    add_security_args(c, "client")
    csub = c.add_subparsers(dest="action", required=True)
    sc = csub.add_parser("set-codec", help="switch the gradient codec of the running job (rollback switch)")
    sc.add_argument("spec", help="codec spec, e.g. none")
    csub.add_parser("stats", help="print each shard's counters")


def run(args) -> int:
    from deltaps.errors import PSError, call
    from deltaps.security import Security
    from deltaps.transport import grpc_options
    from protos import pb, rpc

    security = Security.from_args(args, "client")
    out = []
    for addr in args.servers:
        stub = rpc.ParameterServerStub(security.channel(addr, grpc_options()))
        try:
            if args.action == "set-codec":
                rep = call(stub.SetCodec, pb.SetCodecRequest(codec=args.spec), 10.0)
                out.append({"server": addr, "codec": rep.codec, "codec_epoch": rep.codec_epoch})
            else:
                rep = call(stub.Stats, pb.StatsRequest(), 10.0)
                out.append({"server": addr, **{f.name: (list(getattr(rep, f.name)) if f.is_repeated
                                                        else getattr(rep, f.name)) for f in rep.DESCRIPTOR.fields}})
        except PSError as e:
            print(f"{addr}: {e}", file=sys.stderr)
            return 1
    print(json.dumps(out, indent=2))
    return 0
