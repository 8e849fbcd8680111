"""`--workload lm`: a byte-level causal transformer on the standard library's own source (no download).

Data: the top-level `*.py` files of this Python's standard library (`sysconfig`'s stdlib path; 168 files,
4.7 MB on 3.11.7), read as bytes and split by file — every 10th file (sorted by name) is test, the next one
validation, the rest training — so no test text is ever trained on. A batch is `--batch-size` random windows
of CONTEXT + 1 bytes from the training text (seeded by --seed and the rank); evaluation takes EVAL_WINDOWS
fixed windows of the test text (--eval-split validation: of the validation text).
Model: byte embedding + learned positions, --layers pre-norm TransformerEncoderLayers of width --hidden
(4 heads, feed-forward 4x, causal mask), a final LayerNorm and a linear read-out to 256 bytes.
Metric: test loss in bits per byte (lower is better; the race target is --target-loss); next-byte accuracy
is reported as `test_accuracy`.
"""
from __future__ import annotations

import math
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker.workloads.base import Workload, register

CONTEXT = 64              # bytes of context per prediction window
EVAL_WINDOWS = 512        # fixed windows of the held-out text an evaluation scores
HEADS = 4
SPLITS = {"test": 0, "validation": 1}      # file index mod 10 -> split; the rest is training


@lru_cache(maxsize=None)
def stdlib_text(split: str) -> np.ndarray:
    """The bytes of the stdlib files of `split` ("train", "validation", "test"), concatenated, as uint8."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < 20:
        raise ValueError(f"--workload lm needs the standard library's sources; found {len(files)} files")
    chosen = [f for i, f in enumerate(files) if SPLITS.get(split, -1) == i % 10
              or split == "train" and i % 10 not in SPLITS.values()]
    return np.frombuffer(b"".join(f.read_bytes() for f in chosen), dtype=np.uint8)


def windows(text: np.ndarray, starts: np.ndarray) -> torch.Tensor:
    """[len(starts), CONTEXT + 1] int64 windows of `text`."""
    return torch.from_numpy(text[starts[:, None] + np.arange(CONTEXT + 1)].astype(np.int64))


class ByteTransformer(nn.Module):
    def __init__(self, width: int, layers: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, HEADS, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.position[:n]
        # made per call, not a buffer: buffers are synchronised through the shards, which refuse its -inf
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=x.device)
        return self.out(self.norm(self.blocks(h, mask=mask, is_causal=True)))


@register("lm")
class ByteLM(Workload):
    description = "the standard library's source as bytes, for a byte-level causal transformer"
    metric, target_field, higher_is_better = "test_bits_per_byte", "target_loss", False
    has_validation = True

    @classmethod
    def validate(cls, cfg) -> None:
        super().validate(cfg)
        if cfg.hidden % HEADS:
            raise ValueError(f"--workload lm: --hidden {cfg.hidden} must be a multiple of {HEADS} (attention heads)")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_text = stdlib_text("train")
        held_out = stdlib_text(cfg.eval_split)       # test, or the validation files (--eval-split)
        starts = np.random.default_rng(cfg.seed + 99).integers(0, len(held_out) - CONTEXT - 1, EVAL_WINDOWS)
        self.eval_windows = windows(held_out, np.sort(starts))

    def build_model(self, tables: str = "local") -> nn.Module:
        if tables != "local":
            raise ValueError(f"--workload lm has no embedding tables to keep {tables}")
        return ByteTransformer(self.cfg.hidden, self.cfg.layers, self.cfg.seed)

    def to(self, device: torch.device) -> ByteLM:
        self.eval_windows = self.eval_windows.to(device)
        return self

    def batches(self, rank: int, world_size: int, live=None):
        g = np.random.default_rng([self.cfg.seed, 1 + rank])      # every rank its own stream of windows
        while True:
            w = windows(self.train_text, g.integers(0, len(self.train_text) - CONTEXT - 1, self.cfg.batch_size))
            yield (w[:, :-1],), w[:, 1:]

    def criterion(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, 256), target.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        was = model.training
        model.eval()
        x, y = self.eval_windows[:, :-1], self.eval_windows[:, 1:]
        logits = torch.cat([model(part) for part in x.split(128)])
        model.train(was)
        nats = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).item()
        return {"test_bits_per_byte": nats / math.log(2), "test_loss": nats,
                "test_accuracy": (logits.argmax(-1) == y).float().mean().item()}

    def result_extras(self, evaluation: dict) -> dict:
        return {"final_test_bits_per_byte": evaluation["test_bits_per_byte"], "workload": "lm"}
