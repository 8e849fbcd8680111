"""deltaps training side: PSClient (push/pull by key), ShardSession, DistributedOptimizer, trainers, workloads."""
from worker.client import PSClient, PSError
from worker.optimizer import DistributedOptimizer

__all__ = ["PSClient", "PSError", "DistributedOptimizer"]
