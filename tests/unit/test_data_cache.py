"""The tabular splits kept on disk (worker/workloads/data_cache.py): read back equal and without scikit-learn, never
stale after a source edit, and never in the way (off, or a directory that cannot be written)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from worker.workloads import data_cache
from worker.workloads.data_cache import CACHE_ENV, kept

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "split_probe.py"


def _probe(env_dir, splits=("test", "validation")) -> dict:
    out = subprocess.run([sys.executable, str(PROBE), *splits], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, CACHE_ENV: str(env_dir)}, check=True)
    return json.loads(out.stdout)


def test_a_kept_split_reads_back_equal_without_scikit_learn(tmp_path):
    made, again, fresh = _probe(tmp_path / "cache"), _probe(tmp_path / "cache"), _probe("off")
    assert made["sklearn"] and not again["sklearn"] and fresh["sklearn"]     # the second process read both kept
    for split in ("test", "validation"):
        assert made["splits"][split] == again["splits"][split] == fresh["splits"][split]
    assert made["splits"]["test"]["digest"] != made["splits"]["validation"]["digest"]    # two entries, not one


def test_an_edited_source_is_a_new_entry_never_a_stale_one(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    module = tmp_path / "made_here.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    results = []
    for scale in (1.0, 2.0, 1.0):
        module.write_text(f"import torch\nSCALE = {scale}\ndef make(seed):\n    return torch.full((3,), SCALE + seed)\n")
        sys.modules.pop("made_here", None)
        importlib.invalidate_caches()
        made_here = importlib.import_module("made_here")
        results.append(kept(made_here.make, 1))
    assert [float(r[0]) for r in results] == [2.0, 3.0, 2.0]
    assert len(list((tmp_path / "cache").rglob("output.pkl"))) == 2     # the third call read the first one's entry


def test_off_and_an_unwritable_directory_make_the_split(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    assert data_cache.data_cache_dir() is None
    assert torch.equal(kept(torch.arange, 4), torch.arange(4))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))       # under a file: no directory can be made there
    assert torch.equal(kept(torch.arange, 5), torch.arange(5))
