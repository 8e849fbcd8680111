"""Pipelined row exchange for the BSP steps of hybrid training (worker/trainers/hybrid.py).

A sequential hybrid step pulls its rows, runs forward and backward (DDP allreduces the dense gradients in
backward), pushes the row gradients and only then pulls the next step's rows. Here the row gradients are
pushed the moment autograd has them — while DDP's allreduce of the dense buckets is still in flight — and
the next step's rows are requested right behind them, so the sparse round trip hides behind the allreduce
and the optimizer step. The values are exactly the sequential ones: the shard answers a pull for step t+1
only at version t+1, i.e. once every worker's step-t push is applied (ps/embedding/store.py).

    pipe = RowPipeline(client, embs)
    for step ...:
        waited = pipe.begin(step, ids)      # this step's rows (requested during the previous step)
        out = model(ids, ...)
        pipe.arm(step, next_ids)            # push on gradient, then pull next_ids (None on the last step)
        loss.backward()
        pipe.flush()                        # push now if a table got no gradient in backward
    pipe.close()
"""
from __future__ import annotations

import torch

from worker.embedding.client import EmbeddingClient
from worker.embedding.modules import PSEmbedding


class RowPipeline:
    def __init__(self, client: EmbeddingClient, embs: dict[str, PSEmbedding]):
        self.client, self.embs = client, embs
        self._pull = None           # (step, ids, unique ids, inverse, PendingPull) of the rows a coming step needs
        self._pushes: list = []     # futures of the latest push; their errors surface at the next begin()
        self._step, self._next, self._waiting, self._pushed = -1, None, set(), True

    def _start_pull(self, step: int, ids: torch.Tensor) -> None:
        uniq, inv = torch.unique(ids, return_inverse=True)
        self._pull = (step, ids, uniq, inv, self.client.pull_rows_async({n: uniq for n in self.embs}, step))

    def begin(self, step: int, ids: torch.Tensor) -> float:
        """Hand every table its rows of `ids` at version `step` (blocks until they arrive and the previous
        push is acknowledged); returns the servers' BSP wait for them in seconds."""
        if self._pull is None or self._pull[0] != step or not torch.equal(self._pull[1], ids):
            self._settle()
            self._start_pull(step, ids)
        _, _, uniq, inv, pending = self._pull
        self._pull = None
        vals, waited = pending.result()
        self._settle()
        for name, e in self.embs.items():
            e.hand_over(ids, uniq, inv, vals[name], waited)
        return waited

    def arm(self, step: int, next_ids: torch.Tensor | None) -> None:
        """After forward: push step's row gradients as soon as every table has its gradient, then request
        next_ids' rows for step + 1."""
        self._step, self._next, self._pushed = step, next_ids, False
        self._waiting = {n for n, e in self.embs.items() if e.rows_need_grad()}
        for n in self._waiting:
            self.embs[n].on_rows_grad(lambda n=n: self._grad_ready(n))

    def _grad_ready(self, name: str) -> None:
        self._waiting.discard(name)
        if not self._waiting and not self._pushed:
            self._push()

    def _push(self) -> None:
        grads = {}
        for e in self.embs.values():
            grads.update(e.row_grads())
        self._pushes = self.client.push_rows_async(self._step, grads)
        self._pushed = True
        if self._next is not None:
            self._start_pull(self._step + 1, self._next)

    def flush(self) -> None:
        """After backward: push now where a hook did not (a table whose rows got no gradient)."""
        if not self._pushed:
            self._push()

    def _settle(self) -> None:
        for f in self._pushes:
            f.result()
        self._pushes = []

    def close(self) -> None:
        """Wait for what is in flight (a pull requested past the last step included); errors raise."""
        if self._pull is not None:
            self._pull[4].result()
            self._pull = None
        self._settle()
