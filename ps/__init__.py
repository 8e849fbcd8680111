"""deltaps parameter server: shards, partitioning, sync modes, server optimizer, CLI."""
