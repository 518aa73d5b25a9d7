"""One line of burstmpi taken out for a test's duration (a mutation test): the function
that holds it gets the code of its module recompiled without that line, in place, so
every reference to it (imports, bound methods, subclasses) runs the mutant until the
monkeypatch is undone.
"""

import inspect
import types

__all__ = ["without"]


def _functions(code):
    """The code objects of the functions ``code`` defines, at any depth (class bodies
    included), with their own definitions."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _functions(const)


def _holds(code, lineno):
    """Whether ``code`` or a function nested in it has line ``lineno``."""
    return any(ln == lineno for _, _, ln in code.co_lines()) or any(_holds(c, lineno) for c in _functions(code))


def _originals(module):
    """Every function object of ``module`` by qualified name: module functions, methods,
    static and class methods, properties' accessors, and what decorators wrap."""
    found = {}

    def add(f):
        while f is not None:
            f = getattr(f, "__func__", f)
            if isinstance(f, types.FunctionType) and f.__module__ == module.__name__:
                found.setdefault(f.__code__.co_qualname, f)
            f = getattr(f, "__wrapped__", None)

    for value in vars(module).values():
        if isinstance(value, type):  # the module's classes, also behind a test's subclass
            for cls in value.__mro__:
                if cls.__module__ != module.__name__:
                    continue
                for attr in vars(cls).values():
                    if isinstance(attr, property):
                        for acc in (attr.fget, attr.fset):
                            add(acc)
                    else:
                        add(attr)
        else:
            add(value)
    return found


def without(monkeypatch, module, function, line, replacement="pass"):
    """Run ``module`` with the one line of ``function`` (a qualified name: ``Class.method``)
    whose text (stripped) is ``line`` replaced by ``replacement`` (same indentation): the
    function gets the mutant's code. Returns the line's number."""
    path = inspect.getsourcefile(module)
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    original = _originals(module).get(function)
    if original is None:
        raise AssertionError(f"mutation: {module.__name__}: no function {function}")
    if getattr(original, "__mutated__", False):  # its code is rebuilt from the file: the first mutant would go
        raise AssertionError(f"mutation: {module.__name__}.{function} is already a mutant: take one line out "
                             "of a function at a time")
    body, first = inspect.getsourcelines(original)
    span = range(first - 1, first - 1 + len(body))
    hits = [i for i in span if lines[i].strip() == line.strip()]
    if len(hits) != 1:
        raise AssertionError(f"mutation: {module.__name__}.{function}: expected the line {line!r} once, found "
                             f"it {len(hits)} times (the code moved: update the test)")
    i = hits[0]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = f"{indent}{replacement}  # taken out by a mutation test\n"
    code = compile("".join(lines), path, "exec")
    lineno = i + 1
    # The outermost function holding the line (a nested one is rebuilt when it runs).
    holders = [c for c in _functions(code) if _holds(c, lineno)]
    if not holders:
        raise AssertionError(f"mutation: {module.__name__}:{lineno} is in no function")
    originals = _originals(module)
    holders = [c for c in holders if c.co_qualname in originals]
    if not holders:
        raise AssertionError(f"mutation: {module.__name__}:{lineno} is in no function of the module's")
    outer = min(holders, key=lambda c: c.co_qualname.count("."))
    target = originals.get(outer.co_qualname)
    if target is None:
        raise AssertionError(f"mutation: {module.__name__}: no function {outer.co_qualname} to mutate")
    monkeypatch.setattr(target, "__code__", outer)
    monkeypatch.setattr(target, "__mutated__", True, raising=False)
    return lineno
