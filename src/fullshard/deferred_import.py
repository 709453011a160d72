"""Running code right after a module is first imported (:func:`after_import`), without
importing it: fullshard defers work that needs an expensive module (dynamo: 2.6 s per process
here) or one a program may never load (torch's DCP state-dict functions) until something imports
it anyway. Imports nothing of fullshard (layer 0, as :mod:`fullshard.compat`)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["after_import"]


def after_import(module_name: str, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once ``module_name`` is imported: now if it already is, else right after
    its module body runs, the first time anything imports it (an import-system finder,
    PEP 451, that removes itself once used). An error in ``callback`` fails that import.

    Used to defer work that needs an expensive module (dynamo: 2.6 s per process here) until a
    program imports it anyway.
    """
    if module_name in sys.modules:
        callback()
        return
    sys.meta_path.insert(0, _AfterImport(module_name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """The finder of :func:`after_import`: finds ``name``'s spec with the other finders and
    wraps its loader's ``exec_module`` so ``callback`` runs after the module body."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_body, callback = spec.loader.exec_module, self.callback

        def exec_module(module: Any) -> None:
            run_body(module)
            callback()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
