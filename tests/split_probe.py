"""A worker's view of tabular splits, for tests/unit/test_data_cache.py: `python tests/split_probe.py SPLIT...` builds
--workload clf (seed 1, --eval-split SPLIT) as a worker would, for each SPLIT, and prints, as JSON, per split a digest
of its four tensors and their sizes, and whether scikit-learn was imported to make them."""
from __future__ import annotations

import hashlib
import json
import sys


def main(argv: list[str]) -> int:
    from deltaps.config import TrainConfig
    from worker.workloads import get_workload
    splits = {}
    for split in argv:
        w = get_workload(TrainConfig(workload="clf", seed=1, eval_split=split))
        tensors = (w.x_tr, w.y_tr, w.x_te, w.y_te)
        digest = hashlib.blake2b(b"".join(t.contiguous().numpy().tobytes() for t in tensors)).hexdigest()
        splits[split] = {"digest": digest, "n": [len(w.y_tr), len(w.y_te)]}
    print(json.dumps({"splits": splits, "sklearn": "sklearn" in sys.modules}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
