from deltaps.layout import build_layout, layout_digest, shard_loads, split_param


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
