"""The backend interface (andrea/backends/interface.py) against both backends, on the CPU.

Every member of the Protocol exists in NumpyBackend and CudaBackend with the same parameters
(names, kinds, defaults), and CudaBackend, which runs fp8, has Fp8Backend's members too; neither
backend has public methods its Protocol does not list; the engine, the model, the runner,
evaluation and the benchmark reach a backend only through members of the Protocol, and the
engine's modules import no backend module but the interface (and andrea.backends' get_backend /
backend_class).
"""
import ast
import inspect
import re
from pathlib import Path

import pytest

from andrea.backends.cuda import CudaBackend
from andrea.backends.interface import Backend, Fp8Backend
from andrea.backends.numpy_backend import NumpyBackend

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = [NumpyBackend, CudaBackend]
PROTOCOL = {NumpyBackend: Backend, CudaBackend: Fp8Backend}  # the Protocol each implements


def protocol_members(proto):
    """(methods, attributes) of a Protocol and the Protocols it extends."""
    methods, attributes = set(), set()
    for klass in proto.__mro__:
        if klass in (Backend, Fp8Backend) and (klass is proto or klass in proto.__mro__):
            methods |= {n for n, v in vars(klass).items()
                        if (inspect.isfunction(v) or isinstance(v, staticmethod)) and not n.startswith("_")}
            attributes |= set(vars(klass).get("__annotations__", {}))
    return methods, attributes


def params(fn):
    """(name, kind, default) of each parameter, without self (instance methods and
    staticmethods then compare alike)."""
    ps = list(inspect.signature(fn).parameters.values())
    if ps and ps[0].name == "self":
        ps = ps[1:]
    return [(p.name, p.kind, p.default) for p in ps]


def public_methods(cls):
    out = set()
    for klass in cls.__mro__[:-1]:
        for n, v in vars(klass).items():
            if not n.startswith("_") and isinstance(v, (staticmethod, classmethod)) or \
                    (not n.startswith("_") and inspect.isfunction(v)):
                out.add(n)
    return out


def mismatches(cls, proto=Backend):
    """Every way cls differs from the protocol, as readable lines (empty: it conforms)."""
    methods, attributes = protocol_members(proto)
    out = []
    for name in sorted(methods):
        impl = getattr(cls, name, None)
        if impl is None or not callable(impl):
            out.append(f"{cls.__name__} lacks method {name}")
        elif params(impl) != params(getattr(proto, name)):
            out.append(f"{cls.__name__}.{name}{inspect.signature(impl)} differs from the interface's "
                       f"{inspect.signature(getattr(proto, name))}")
        elif isinstance(inspect.getattr_static(proto, name), staticmethod) and \
                not isinstance(inspect.getattr_static(cls, name), staticmethod):
            out.append(f"{cls.__name__}.{name} must be a staticmethod (the plan asks the class)")
    for name in sorted(attributes):
        if not hasattr(cls, name):
            out.append(f"{cls.__name__} lacks attribute {name}")
    for name in sorted(public_methods(cls) - methods):
        out.append(f"{cls.__name__}.{name} is public but not in the interface")
    return out


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_backend_implements_the_interface(cls):
    assert mismatches(cls, PROTOCOL[cls]) == []


def test_only_fp8_backends_have_fp8_members():
    """The FP8 members are Fp8Backend's: the NumPy backend (no fp8) has none of them, not even
    ones that raise."""
    fp8_only = protocol_members(Fp8Backend)[0] - protocol_members(Backend)[0]
    assert {"fp8_arena_rows", "use_fp8_weight_cache", "k_fp8_linear_fwd"} <= fp8_only
    assert "fp8" in CudaBackend.precisions and "fp8" not in NumpyBackend.precisions
    assert not [n for n in fp8_only if hasattr(NumpyBackend, n)]


def test_both_backends_have_the_same_kernels():
    """Same kernel names and parameters in both (the Protocol check implies it; this says so
    directly, and lists the kernels so an empty interface cannot pass)."""
    kernels = sorted(n for n in protocol_members(Backend)[0] if n.startswith("k_"))
    assert len(kernels) == 33  # 25 of training, k_attn_decode_fwd, 7 of the batched decoder, k_attn_shared_fwd
    for n in kernels:
        assert params(getattr(NumpyBackend, n)) == params(getattr(CudaBackend, n)), n


def test_the_check_catches_a_missing_method_and_a_changed_signature():
    class Missing(NumpyBackend):
        k_adamw_step = None

    class Changed(NumpyBackend):
        @staticmethod
        def k_residual_add(out, a, b, alpha=1.0):
            pass

    class Extra(NumpyBackend):
        def k_new_kernel(self, out):
            pass

    assert mismatches(Missing) == ["Missing lacks method k_adamw_step"]
    assert len(mismatches(Changed)) == 1 and "k_residual_add" in mismatches(Changed)[0]
    assert mismatches(Extra) == ["Extra.k_new_kernel is public but not in the interface"]


def test_numpy_backend_is_a_runtime_backend():
    be = NumpyBackend()
    assert isinstance(be, Backend)
    ws = be.reserve_workspace(2, 8, 16, 2, "float32")
    assert ws.nbytes() == 0
    ran = []
    be.graph_runner().run("key", lambda: ran.append(1))
    be.capture(lambda: ran.append(2)).launch()
    assert ran == [1, 2]


# callers of the backend: the object is named be, self.be, eng.be or e.be there
CALLERS = ["andrea/core/engine.py", "andrea/core/model.py", "andrea/bench/step.py", "andrea/run/runner.py",
           "andrea/pipeline/evaluate.py", "andrea/train.py", "andrea/use/inference.py", "andrea/use/generate.py"]


@pytest.mark.parametrize("path", [p for p in CALLERS if (ROOT / p).is_file()])
def test_callers_use_only_interface_members(path):
    methods, attributes = protocol_members(Fp8Backend)
    used = set(re.findall(r"\bbe\.(\w+)(?![\w*])", (ROOT / path).read_text()))  # not `be.k_*` in prose
    assert used - methods - attributes == set(), f"{path} uses backend members outside the interface"


# the engine's modules: they reach a backend through the Protocol only
ENGINE = ["andrea/core/engine.py", "andrea/core/plan.py", "andrea/core/state.py", "andrea/core/model.py"]
ALLOWED = {"andrea.backends", "andrea.backends.interface"}


def backend_imports(path: Path, package: str) -> set:
    """The andrea.backends modules a file imports (anywhere in it, relative imports resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "andrea.backends" or name.startswith("andrea.backends."):
                out.add(name)
    return out


def offending(imports: set) -> set:
    """Imports of backend modules beyond the interface: a name counts as the module it names, or,
    for `from andrea.backends import get_backend`, the package itself."""
    return {n for n in imports if n not in ALLOWED and not any(n == a + "." + x for a in ALLOWED
                                                                for x in ("get_backend", "backend_class", "cuda_available"))
            and not n.startswith("andrea.backends.interface.")}


@pytest.mark.parametrize("path", ENGINE)
def test_engine_imports_no_backend_module(path):
    assert offending(backend_imports(ROOT / path, "andrea.core")) == set(), \
        f"{path} imports backend modules past the interface"


def test_the_import_check_catches_a_backend_module(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from ..backends.cuda.fp8 import META_STRIDE\nfrom ..backends import get_backend\n"
                   "from ..backends.interface import STATE_LEN\n")
    assert offending(backend_imports(src, "andrea.core")) == {"andrea.backends.cuda.fp8",
                                                              "andrea.backends.cuda.fp8.META_STRIDE"}
