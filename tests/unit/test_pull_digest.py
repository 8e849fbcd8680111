"""A pull's digest offer on the shard side (ps/pull_views.py answer_key / digest_of): 'unchanged' only for the very bytes a
full answer would carry, one hash for any number of fresh workers, and never a stale remembered digest."""
import torch

import ps.pull_views as pull_views
from deltaps.layout import Key
from deltaps.optimizer_config import OptimizerConfig
from deltaps.pull_codec import FULL, UNCHANGED, offered_digests, values_digest
from ps.optimizer import KeyOptimizer
from ps.state import KeyState


def _key_state(opt: OptimizerConfig | None = None) -> KeyState:
    ks = KeyState(Key("w#0", "w", 0, 100, "float32", 0), torch.arange(100, dtype=torch.float32))
    ks.initialized = True
    if opt is not None:
        ks.opt = KeyOptimizer(ks.value, opt)
    return ks


def test_many_fresh_workers_cost_one_hash(monkeypatch):
    calls = []
    monkeypatch.setattr(pull_views, "values_digest", lambda t: calls.append(1) or values_digest(t))
    ks = _key_state()
    offer = values_digest(ks.value)
    assert [pull_views.answer_key(ks, -1, offer)[0] for _ in range(8)] == [UNCHANGED] * 8
    assert len(calls) == 1
    kind, value = pull_views.answer_key(ks, -1, b"\0" * 16)            # another worker's values: the full value
    assert kind == FULL and torch.equal(value, ks.value) and len(calls) == 1


def test_a_value_changed_at_the_same_version_is_hashed_again():
    """asp / ssp apply pushes between version changes, through torch's fused optimizer kernels (which do not bump the
    tensor's in-place counter themselves: KeyOptimizer does) or plain in-place writes."""
    for change in (lambda ks: ks.opt.apply_step(torch.ones(100)), lambda ks: ks.value.add_(1.0)):
        ks = _key_state(OptimizerConfig("sgd", lr=0.9, momentum=0.8, nesterov=True))
        old = values_digest(ks.value)
        assert pull_views.answer_key(ks, -1, old)[0] == UNCHANGED
        change(ks)
        assert ks.version == 0
        kind, value = pull_views.answer_key(ks, -1, old)
        assert kind == FULL and torch.equal(value, ks.value)
        assert pull_views.answer_key(ks, -1, values_digest(ks.value))[0] == UNCHANGED


def test_a_worker_holding_a_view_version_is_served_as_before():
    ks = _key_state()
    assert pull_views.answer_key(ks, 0, values_digest(ks.value))[0] == UNCHANGED    # have == version: no hash needed
    assert pull_views.answer_key(ks, None, values_digest(ks.value))[0] == FULL       # a plain pull is always exact


def test_a_worker_offers_digests_of_float32_values_only():
    x = torch.randn(10)
    assert offered_digests([x, None]) == [values_digest(x), b""]
    assert offered_digests([None, None]) == []
    assert offered_digests([x.double()]) == []       # a full answer would write x's float32 rounding into it
