"""deltaps parameter server, the server only: shards, membership, server optimizer, pull views,
durability, metrics and embedding tables."""
