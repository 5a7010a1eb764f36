"""The one lazy loader behind the package faces: ``kernels_runtime``, its ``inference``.

What is protected: a public name imports its module only when first read and is then cached
in the package's globals; ``dir()`` lists names not yet loaded; an unknown name is an
``AttributeError`` naming the package; a map entry that is not a module path is refused when
the package is built, not at first use.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernels_runtime._lazy import lazy_module


def test_a_name_is_imported_on_first_use_and_then_cached():
    package = {"__name__": "pkg"}
    getattr_, dir_ = lazy_module({"format_bytes": "kernels_runtime.byte_sizes"}, package)
    assert "format_bytes" in dir_() and "format_bytes" not in package
    value = getattr_("format_bytes")
    assert value(2**20) == "1MiB"
    assert package["format_bytes"] is value


def test_an_unknown_name_is_an_attribute_error_naming_the_package():
    getattr_, _ = lazy_module({}, {"__name__": "pkg"})
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'nope'"):
        getattr_("nope")


def test_an_entry_that_is_not_a_module_path_is_refused_at_once():
    with pytest.raises(TypeError, match="'Engine' must name the module"):
        lazy_module({"Engine": None}, {"__name__": "pkg"})  # type: ignore[dict-item]


def test_the_package_faces_load_lazily():
    code = ("import sys, kernels_runtime, kernels_runtime.inference as inference\n"
            "assert 'torch' not in sys.modules\n"
            "assert {'deferred_parameters', 'Plan'} <= set(dir(kernels_runtime))\n"
            "assert 'Engine' in dir(inference)\n"
            "from kernels_runtime import Plan\n"
            "assert 'torch' not in sys.modules and Plan.__name__ == 'Plan'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
