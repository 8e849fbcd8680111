"""Sizes on the command line go through deltaps/units.py everywhere, the server's too (docs/cli.md)."""
import pytest

from deltaps.cli import build_parser


def test_server_max_message_bytes_takes_a_size():
    args = build_parser().parse_args(["server", "--shard-id", "0", "--num-shards", "1", "--max-message-bytes", "128MiB"])
    assert args.max_message_bytes == 128 << 20
    assert build_parser().parse_args(["server"]).max_message_bytes == 64 << 20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--max-message-bytes", "lots"])
