"""Body layout and validation helpers shared by the codecs.

A body is a concatenation of typed sections; each section starts at a multiple of its item size.
Decoders validate everything a malicious or truncated payload could get wrong and raise CodecError.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from compression import buffers
from compression.base import TORCH_DTYPES, CodecError, Payload

MAX_NUMEL = (1 << 31) - 1  # indices travel as int32


def _layout(sections):
    offsets, off = [], 0
    for dtype, count in sections:
        size = torch.empty((), dtype=dtype).element_size()
        off = -(-off // size) * size
        offsets.append(off)
        off += size * int(count)
    return offsets, off


def body_size(sections) -> int:
    return _layout(sections)[1]


def new_body(sections) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A uint8 body plus typed 1-D views of its sections, to be filled in place."""
    offsets, total = _layout(sections)
    body = buffers.empty(total, torch.uint8)
    views = [body[o:o + torch.empty((), dtype=dt).element_size() * int(c)].view(dt)
             for o, (dt, c) in zip(offsets, sections)]
    return body, views


def to_wire(body: torch.Tensor) -> memoryview:
    return memoryview(body.numpy()).cast("B")


def read_body(payload: Payload, sections) -> list[torch.Tensor]:
    """Read-only typed views of a received body; raises CodecError when its size is wrong."""
    offsets, total = _layout(sections)
    data = payload.data
    try:
        nbytes = memoryview(data).nbytes
    except TypeError:
        raise CodecError(f"{payload.codec}: body is {type(data).__name__}, not bytes") from None
    if nbytes != total:
        raise CodecError(f"{payload.codec}: body has {nbytes} bytes, expected {total} "
                         f"(truncated or corrupt payload)")
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: we never write to these views
        for o, (dt, c) in zip(offsets, sections):
            if int(c) == 0:
                out.append(torch.empty(0, dtype=dt))
            else:
                out.append(torch.frombuffer(data, dtype=dt, count=int(c), offset=o))
    return out


def check_payload(payload: Payload) -> int:
    """Validate shape/dtype; return numel."""
    shape = payload.shape
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                        and s >= 0 for s in shape):
        raise CodecError(f"{payload.codec}: bad shape {shape!r}")
    if payload.dtype not in TORCH_DTYPES or payload.dtype.startswith("int"):
        raise CodecError(f"{payload.codec}: unsupported dtype {payload.dtype!r}")
    if not isinstance(payload.header, dict):
        raise CodecError(f"{payload.codec}: header is not a dict")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise CodecError(f"{payload.codec}: {numel} elements exceed the int32 index range")
    return numel


def header_int(payload: Payload, name: str, lo: int, hi: int | None = None) -> int:
    v = payload.header.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise CodecError(f"{payload.codec}: header field {name!r}={v!r} is not an int in {rng}")
    return v


def header_float(payload: Payload, name: str) -> float:
    v = payload.header.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise CodecError(f"{payload.codec}: header field {name!r}={v!r} is not a finite number")
    return float(v)


def value_dtype(payload: Payload) -> torch.dtype:
    return TORCH_DTYPES[payload.dtype]


# --- compact index sections (sparse codecs) -------------------------------------------------------
# Strictly ascending indices idx[0..k) travel either as
#   "u16": uint16 little-endian, one per index (only when n <= 65536), or
#   "bp":  idx[0] in the header ("i0"), then the k-1 gaps minus one, d[j] = idx[j+1] - idx[j] - 1,
#          bit-packed LSB first at a fixed width ("bits", 1..31): d[j] occupies stream bits
#          [j*bits, (j+1)*bits), stream bit b being bit b % 8 of byte b // 8; unused high bits of the
#          last byte are zero.
# The encoder picks whichever is smaller on the wire, header included (u16 on a tie); see codecs.sparse. The CuPy back end packs
# the same stream word by word (cuda.bitpack), so payload bytes are identical.

U16_MAX_N = 1 << 16
MAX_BITS = 31


def gap_bits(max_gap: int) -> int:
    """Bit width for gaps-minus-one up to max_gap: max(1, ceil(log2(max_gap + 1)))."""
    return max(1, int(max_gap).bit_length())


def packed_nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def index_nbytes_bound(n: int, k: int) -> int:
    """Upper bound of the index section for k ascending indices in [0, n): the gaps minus one sum
    to at most n - k, so none exceeds it; u16 is only chosen when 2k <= bp + header extra."""
    if k <= 0:
        return 0
    bp = packed_nbytes(k - 1, gap_bits(n - k))
    return min(2 * k, bp + _bp_header_extra(n - 1)) if n <= U16_MAX_N else bp


def _bp_header_extra(i0: int) -> int:
    """msgpack bytes the "bp" header adds over "u16": "bits" (fixstr + fixint), "i0" (fixstr + uint),
    less one for the shorter "enc" value."""
    return 6 + 3 + (1 if i0 < 128 else 2 if i0 < 256 else 3 if i0 < 65536 else 5) - 1


def choose_index_encoding(n: int, k: int, max_gap: int, i0: int) -> tuple[str, int, int]:
    """(encoding, bits, section nbytes) for k ascending indices starting at i0 whose largest
    gap-minus-one is max_gap: the smaller on the wire, header included (u16 on a tie). For n <= 65536
    bits <= 16, so bp's body is never larger and u16 only wins for a handful of indices."""
    if k == 0:
        return "u16", 0, 0
    bits = gap_bits(max_gap)
    bp = packed_nbytes(k - 1, bits)
    if n <= U16_MAX_N and 2 * k <= bp + _bp_header_extra(i0):
        return "u16", 0, 2 * k
    return "bp", bits, bp


def bitpack(d: np.ndarray, bits: int) -> np.ndarray:
    """Pack values d (each < 2**bits, bits <= 31) into the LSB-first stream; uint8 array."""
    m = int(d.size)
    nbytes = packed_nbytes(m, bits)
    if m == 0:
        return np.zeros(0, np.uint8)
    d = d.astype(np.uint64, copy=False)
    ub = np.uint64(bits)
    p = np.arange(m, dtype=np.uint64) * ub           # first stream bit of each value
    off = p & np.uint64(63)
    nwords = -(-(m * bits) // 64)
    words = np.zeros(nwords, dtype=np.uint64)
    # every word up to the one holding the last value's first bit holds a value start
    nstart = (m - 1) * bits // 64 + 1
    starts = -(-(np.arange(nstart, dtype=np.int64) * 64) // bits)
    words[:nstart] = np.bitwise_or.reduceat(d << off, starts)  # bits never overlap: OR is exact
    spill = np.flatnonzero(off + ub > np.uint64(64))         # values crossing into the next word
    if spill.size:
        w = (p[spill] >> np.uint64(6)).astype(np.intp) + 1
        words[w] |= d[spill] >> (np.uint64(64) - off[spill])
    return words.astype("<u8", copy=False).view(np.uint8)[:nbytes]


def bitunpack(buf: np.ndarray, m: int, bits: int) -> np.ndarray:
    """Inverse of bitpack: m values (uint64) from a uint8 stream of packed_nbytes(m, bits) bytes."""
    if m == 0:
        return np.zeros(0, np.uint64)
    if 8 % bits == 0:    # codes within bytes (lowrank's, chunktopk's 2/4/8 bits): one uint8 pass, not five uint64 arrays
        per = 8 // bits
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        codes = (buf[:-(-m // per)][:, None] >> shifts) & np.uint8((1 << bits) - 1)
        return codes.reshape(-1)[:m].astype(np.uint64)
    words = np.zeros(-(-(m * bits) // 64) + 1, dtype="<u8")
    words.view(np.uint8)[:buf.size] = buf
    p = np.arange(m, dtype=np.uint64) * np.uint64(bits)
    w = (p >> np.uint64(6)).astype(np.intp)
    off = p & np.uint64(63)
    hi = words[w + 1] << ((np.uint64(64) - off) & np.uint64(63))
    hi[off == 0] = 0
    return ((words[w] >> off) | hi) & np.uint64((1 << bits) - 1)


def encode_indices(idx: np.ndarray, n: int) -> tuple[dict, np.ndarray]:
    """Header fields and index section (uint8 array) for ascending int64 indices in [0, n)."""
    k = int(idx.size)
    gaps = np.diff(idx) - 1 if k > 1 else np.zeros(0, np.int64)
    enc, bits, _ = choose_index_encoding(n, k, int(gaps.max()) if gaps.size else 0, int(idx[0]) if k else 0)
    if enc == "u16":
        return {"enc": "u16"}, idx.astype("<u2").view(np.uint8)
    return {"enc": "bp", "bits": bits, "i0": int(idx[0])}, bitpack(gaps, bits)


def index_section(payload: Payload, n: int, k: int) -> tuple[str, int, int, int]:
    """Validate the index header fields: (encoding, bits, i0, section nbytes)."""
    enc = payload.header.get("enc")
    if enc == "u16":
        if n > U16_MAX_N:
            raise CodecError(f"{payload.codec}: u16 indices for n={n} > {U16_MAX_N}")
        return enc, 0, 0, 2 * k
    if enc == "bp":
        if k == 0:
            raise CodecError(f"{payload.codec}: bit-packed indices with k=0")
        bits = header_int(payload, "bits", 1, MAX_BITS)
        i0 = header_int(payload, "i0", 0, n - 1)
        return enc, bits, i0, packed_nbytes(k - 1, bits)
    raise CodecError(f"{payload.codec}: unknown index encoding {enc!r} (want 'u16' or 'bp')")


def check_padding(codec: str, packed, used_bits: int, what: str = "packed section") -> None:
    """The bits of an LSB-first packed section past its last value are zero, as every encoder writes them: one
    payload per gradient, and a flipped padding bit is a corrupt payload, not an accepted one."""
    tail = used_bits % 8
    if tail and len(packed) and int(packed[-1]) >> tail:
        raise CodecError(f"{codec}: nonzero padding bits in the {what}: corrupt payload")


def decode_indices(payload: Payload, n: int, k: int, enc: str, bits: int, i0: int,
                   section: torch.Tensor) -> torch.Tensor:
    """int64 indices from a validated index section; CodecError unless strictly ascending in [0, n)."""
    raw = section.numpy() if section.numel() else np.zeros(0, np.uint8)
    bad = f"{payload.codec}: indices out of range [0, {n}) or not strictly ascending"
    if enc == "u16":
        idx = raw.view("<u2").astype(np.int64)
        if k and (int(idx[-1]) >= n or not bool((idx[1:] > idx[:-1]).all())):
            raise CodecError(bad)
        return torch.from_numpy(idx)
    m = k - 1
    check_padding(payload.codec, raw, m * bits, "packed indices")
    idx = np.empty(k, dtype=np.int64)
    idx[0] = i0
    if m:
        np.cumsum(bitunpack(raw, m, bits).astype(np.int64) + 1, out=idx[1:])
        idx[1:] += i0
        if int(idx[-1]) >= n:  # gaps are >= 1 by construction, so only the range can fail
            raise CodecError(bad)
    return torch.from_numpy(idx)


# --- Elias-Fano sections (chunktopk's positions) ----------------------------------------------------
# k strictly ascending values v[0..k) in [0, u) travel as two sections: their `low` = floor(log2(u / k))
# low bits, bit-packed as above, and a bit vector of high parts, bit (v[j] >> low) + j set for every j,
# k + ((u - 1) >> low) + 1 bits, LSB first. About 2 + log2(u / k) bits a value, against log2(chunk) as
# offsets within a chunk: at density 1/8 of a 4096 chunk 5 bits instead of 12.

def ef_low_bits(universe: int, count: int) -> int:
    return (universe // count).bit_length() - 1 if 0 < count < universe else 0


def ef_high_nbits(universe: int, count: int) -> int:
    return count + ((universe - 1) >> ef_low_bits(universe, count)) + 1 if count else 0


def ef_sections(universe: int, count: int) -> list[tuple[torch.dtype, int]]:
    """The (low bits, high bits) sections' layout for count values in [0, universe)."""
    return [(torch.uint8, packed_nbytes(count, ef_low_bits(universe, count))),
            (torch.uint8, packed_nbytes(ef_high_nbits(universe, count), 1))]


def ef_encode(values: np.ndarray, universe: int) -> tuple[np.ndarray, np.ndarray]:
    """(low section, high section) of strictly ascending int64 values in [0, universe)."""
    count = int(values.size)
    low = ef_low_bits(universe, count)
    lows = bitpack(values & ((1 << low) - 1), low) if low and count else np.zeros(0, np.uint8)
    high = np.zeros(ef_high_nbits(universe, count), np.uint8)
    high[(values >> low) + np.arange(count)] = 1
    return lows, np.packbits(high, bitorder="little")


def ef_decode(codec: str, low_section: torch.Tensor, high_section: torch.Tensor, count: int,
              universe: int) -> np.ndarray:
    """int64 values of validated-size sections; CodecError unless count strictly ascending values in [0, universe)."""
    low = ef_low_bits(universe, count)
    check_padding(codec, high_section, ef_high_nbits(universe, count), "position bit vector")
    check_padding(codec, low_section, count * low, "positions' low bits")
    high = np.unpackbits(high_section.numpy(), count=ef_high_nbits(universe, count), bitorder="little")
    ones = np.flatnonzero(high)
    if ones.size != count:
        raise CodecError(f"{codec}: the position bit vector holds {ones.size} set bits, the header says {count}")
    values = (ones - np.arange(count)) << low
    if low and count:
        values |= bitunpack(low_section.numpy(), count, low).astype(np.int64)
    if count and (int(values[-1]) >= universe or not bool((values[1:] > values[:-1]).all())):
        raise CodecError(f"{codec}: positions out of range [0, {universe}) or not strictly ascending (a repeated "
                         f"position would be added twice)")
    return values
