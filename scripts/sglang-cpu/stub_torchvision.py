"""Import-only stand-ins for torchvision and torchaudio, which SGLang imports at start-up for
multimodal models the CPU test server never loads (PyPI's torchvision needs a newer, CUDA torch).
Any use raises, so a path that really needs them fails loudly."""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torchvision", "torchaudio")


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: stubbed in the SGLang CPU test server")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
