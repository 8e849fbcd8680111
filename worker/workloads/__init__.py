"""Bundled workloads; importing this package registers them (see worker.workloads.base.get_workload)."""
from worker.workloads import clf, ctr, digits  # noqa: F401
from worker.workloads.base import Workload, available_workloads, get_workload, register, workload_class

__all__ = ["Workload", "available_workloads", "get_workload", "register", "workload_class"]
