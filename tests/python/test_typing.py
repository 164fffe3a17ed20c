"""The type stub of the compiled module (python/optamp/_C.pyi) names exactly what optamp._C
has, class by class; `mypy --strict python/optamp` (scripts/test.sh) checks the package
against it."""
import ast
import os

import optamp
from optamp import _C

STUB = os.path.join(os.path.dirname(optamp.__file__), "_C.pyi")


def _public(names):
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def _stub_names(body):
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _stub_classes():
    with open(STUB) as f:
        tree = ast.parse(f.read())
    return tree, {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def test_stub_names_every_module_attribute():
    tree, _ = _stub_classes()
    module = _public(dir(_C)) - {"__builtins__"}
    assert _public(_stub_names(tree.body)) == module


def test_stub_names_every_class_member():
    _, classes = _stub_classes()
    for name, node in classes.items():
        cls = getattr(_C, name)
        # pybind11's own helpers (_pybind11_conduit_v1_, an enum's __entries) are not API.
        members = {n for n in dir(cls) if not n.startswith("_")}
        stubbed = {n for n in _stub_names(node.body) if not n.startswith("_")}
        assert stubbed == members, (name, sorted(stubbed ^ members))


def test_package_is_marked_typed():
    assert os.path.isfile(os.path.join(os.path.dirname(optamp.__file__), "py.typed"))
