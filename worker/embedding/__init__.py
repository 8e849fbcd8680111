"""Row-sparse embeddings on the parameter servers, worker side (the shard side is ps/embedding/).

    client = EmbeddingClient(servers, rank, world_size, [TableSpec("emb", 1_000_000, 64, "adagrad", lr=0.05)])
    emb = PSEmbedding("emb", client)            # drop-in for nn.Embedding(1_000_000, 64) in forward
    for step, (ids, y) in enumerate(batches):
        out = model(emb(ids))                    # pulls only the unique rows of `ids` (blocks for step's version)
        loss.backward()                          # gradient lands in a small [n_unique, 64] local tensor
        client.push_rows(step, emb.row_grads())  # pushes only those rows' gradients (one request per shard)

The whole step never materialises the table: a worker holds unique-ids x dim floats. Rows live on shard
id % num_shards (ps/embedding/ applies the row-wise optimizer there). `replace_embeddings(model, ...)`
swaps the nn.Embedding modules a rule selects for PSEmbedding modules.

  * client.py    EmbeddingClient (sparse pull/push per shard, in parallel), PendingPull
  * session.py   EmbeddingSession: shard restarts and evictions, per shard (reconnect, replay, rejoin)
  * modules.py   PSEmbedding (the nn.Module), select_ps_modules, replace_embeddings
  * pipeline.py  RowPipeline: hybrid's bsp row exchange, pipelined behind the dense allreduce
"""
from worker.embedding.client import EmbeddingClient, PendingPull
from worker.embedding.modules import PSEmbedding, replace_embeddings, select_ps_modules
from worker.embedding.pipeline import RowPipeline
from worker.embedding.session import EmbeddingSession

__all__ = ["EmbeddingClient", "EmbeddingSession", "PSEmbedding", "PendingPull", "RowPipeline", "replace_embeddings",
           "select_ps_modules"]
