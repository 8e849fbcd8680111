"""A name -> class registry for the seams `--mode` and `--workload` name (worker/trainers/strategy.py,
worker/workloads/base.py): `@registry.register("name")` on a class sets its `name`; an unknown name is a
ValueError listing the known ones. `builtin`: modules whose import registers the built-in entries, imported
by name on first lookup (so the users of a registry never import them)."""
from __future__ import annotations

import importlib


class Registry:
    def __init__(self, kind: str, builtin: tuple[str, ...] = ()):
        self.kind, self.builtin = kind, builtin
        self._classes: dict[str, type] = {}

    def register(self, name: str):
        def deco(cls):
            cls.name = name
            self._classes[name] = cls
            return cls
        return deco

    def _load_builtin(self) -> None:
        for module in self.builtin:
            importlib.import_module(module)

    def names(self) -> list[str]:
        self._load_builtin()
        return sorted(self._classes)

    def get(self, name: str) -> type:
        self._load_builtin()
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; use one of {', '.join(sorted(self._classes))}")
        return cls
