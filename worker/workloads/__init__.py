"""Bundled workloads. Importing this package imports every module in it, and each workload module registers
its class (`@register`, worker.workloads.base): a new workload is one new module here, nothing else to edit."""
import importlib
import pkgutil

from worker.workloads.base import Workload, available_workloads, get_workload, register, workload_class

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Workload", "available_workloads", "get_workload", "register", "workload_class"]
