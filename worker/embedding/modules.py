"""PSEmbedding: an nn.Embedding whose table lives on the parameter servers, and the rule that picks which
nn.Embedding modules of a model go there (select_ps_modules, replace_embeddings)."""
from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from worker.embedding.client import EmbeddingClient


class PSEmbedding(nn.Module):
    """nn.Embedding whose table lives on the parameter servers. forward(ids) pulls the unique rows of ids
    (at the module's `min_version`, the BSP gate: the trainer sets it to the step number) into a small
    local leaf tensor; after backward, row_grads() gives {table: (unique ids, grad rows)} to push."""

    def __init__(self, table: str, client: EmbeddingClient):
        super().__init__()
        self.table, self.client = table, client
        spec = client.tables[table]
        self.num_embeddings, self.embedding_dim = spec.num_rows, spec.dim
        self.min_version = 0
        self.waited_s = 0.0
        self._ids = None
        self._rows = None
        self._prefetched = None

    def prefetch(self, ids: torch.Tensor, min_version: int) -> None:
        """Pull the rows of a batch ahead of forward."""
        uniq, inv = torch.unique(ids, return_inverse=True)
        vals, waited = self.client.pull_rows({self.table: uniq}, min_version)
        self.hand_over(ids, uniq, inv, vals[self.table], waited)

    def hand_over(self, ids: torch.Tensor, uniq: torch.Tensor, inv: torch.Tensor, rows: torch.Tensor,
                  waited: float) -> None:
        """Rows of `ids` pulled elsewhere (prefetch, worker/embedding/pipeline.py): forward(ids) uses them."""
        self._prefetched = (ids, uniq, inv, rows)
        self.waited_s += waited

    def rows_need_grad(self) -> bool:
        return self._rows is not None and self._rows.requires_grad

    def on_rows_grad(self, fn) -> None:
        """fn() once backward has accumulated this forward's row gradient."""
        self._rows.register_post_accumulate_grad_hook(lambda _t: fn())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._prefetched is not None and self._prefetched[0] is ids:
            _, uniq, inv, rows = self._prefetched
        else:
            uniq, inv = torch.unique(ids, return_inverse=True)
            # in eval mode (an evaluation) the pull leaves the table as it is: no rows made, touched or counted
            vals, waited = self.client.pull_rows({self.table: uniq}, self.min_version, peek=not self.training)
            rows = vals[self.table]
            self.waited_s += waited
        self._prefetched = None
        self._ids, self._rows = uniq, rows.requires_grad_(self.training)
        return F.embedding(inv, self._rows)

    def row_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self._rows is None or self._rows.grad is None:
            return {self.table: (torch.empty(0, dtype=torch.int64), torch.empty(0, self.embedding_dim))}
        return {self.table: (self._ids, self._rows.grad)}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r} (on the parameter servers)"


def select_ps_modules(model: nn.Module, rule: str = "embedding") -> list[str]:
    """Names of the modules whose parameters live on the PS in hybrid mode: rule `embedding` = every
    nn.Embedding; otherwise comma-separated fnmatch patterns on module names (or their `.weight`
    parameter names), which must select nn.Embedding modules."""
    embs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    if rule.strip() in ("", "embedding", "embeddings"):
        return list(embs)
    pats = [p.strip() for p in rule.split(",") if p.strip()]
    chosen = []
    for n, m in model.named_modules():
        if n and any(fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(n + ".weight", p) for p in pats):
            if n not in embs:
                raise ValueError(f"--ps-params {rule!r} selects module {n!r} ({type(m).__name__}); only nn.Embedding "
                                 f"modules can live on the PS row-sparse in hybrid mode")
            chosen.append(n)
    if not chosen:
        raise ValueError(f"--ps-params {rule!r} selects no nn.Embedding module (have: {', '.join(embs) or 'none'})")
    return chosen


def replace_embeddings(model: nn.Module, names: list[str], client: EmbeddingClient) -> dict[str, PSEmbedding]:
    """Swap the named nn.Embedding modules for PSEmbedding modules (table name = module name)."""
    out = {}
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        ps_emb = PSEmbedding(name, client)
        setattr(parent, attr, ps_emb)
        out[name] = ps_emb
    return out
