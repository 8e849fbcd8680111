"""deltaps training-side client: push/pull by key, DistributedOptimizer wrapper, trainer, allreduce mode."""
from worker.client import PSClient, PSError
from worker.optimizer import DistributedOptimizer

__all__ = ["PSClient", "PSError", "DistributedOptimizer"]
