"""Public names loaded on first use (PEP 562), written once for every package face.

``kernels_runtime`` and ``kernels_runtime.inference`` name classes and functions whose modules
import torch; the notebook side imports those packages' torch-free modules (``mesh.plan``,
``telemetry``), and a package's ``__init__`` runs first, so its public names must not be
imported eagerly. A package calls ``lazy_module`` with its map of public names and gets the
``__getattr__`` and ``__dir__`` it assigns at module level. Torch-free, imports nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_module(public: dict[str, str], package_globals: dict[str, Any]
                ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__, __dir__ = lazy_module({"Plan": "kernels_runtime.mesh.plan"}, globals())``.

    ``public`` maps each name to the module that defines it; the first access imports that
    module and caches the value in ``package_globals``, so later accesses skip ``__getattr__``.
    """
    package = package_globals.get("__name__", "<package>")
    for name, module in public.items():
        if not isinstance(module, str) or not module:
            raise TypeError(f"{package}: the lazy map's entry {name!r} must name the module "
                            f"that defines it (a dotted string), not {module!r}")

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        package_globals[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*package_globals, *public})

    return __getattr__, __dir__
