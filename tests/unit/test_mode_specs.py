"""One grammar of training-mode specs (deltaps/strategies.py) for bench compare's --modes, the cost model's
strategies and `deltaps advise`: every accepted form gives the TrainConfig overrides bench compare always gave,
bad specs are refused naming the spec and the accepted forms, and the cost model takes the same names."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaps.strategies import (
    MODE_FORMS,
    MODES,
    ModeSpec,
    parse_ddp_hook,
    parse_mode_spec,
    ps_codecs,
    split_mode_specs,
)
from deltaps.tools import costmodel as cm
from deltaps.tools.bench_compare import parse_mode
from worker.trainers.strategy import load_job as load_config

EXPECTED = {   # what bench compare's parse_mode returned before the grammar moved, key order included
    "ddp": {"mode": "allreduce"},
    "allreduce": {"mode": "allreduce"},
    "ddp:": {"mode": "allreduce"},
    "ddp:none": {"mode": "allreduce"},
    "ddp:fp32": {"mode": "allreduce"},
    "ddp:fp16": {"mode": "allreduce", "ddp_hook": "fp16"},
    "allreduce:BF16": {"mode": "allreduce", "ddp_hook": "bf16"},
    "ddp:powersgd:rank=4": {"mode": "allreduce", "ddp_hook": "powersgd:rank=4:start=10"},
    "ddp:powersgd:rank=2:start=3:impl=torch": {"mode": "allreduce", "ddp_hook": "powersgd:rank=2:start=3:impl=torch"},
    "ddp:powersgd,rank=2,start=3,impl=torch": {"mode": "allreduce", "ddp_hook": "powersgd:rank=2:start=3:impl=torch"},
    "ddp:localsgd:period=8": {"mode": "allreduce", "ddp_hook": "localsgd:period=8:start=1"},
    "ddp:localsgd:period=4:start=0": {"mode": "allreduce", "ddp_hook": "localsgd:period=4:start=0"},
    "ddp:sparse": {"mode": "allreduce", "sparse_embeddings": True},
    "allreduce:sparse": {"mode": "allreduce", "sparse_embeddings": True},
    "ddp:sparse:fp16": {"mode": "allreduce", "sparse_embeddings": True, "ddp_hook": "fp16"},
    "ddp:sparse:bf16": {"mode": "allreduce", "sparse_embeddings": True, "ddp_hook": "bf16"},
    "ps": {"mode": "ps", "sync": "bsp", "codec": "none"},
    "ps:": {"mode": "ps", "sync": "bsp", "codec": "none"},
    "ps:int8": {"mode": "ps", "sync": "bsp", "codec": "int8"},
    "ps-bsp:int8": {"mode": "ps", "sync": "bsp", "codec": "int8"},
    " ps:topk:ratio=0.01 ": {"mode": "ps", "sync": "bsp", "codec": "topk:ratio=0.01"},
    "ps-asp": {"mode": "ps", "sync": "asp", "codec": "none"},
    "ps-asp:int8": {"mode": "ps", "sync": "asp", "codec": "int8"},
    "ps-local8": {"mode": "ps", "sync": "bsp", "codec": "none", "local_steps": 8, "stream_fragments": 1,
                  "overlap_steps": -1},
    "ps-local8:int8": {"mode": "ps", "sync": "bsp", "codec": "int8", "local_steps": 8, "stream_fragments": 1,
                       "overlap_steps": -1},
    "ps-local32x4:none": {"mode": "ps", "sync": "bsp", "codec": "none", "local_steps": 32, "stream_fragments": 4,
                          "overlap_steps": -1},
    "ps-local32x4o4:int8": {"mode": "ps", "sync": "bsp", "codec": "int8", "local_steps": 32, "stream_fragments": 4,
                            "overlap_steps": 4},
    "ps-local8o0:topk:ratio=0.1": {"mode": "ps", "sync": "bsp", "codec": "topk:ratio=0.1", "local_steps": 8,
                                   "stream_fragments": 1, "overlap_steps": 0},
    "hybrid": {"mode": "hybrid", "sync": "bsp", "codec": "none", "workload": "ctr"},
    "hybrid:fp16": {"mode": "hybrid", "sync": "bsp", "codec": "none", "workload": "ctr", "ddp_hook": "fp16"},
    "hybrid:bf16": {"mode": "hybrid", "sync": "bsp", "codec": "none", "workload": "ctr", "ddp_hook": "bf16"},
    "torchrec": {"mode": "torchrec", "sync": "bsp", "codec": "none", "workload": "ctr"},
    "torchrec:fp16": {"mode": "torchrec", "sync": "bsp", "codec": "none", "workload": "ctr", "ddp_hook": "fp16"},
    "torchrec:bf16:sharding=column_wise": {"mode": "torchrec", "sync": "bsp", "codec": "none", "workload": "ctr",
                                           "ddp_hook": "bf16", "torchrec_sharding": "column_wise"},
    "hybrid:dynamic:ttl=100:min_count=2": {"mode": "hybrid", "sync": "bsp", "codec": "none", "workload": "ctr",
                                           "embedding_dynamic": True, "embedding_ttl_steps": 100,
                                           "embedding_min_count": 2},
    "torchft:diloco:sync=32": {"mode": "torchft", "sync": "bsp", "torchft_algorithm": "diloco", "local_steps": 32,
                               "stream_fragments": 1, "overlap_steps": 0},
    "torchft:diloco:sync=32:fragments=4:delay=4": {"mode": "torchft", "sync": "bsp", "torchft_algorithm": "diloco",
                                                   "local_steps": 32, "stream_fragments": 4, "overlap_steps": 4},
    "torchft:localsgd:sync=8": {"mode": "torchft", "sync": "bsp", "torchft_algorithm": "localsgd", "local_steps": 8,
                                "stream_fragments": 1, "overlap_steps": 0},
    # per-mode outer optimizer settings (local-update specs), torchft's alpha and wire dtype
    "ps-local32:int8:outer=avg": {"mode": "ps", "sync": "bsp", "codec": "int8", "local_steps": 32,
                                  "stream_fragments": 1, "overlap_steps": -1, "outer_optimizer": "avg"},
    "ps-local8:topk:ratio=0.1:outer_lr=0.7,outer_momentum=0.9": {
        "mode": "ps", "sync": "bsp", "codec": "topk:ratio=0.1", "local_steps": 8, "stream_fragments": 1,
        "overlap_steps": -1, "outer_lr": 0.7, "outer_momentum": 0.9},
    "ps-local8:outer=sgd": {"mode": "ps", "sync": "bsp", "codec": "none", "local_steps": 8, "stream_fragments": 1,
                            "overlap_steps": -1, "outer_optimizer": "sgd"},
    "torchft:diloco:sync=32:alpha=0.5:wire=bf16:outer=nesterov:outer_lr=0.7": {
        "mode": "torchft", "sync": "bsp", "torchft_algorithm": "diloco", "local_steps": 32, "stream_fragments": 1,
        "overlap_steps": 0, "torchft_alpha": 0.5, "torchft_wire": "bf16", "outer_optimizer": "nesterov", "outer_lr": 0.7},
    "torchft:diloco:sync=32:wire=fp16:min_replicas=2:timeout=10": {
        "mode": "torchft", "sync": "bsp", "torchft_algorithm": "diloco", "local_steps": 32, "stream_fragments": 1,
        "overlap_steps": 0, "torchft_wire": "fp16", "torchft_min_replicas": 2, "torchft_timeout_s": 10.0},
    "torchft:diloco:sync=8:outer=sgd:outer_momentum=0:wire=fp16": {
        "mode": "torchft", "sync": "bsp", "torchft_algorithm": "diloco", "local_steps": 8, "stream_fragments": 1,
        "overlap_steps": 0, "torchft_wire": "fp16", "outer_optimizer": "sgd", "outer_momentum": 0.0},
}
BAD = {   # spec -> what the message says besides the spec itself
    "horovod": "use ddp[:<hook>|:sparse[:fp16|bf16]]",
    "": "ps-local<H>[x<F>][o<tau>][q<Q>]:<codec>",
    "DDP": "unknown mode spec",
    "ps-localx:int8": "ps-local<H>[x<F>][o<tau>][q<Q>]:<codec>",
    "ps-local8x:int8": "unknown mode spec",
    "pipeline": "unknown mode spec",
    "horovod:fp16": "unknown mode spec",
    "torchft": "torchft runs diloco or localsgd",
    "torchft:diloco": "needs sync=H",
    "torchft:diloco:sync=8:tau=2": "takes sync=H, fragments=F, delay=tau",
    "torchft:localsgd:sync=8:fragments=2": "takes sync=H, min_replicas=N (integers), timeout=S",
    "torchft:diloco:sync=8:min_replicas=x": "min_replicas=N (integers)",
    "torchft:diloco:sync=8:timeout=0": "timeout=S",
    "ddp:int8": "unknown ddp hook 'int8'; use none, fp16, bf16, powersgd:rank=R",
    "ddp:fp8": "unknown ddp hook",
    "ddp:fp16:rank=2": "unexpected parameter",
    "ddp:powersgd:rank=0": "rank must be >= 1",
    "ddp:powersgd:rank=two": "rank must be an integer",
    "ddp:powersgd:rank=2:start=1": "start must be >= 2",
    "ddp:powersgd:period=2": "unexpected parameter",
    "ddp:powersgd:impl=nccl": "impl must be auto, torch or deltaps",
    "ddp:localsgd": "needs period=H",
    "ddp:localsgd:period=0": "period must be >= 1",
    "ddp:localsgd:period": "unexpected parameter",
    "ddp:sparse:powersgd:rank=2": "ddp:sparse takes fp16 or bf16 for its dense buckets",
    "ddp:sparse,fp16": "sparse is not a DDP comm hook",
    "hybrid:int8": "hybrid takes fp16 or bf16",
    "hybrid:FP16": "hybrid takes fp16 or bf16",
    "hybrid:ttl=5": "apply to a dynamic table",
    "torchrec:rowwise": "torchrec takes fp16 or bf16",
    "torchrec:sharding=row_wise": "sharding=table_wise|column_wise",
    "ps:int8:outer=avg": "need a local-update mode",
    "ps-local8:int8:outer=adam": "outer must be avg, sgd or nesterov",
    "ps-local8:int8:outer_lr=fast": "outer_lr must be a number",
    "torchft:diloco:sync=8:wire=int8": "alpha=a in [0, 1], wire=fp32|fp16|bf16, timeout=S, not 'wire=int8'",
    "torchft:diloco:sync=8:alpha=2": "not 'alpha=2'",
    "torchft:localsgd:sync=8:outer=avg": "has no outer optimizer",
    "torchft:localsgd:sync=8:wire=bf16": "takes sync=H, min_replicas=N (integers), timeout=S, not",
}


def _cal():
    return cm.Calibration(bandwidth_Bps=1e8, alpha_s=1e-4, rpc_s=1e-4, grpc_Bps=math.inf, fwd_bwd_s={1: 0.01},
                          bwd_fraction=0.0, optimizer_s={},
                          codecs={cm.canonical(c): cm.CodecSpeed(1e9, 1e9, r) for c, r in (("int8", 4.0),
                                                                                          ("topk:ratio=0.01", 50.0))})


JOB = cm.Job(tensors=[("a", 1 << 18), ("b", 1 << 18)], workers=4, shards=2)


def test_every_accepted_form_gives_the_same_overrides():
    for text, want in EXPECTED.items():
        got = parse_mode(text)
        assert list(got.items()) == list(want.items()), text
        load_config(None, {"workers": 2, **({"workload": "ctr"} if got.get("sparse_embeddings") else {}), **got})
        if "ddp_hook" in got:                       # canonical hook specs parse to themselves
            assert str(parse_ddp_hook(got["ddp_hook"])) == got["ddp_hook"]
        spec = parse_mode_spec(text)
        assert spec.text == text and spec.family in ("ddp", "ps", "hybrid", "torchft", "torchrec")
        again = parse_mode_spec(str(spec))         # the canonical spelling names the same mode
        assert again == spec and again.overrides() == want, (text, str(spec))
    assert str(parse_mode_spec("ddp")) == "allreduce" and str(parse_mode_spec("ps")) == "ps:none"
    assert str(parse_mode_spec("ps-local8x1o2:int8")) == "ps-local8o2:int8"
    assert str(parse_mode_spec("allreduce:powersgd:rank=2")) == "ddp:powersgd:rank=2:start=10"
    assert str(parse_mode_spec("ps-local8:outer_lr=0.7,outer=sgd")) == "ps-local8:none:outer=sgd:outer_lr=0.7"
    assert split_mode_specs("ps-local32:int8,outer=avg,ddp") == ["ps-local32:int8,outer=avg", "ddp"]
    from worker.trainers.strategy import available_strategies
    assert sorted(MODES) == available_strategies()      # the grammar's modes are the registered strategies


def test_bad_specs_name_the_spec_and_the_accepted_forms():
    for text, why in BAD.items():
        with pytest.raises(ValueError) as e:
            parse_mode_spec(text)
        assert repr(text) in str(e.value) and why in str(e.value), (text, str(e.value))
        if text.startswith("ddp"):                  # hook errors say which mode spec carried the hook
            assert str(e.value).startswith(f"mode {text!r}: ")
        with pytest.raises(ValueError, match="mode"):
            parse_mode(text)
    with pytest.raises(ValueError) as e:
        parse_mode_spec("horovod")
    assert str(e.value) == f"unknown mode spec 'horovod'; use {MODE_FORMS}"


def test_the_hook_grammar_is_the_one_ddp_hooks_uses():
    hooks = pytest.importorskip("worker.trainers.ddp_hooks")
    assert hooks.parse_ddp_hook is parse_ddp_hook
    assert str(parse_ddp_hook("powersgd:rank=2")) == "powersgd:rank=2:start=10"
    with pytest.raises(ValueError, match="sparse is not a DDP comm hook"):
        parse_ddp_hook("sparse")


def test_a_ps_spec_names_its_own_shard_count():
    """shards=N (bench compare: the mode's shards) is not a TrainConfig field, and it round-trips."""
    for text, codec in (("ps:int8:shards=2", "int8"), ("ps-asp:shards=1", "none"),
                        ("ps-local32x4o4:lowrank:rank=32,keys=balanced,shards=1", "lowrank:rank=32,keys=balanced"),
                        ("ps-local32:int8:outer=avg:shards=3", "int8")):
        spec = parse_mode_spec(text)
        assert spec.codec == codec and spec.shards == int(text[-1]) and "servers" not in spec.overrides()
        assert parse_mode_spec(str(spec)) == spec and str(spec).endswith(f":shards={spec.shards}")
    assert parse_mode_spec("ps-local32:int8").shards is None
    for bad in ("ps:int8:shards=0", "ps:int8:shards=two", "ps:shards=1:shards=2"):
        with pytest.raises(ValueError, match="shards= takes one positive integer") as e:
            parse_mode_spec(bad)
        assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="unknown"):      # not a PS family: shards= is not its parameter
        parse_mode_spec("ddp:shards=2")
    cal = _cal()       # the cost model prices the spec's own shard count
    one = cm.predict(cal, dataclasses.replace(JOB, shards=1), "ps-local32:int8")
    assert cm.predict(cal, JOB, "ps-local32:int8:shards=1") == {**one, "strategy": "ps-local32:int8:shards=1"}
    assert cm.predict(cal, JOB, "ps-local32:int8:shards=1") != cm.predict(cal, JOB, "ps-local32:int8")


def test_lists_of_specs():
    assert split_mode_specs(" allreduce,,ps:topk:ratio=0.01,chunk=4096, ddp:powersgd:rank=2,start=3 ") == [
        "allreduce", "ps:topk:ratio=0.01,chunk=4096", "ddp:powersgd:rank=2,start=3"]
    assert parse_mode("ddp:powersgd:rank=2,start=3")["ddp_hook"] == "powersgd:rank=2:start=3"
    assert ps_codecs(["allreduce", "ps:none", "ps:int8", "ps-local8:int8", "ps-asp:topk:ratio=0.01", "ps"]) == [
        "none", "int8", "topk:ratio=0.01"]


def test_the_cost_model_takes_the_same_names():
    cal = _cal()
    assert cm.predict(cal, JOB, "ddp") == cm.predict(cal, JOB, "allreduce")
    assert cm.predict(cal, JOB, "ps-bsp:int8") == cm.predict(cal, JOB, "ps:int8")
    assert cm.predict(cal, JOB, "ps")["strategy"] == "ps:none"
    p = cm.predict(cal, JOB, "ps-local32x4o4:int8")
    assert p["strategy"] == "ps-local32x4o4:int8" and (p["local_steps"], p["stream_fragments"], p["overlap_steps"]) == (
        32, 4, 4)
    for text in ("ddp:fp16", "ddp:sparse", "ps-asp:int8", "hybrid", "hybrid:bf16"):      # valid, not modelled
        parse_mode(text)
        with pytest.raises(ValueError, match="the cost model predicts allreduce") as e:
            cm.predict(cal, JOB, text)
        assert repr(text) in str(e.value)
    for text in BAD:
        with pytest.raises(ValueError) as e:
            cm.predict(cal, JOB, text)
        assert repr(text) in str(e.value)


# ---- generated specs: the grammar's pieces, and what each must give ----------------------------------------
CODECS = st.sampled_from([None, "", "none", "int8", "topk:ratio=0.01"])


@st.composite
def local_specs(draw):
    H, F = draw(st.integers(1, 64)), draw(st.one_of(st.none(), st.integers(1, 8)))
    tau, codec = draw(st.one_of(st.none(), st.integers(0, 16))), draw(CODECS)
    text = f"ps-local{H}{'' if F is None else f'x{F}'}{'' if tau is None else f'o{tau}'}"
    text += "" if codec is None else f":{codec}"
    return text, {"mode": "ps", "sync": "bsp", "codec": codec or "none", "local_steps": H,
                  "stream_fragments": F or 1, "overlap_steps": -1 if tau is None else tau}


@st.composite
def other_specs(draw):
    kind = draw(st.sampled_from(["ddp", "allreduce", "ps", "ps-bsp", "ps-asp", "hybrid"]))
    if kind in ("ddp", "allreduce"):
        sparse, hook = draw(st.booleans()), draw(st.sampled_from([None, "fp16", "bf16"]))
        text = kind + (":sparse" if sparse else "") + (f":{hook}" if hook else "")
        return text, {"mode": "allreduce", **({"sparse_embeddings": True} if sparse else {}),
                      **({"ddp_hook": hook} if hook else {})}
    if kind == "hybrid":
        hook = draw(st.sampled_from([None, "fp16", "bf16"]))
        return kind + (f":{hook}" if hook else ""), {"mode": "hybrid", "sync": "bsp", "codec": "none",
                                                      "workload": "ctr", **({"ddp_hook": hook} if hook else {})}
    codec = draw(CODECS)
    return kind + ("" if codec is None else f":{codec}"), {"mode": "ps", "sync": "asp" if kind == "ps-asp" else "bsp",
                                                          "codec": codec or "none"}


@settings(max_examples=150, deadline=None)
@given(st.one_of(local_specs(), other_specs()))
def test_generated_specs_round_trip(case):
    text, want = case
    assert list(parse_mode(text).items()) == list(want.items())
    spec = parse_mode_spec(text)
    assert parse_mode_spec(str(spec)) == spec
    assert isinstance(spec, ModeSpec) and spec.overrides() == want


@settings(max_examples=60, deadline=None)
@given(local_specs())
def test_the_cost_model_and_the_config_agree_on_local_specs(case):
    """A ps-local spec is predicted exactly when bench compare's config check takes it (tau < H / F)."""
    text, want = case
    try:
        load_config(None, dict(want))
        valid = True
    except ValueError:
        valid = False
    if not valid:
        with pytest.raises(ValueError, match="overlap"):
            cm.predict(_cal(), JOB, text)
        return
    p = cm.predict(_cal(), JOB, text)
    assert (p["local_steps"], p["stream_fragments"]) == (want["local_steps"], want["stream_fragments"])
    assert want["overlap_steps"] in (-1, p["overlap_steps"])


def test_the_makefiles_race_modes_parse():
    """`make bench-peers` / `bench-peers-quick` name their modes in the Makefile: each must be a spec bench compare
    takes (a typo there would surface only after an hour of races)."""
    import re as _re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text().replace("$(comma)", ",")
    lists = _re.findall(r"^(?:PEERS_\w+|DELTAPS_\w+|\w+_MODES|TORCHFT_FT) \??= (.+)$", text, _re.M)
    lists += _re.findall(r"--modes (\S+)", text)
    assert len(lists) >= 6
    for modes in lists:
        modes = _re.sub(r"\$\(if \$\(filter \w+,\$\(1\)\),(\w+),\)", r"\1,", modes)   # PEERS_lm's conditional ddp
        if "$" in modes:
            continue        # a make expansion, not a list
        for spec in split_mode_specs(modes):
            parse_mode(spec)
