"""Stand-ins for the GPU-only packages SkyRL's Megatron and FSDP worker modules import at module level, so those
modules (and their real worker classes) import on a CPU-only machine.

Only packages that are not installed are stubbed. Every attribute of a stub module is a stub class (reading
its attributes, calling it or subclassing it gives stubs again). The checks that use this only drive the
workers' weight-sync control flow, with the weight I/O stubbed; no GPU code runs. Installed in a subprocess
(a ``conftest.py`` that calls :func:`install`), never in the main test process: it would make
``importlib.util.find_spec("megatron")`` succeed there.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

GPU_ONLY = ("flash_attn", "megatron", "transformer_engine", "nvidia_resiliency_ext")


class _StubType(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args: object, **kwargs: object) -> type:
        return cls

    def __getitem__(cls, item: object) -> type:
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(f"{self.__name__}.{name}", (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages = packages

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib's signature
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        pass


def install() -> tuple[str, ...]:
    """Stubs the GPU-only packages that are not installed; returns their names."""
    missing = tuple(name for name in GPU_ONLY if importlib.util.find_spec(name) is None)
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    return missing
