"""Fixtures of the CUDA kernel tests: the backend, the precision, a seeded rng, the gradient mode, cuBLASLt on/off."""
import sys
from pathlib import Path
import zlib
import numpy as np
import pytest

from cudakit import PREC, TOP_CONFTEST


@pytest.fixture(scope="module")
def be():
    from andrea.backends import get_backend
    return get_backend("cuda")


@pytest.fixture(params=list(PREC))
def prec(request):
    return PREC[request.param]


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture(params=[True, False], ids=["add", "write"])
def accumulate(request):
    """The backward kernels' two modes for the activation gradient: add into it (the default), or
    write it (accumulate=False, the first writer in model.backward)."""
    return request.param


# ---------------------------------------------------------------- linear layers
@pytest.fixture(params=[True, False], ids=["cublaslt", "cublas"])
def lt(request, be, monkeypatch):
    """Both paths of the products with a bias or GELU: cuBLASLt epilogues, and cuBLAS + kernels."""
    monkeypatch.setattr(be, "cublaslt", request.param)
    return request.param




def pytest_plugin_registered(plugin, manager):
    """pytest imports every folder's conftest.py (none in a package) under the one module name
    `conftest`, this one last: once it is registered, tests/conftest.py goes back under that name for
    the test modules that import their helpers from it (from conftest import make_shards, ...)."""
    if plugin is sys.modules[__name__]:
        top = manager.get_plugin(str(Path(__file__).resolve().parent.parent / "conftest.py"))
        sys.modules["conftest"] = top if top is not None else TOP_CONFTEST
