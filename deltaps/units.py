"""The one parser for sizes, rates and durations given on the command line or in YAML.

Byte sizes are binary, whatever the spelling: `64MB`, `64MiB`, `64M` and `64m` are all 64 x 2**20 bytes
(memory and message sizes are powers of two, as DDP's `bucket_cap_mb`); a plain number is bytes.
Rates follow tc: `bit`/`kbit`/`mbit`/`gbit` are bits per second (decimal), `bps`/`kbps`/... bytes per second.
Durations: `500us`, `1ms`, `2s`, a plain number is milliseconds.
"""
from __future__ import annotations

import re

_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, None: 1.0}


def parse_bytes(value) -> int:
    """'64MiB', '64MB', '1.5G', '4096', 4096 -> bytes (binary multiples)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", str(value), re.I)
    if not m or (m.group(3) and not m.group(2) and m.group(3).lower() != "b"):
        raise ValueError(f"bad byte size {value!r} (want e.g. 4096, 64KiB, 64MiB, 1.5GiB)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).upper()])


def parse_rate(rate) -> float:
    """tc rate syntax ('1gbit', '50mbit', '10mbps' = megabytes/s) -> bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(rate))
    if not m:
        raise ValueError(f"bad rate {rate!r} (want e.g. 1gbit, 100mbit)")
    unit = (m.group(2) or "bit").lower()
    if unit not in _RATE_UNITS:
        raise ValueError(f"bad rate unit {unit!r} in {rate!r}; use one of {', '.join(_RATE_UNITS)}")
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_time_ms(t) -> float:
    """'500us', '1ms', '2s', '3' (ms) -> milliseconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", str(t))
    if not m:
        raise ValueError(f"bad duration {t!r} (want e.g. 1ms, 500us)")
    return float(m.group(1)) * _TIME_MS[m.group(2)]


def argparse_type(parse, what: str):
    """An argparse `type=` from a parser above (argparse reports its ValueError as 'invalid <what> value')."""
    def convert(text):
        return parse(text)
    convert.__name__ = what
    return convert
