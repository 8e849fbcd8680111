from hypothesis import given, settings
from hypothesis import strategies as st

from deltaps.layout import balanced_chunk_bytes, build_layout, layout_digest, shard_loads, split_param


def test_split_param_covers_every_element_once():
    chunks = split_param("w", 10_000, "float32", 4096)
    assert [c[0] for c in chunks] == [f"w#{i}" for i in range(len(chunks))]
    assert sum(n for _, _, n in chunks) == 10_000
    assert all(n * 4 <= 4096 for _, _, n in chunks)
    offs = [o for _, o, _ in chunks]
    assert offs == sorted(offs) and offs[0] == 0


def test_layout_is_deterministic_and_balanced():
    params = [("emb", 1_000_000, "float32"), ("fc1.weight", 300_000, "float32"), ("fc1.bias", 300, "float32"),
              ("fc2.weight", 250_000, "float32"), ("fc2.bias", 10, "float32")]
    a = build_layout(params, 3, chunk_bytes=1 << 20)
    b = build_layout(list(params), 3, chunk_bytes=1 << 20)
    assert a == b and layout_digest(a, 3) == layout_digest(b, 3)
    loads = shard_loads(a, 3)
    assert max(loads) - min(loads) <= (1 << 20), loads   # within one chunk of each other
    assert layout_digest(build_layout(params, 2, 1 << 20), 2) != layout_digest(a, 3)


def test_large_param_chunks_spread_over_all_shards():
    layout = build_layout([("big", 5 * (1 << 18), "float32")], 3, chunk_bytes=1 << 20)
    assert len(layout) == 5
    assert {k.shard for k in layout} == {0, 1, 2}


def test_matrix_keys_are_whole_rows_and_never_cut_for_balance():
    """A matrix codec's job (lowrank): a factor pair costs (rows + cols) x rank, so the clf model's 768 x 768 weight
    stays one key (not four balanced ones); past chunk_bytes a matrix is cut at whole rows."""
    from deltaps.layout import matrix_cols
    params = [("w1", 768 * 64, "float32"), ("b1", 768, "float32"), ("w2", 768 * 768, "float32"),
              ("b2", 768, "float32"), ("w3", 10 * 768, "float32"), ("b3", 10, "float32")]
    shapes = {"w1": (768, 64), "b1": (768,), "w2": (768, 768), "b2": (768,), "w3": (10, 768), "b3": (10,)}
    cols = {n: matrix_cols(s) for n, s in shapes.items()}
    assert cols == {"w1": 64, "b1": 0, "w2": 768, "b2": 0, "w3": 768, "b3": 0}
    assert matrix_cols((8, 3, 5, 5)) == 75                     # a conv weight: out channels by the rest
    flat = build_layout(params, 4)
    assert len([k for k in flat if k.param == "w2"]) == 4 and all(k.cols == 0 for k in flat)
    whole = build_layout(params, 4, cols=cols)
    assert [(k.param, k.numel, k.cols) for k in whole if k.param.startswith("w")] == [
        ("w1", 768 * 64, 64), ("w2", 768 * 768, 768), ("w3", 10 * 768, 768)]
    assert all(k.cols == 0 for k in whole if k.param.startswith("b"))
    cut = build_layout([("w2", 768 * 768, "float32")], 2, chunk_bytes=1000 * 768, cols={"w2": 768})
    assert [(k.offset, k.numel) for k in cut] == [(0, 250 * 768), (250 * 768, 250 * 768), (500 * 768, 250 * 768),
                                                  (750 * 768, 18 * 768)]
    # pinned: flat and whole layouts are what every earlier release computed (workers and shards compare digests);
    # these are 6f0a547's, before keys=balanced weighed keys by the codec's bytes
    bufs = [("bn.mean", 768)]
    assert layout_digest(build_layout(params, 4, buffers=bufs), 4) == \
        "c72679f3eee125d8f9b1ea2c3fdfecdf5e48c8e4ceaaea03f396aec6532826a7"
    assert layout_digest(build_layout(params, 4, buffers=bufs, cols=cols), 4) == \
        "e97aa711a973faf02339782ca058bf0b98cff7ebe6a12709ce63cfd62d27da0e"
    assert layout_digest(whole, 4) != layout_digest(build_layout(params, 4, cols={n: 0 for n in cols}), 4)
    assert layout_digest(build_layout(params, 4, cols={n: 0 for n in cols}), 4) == layout_digest(flat, 4)


def _key_bytes(k, codec):
    return codec.shaped_wire_nbytes((k.numel // k.cols, k.cols) if k.cols else (k.numel,))


def _wire_loads(layout, num_shards, codec):
    load = [0] * num_shards
    for k in layout:
        load[k.shard] += _key_bytes(k, codec)
    return load


def test_balanced_matrix_keys_even_out_the_bytes_each_shard_carries():
    """lowrank:keys=balanced: every worker sends each shard its keys' factor pairs, so the round waits on the shard
    with the most bytes. The raw fair share (four row blocks of the 768 x 768 weight) left the shard that also
    got the 768 x 64 weight twice the others' bytes at rank 32 (measured in a 10 Mbit/s round: its pulls came
    ~90 ms after the others'); balanced by the codec's bytes, every shard carries within 5 % of the others."""
    from compression import get_codec
    from deltaps.layout import matrix_cols
    params = [("w1", 768 * 64, "float32"), ("b1", 768, "float32"), ("w2", 768 * 768, "float32"),
              ("b2", 768, "float32"), ("w3", 10 * 768, "float32"), ("b3", 10, "float32")]
    cols = {"w1": 64, "w2": 768, "w3": 768}
    assert matrix_cols((768, 64)) == 64
    codec = get_codec("lowrank:rank=32,keys=balanced")
    # the raw fair share (what keys=balanced cut before): every key at most a quarter of the model's bytes
    raw_share = build_layout(params, 4, chunk_bytes=balanced_chunk_bytes(params, 4, 4 << 20), cols=cols)
    assert [k.numel // 768 for k in raw_share if k.param == "w2"] == [211, 211, 211, 135]
    old = _wire_loads(raw_share, 4, codec)
    assert max(old) > 2 * min(old)
    layout = build_layout(params, 4, cols=cols, wire_cost=codec.shaped_wire_nbytes)
    loads = _wire_loads(layout, 4, codec)
    assert max(loads) <= 1.05 * min(loads) and max(loads) < 0.55 * max(old)
    assert sum(loads) < sum(old)                       # three blocks of w2 pay its columns once less than four
    for name, numel, _ in params:                      # whole rows, every element once, in order
        keys = [k for k in layout if k.param == name]
        assert [k.offset for k in keys] == [sum(j.numel for j in keys[:i]) for i in range(len(keys))]
        assert sum(k.numel for k in keys) == numel
        assert all(k.numel % cols[name] == 0 and k.cols == cols[name] for k in keys) if name in cols else True
    assert layout == build_layout(list(params), 4, cols=dict(cols), wire_cost=codec.shaped_wire_nbytes)
    # one shard, or a codec for which cutting never pays: the matrices stay whole (fewest bytes)
    assert [k.numel for k in build_layout(params, 1, cols=cols, wire_cost=codec.shaped_wire_nbytes)
            if k.param == "w2"] == [768 * 768]
    # a weight past chunk_bytes is still cut at it: the row blocks only ever get smaller than that
    big = build_layout([("w", 4096 * 512, "float32")], 4, chunk_bytes=1 << 20, cols={"w": 512},
                       wire_cost=codec.shaped_wire_nbytes)
    assert all(k.numel * 4 <= 1 << 20 for k in big) and len({k.shard for k in big}) == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(1, 600)), min_size=1, max_size=6),
       st.integers(1, 8), st.sampled_from([4, 16, 64]), st.sampled_from([1 << 16, 1 << 20]))
def test_balanced_matrix_keys_hold_for_any_model(shapes, shards, rank, chunk_bytes):
    """Any matrices, shard count, rank and key size: whole rows, every element once and in order, no key past
    chunk_bytes, the same layout twice, and the busiest shard never carries more bytes than with the matrices cut at
    chunk_bytes only (keys=whole, spread by the same bytes) — the row blocks only ever lower it."""
    from compression import get_codec
    codec = get_codec(f"lowrank:rank={rank},keys=balanced")
    params = [(f"w{i}", r * c, "float32") for i, (r, c) in enumerate(shapes)] + [("b", 7, "float32")]
    cols = {f"w{i}": c for i, (_, c) in enumerate(shapes)}
    layout = build_layout(params, shards, chunk_bytes, cols=cols, wire_cost=codec.shaped_wire_nbytes)
    assert layout == build_layout(list(params), shards, chunk_bytes, cols=dict(cols), wire_cost=codec.shaped_wire_nbytes)
    for name, numel, _ in params:
        keys = [k for k in layout if k.param == name]
        assert [k.offset for k in keys] == [sum(j.numel for j in keys[:i]) for i in range(len(keys))]
        assert sum(k.numel for k in keys) == numel
        if name in cols:
            assert all(k.cols == cols[name] and k.numel % cols[name] == 0 for k in keys)
            assert all(k.numel * 4 <= max(chunk_bytes, cols[name] * 4) for k in keys)
    # the reference: the cut at chunk_bytes only (keys=whole), its keys spread largest first by the codec's bytes
    load = [0] * shards
    for c in sorted(_key_bytes(k, codec) for k in build_layout(params, shards, chunk_bytes, cols=cols))[::-1]:
        load[load.index(min(load))] += c
    assert max(_wire_loads(layout, shards, codec)) <= max(load)
