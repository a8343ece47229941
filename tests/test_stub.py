"""python/shardstate/_core.pyi describes the built extension exactly."""

import ast
import inspect
import pathlib

import shardstate._core as core

STUB = pathlib.Path(core.__file__).with_name("_core.pyi")
ALIASES = {"Buffer", "PathArg", "IntArray"}


def _stub():
    tree = ast.parse(STUB.read_text())
    funcs, classes = {}, {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            funcs[node.name] = node
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    return funcs, classes


def _stub_params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n != "self"]


def _runtime_params(obj) -> list[str] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [p for p in sig.parameters if p not in ("self", "$self", "module", "$module")]


def test_stub_names_match_module():
    funcs, classes = _stub()
    runtime = {n for n in dir(core) if not n.startswith("__")}
    assert set(funcs) | set(classes) == runtime, (
        f"only in stub: {sorted((set(funcs) | set(classes)) - runtime)}; "
        f"only in module: {sorted(runtime - set(funcs) - set(classes))}"
    )


def test_stub_function_parameters_match():
    funcs, _ = _stub()
    for name, node in funcs.items():
        params = _runtime_params(getattr(core, name))
        assert params is not None, f"{name} has no text signature in its docstring"
        assert params == _stub_params(node), name


def test_stub_class_members_exist_with_same_parameters():
    _, classes = _stub()
    for cname, members in classes.items():
        cls = getattr(core, cname)
        assert isinstance(cls, type)
        for mname, node in members.items():
            assert hasattr(cls, mname), f"{cname}.{mname} is in the stub only"
            if mname == "__init__" or isinstance(inspect.getattr_static(cls, mname), property):
                continue
            params = _runtime_params(getattr(cls, mname))
            if params is not None:
                assert params == _stub_params(node), f"{cname}.{mname}"
        if "__init__" in members and cls.__text_signature__ is not None:
            assert _runtime_params(cls) == _stub_params(members["__init__"]), cname
