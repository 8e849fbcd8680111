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
    balanced = build_layout(params, 4, cols=cols, balance_matrices=True)   # lowrank:keys=balanced
    w2 = [k for k in balanced if k.param == "w2"]
    assert len(w2) == 4 and all(k.numel % 768 == 0 and k.cols == 768 for k in w2)
    assert sum(k.numel for k in w2) == 768 * 768 and len({k.shard for k in w2}) == 4
    assert layout_digest(whole, 4) != layout_digest(build_layout(params, 4, cols={n: 0 for n in cols}), 4)
    assert layout_digest(build_layout(params, 4, cols={n: 0 for n in cols}), 4) == layout_digest(flat, 4)
