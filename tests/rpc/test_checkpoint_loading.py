"""A checkpoint whose checksum holds but whose content does not load is skipped for the previous one, and the
failed try leaves the shard as it was (ps/durability.py restore_latest, ps/state.py parse_shard_state)."""
import logging
import os

import pytest
import torch

from deltaps.layout import Key
from deltaps.optimizer_config import OptimizerConfig
from ps.checkpoint import write_checkpoint
from ps.durability import Checkpointer, restore, restore_latest, snapshot
from ps.shard import Shard


def _key(n=8):
    return Key("w#0", "w", 0, n, "float32", 0)


@pytest.mark.parametrize("damage", ["format", "other_shard", "missing_field", "embedding"])
def test_checkpoint_that_reads_but_does_not_load_falls_back(tmp_path, caplog, damage):
    """A newest checkpoint whose checksum holds but whose content does not load (another format, another
    shard's, a key missing a field) is skipped for the previous one, and the failed try changed nothing."""
    shard = Shard(0, 1)
    shard.register(0, 1, 1, "bsp", OptimizerConfig("sgd", lr=1.0), [_key()], "d", "none")
    shard.init([("w#0", torch.zeros(8))])
    first = Checkpointer(shard, str(tmp_path)).checkpoint()
    shard.push(0, 0, [("w#0", torch.ones(8))], [])
    state = snapshot(shard)
    if damage == "format":
        state["format"] = 99
    elif damage == "other_shard":
        state["num_shards"] = 2
    elif damage == "missing_field":   # the job and counters parse; the key does not: nothing of it may be adopted
        del state["keys"]["w#0"]["pushed"]
    else:   # the dense part loads, the embedding part (another shard's) does not: the dense part is not adopted
        state["embedding"] = {"shard_id": 1, "num_shards": 2}
    newest = write_checkpoint(str(tmp_path), 0, state)
    fresh = Shard(0, 1)
    with caplog.at_level(logging.ERROR, logger="deltaps.durability"):
        assert restore_latest(fresh, str(tmp_path)) == first
    assert "does not load" in caplog.text and os.path.basename(newest) in caplog.text
    assert fresh.keys["w#0"].version == 0 and torch.equal(fresh.keys["w#0"].value, torch.zeros(8))
    untouched = Shard(0, 1)
    with pytest.raises((ValueError, KeyError)):
        restore(untouched, state)
    assert untouched.job is None and untouched.keys == {} and not untouched.restored


def test_no_checkpoint_loads_starts_empty(tmp_path, caplog):
    write_checkpoint(str(tmp_path), 0, {"format": 99})
    fresh = Shard(0, 1)
    with caplog.at_level(logging.WARNING, logger="deltaps.durability"):
        assert restore_latest(fresh, str(tmp_path)) is None
    assert "starting empty" in caplog.text and fresh.job is None
