"""numpydoc validation of every public docstring of sklearn_lla.

What counts as public
---------------------
* every name in ``__all__`` of each module of :data:`PUBLIC_MODULES` that exists
  (a module listed there but not written yet gives one skipped test, so the tuple
  can list modules before they land);
* the public methods and properties of the public classes: names without a leading
  underscore whose function is *defined in sklearn_lla* (``__module__`` starts with
  ``"sklearn_lla"`` and ``__qualname__`` with a class of the package), including
  those inherited from private base classes such as ``_base``'s mixins, but not
  those inherited from scikit-learn or torch (``get_params``, ``set_fit_request``,
  ``nn.Module.to``, ...);
* public objects that are callable instances (the ``neg_*_scorer`` objects), which
  must carry their own docstring;
* the module docstrings of the public modules.

Aliases (``cqm = centered_quantile_metric``) and methods shared through a base class
are validated once, under the first public name found. Data constants are skipped:
they are documented with ``#:`` comments, which numpydoc cannot see.

The checks (numpydoc error codes) and why
------------------------------------------
Required for public classes, functions and scorer objects (:data:`CHECKS`):

* GL01-GL03, GL05-GL10: layout (blank lines, tabs, known and ordered sections,
  deprecation notes, reST directives); GL08: a docstring must exist;
* SS01-SS06: a one-line summary that starts with a capital, ends with a period
  and, for functions, starts with a verb in the infinitive;
* PR01-PR10: every parameter of the signature documented, none unknown, in order,
  each with a type and a sentence of description;
* RT01, RT03-RT05: functions that return something document it, in sentences;
* YD01: generators document what they yield;
* SA02-SA04: a See Also section, when there is one, is well formed;
* EX01: an Examples section (``make test`` runs them with ``--doctest-modules``).

Left out on purpose:

* ES01 (extended summary): a one-line summary is enough for many functions;
* SA01 (See Also section): cross-references are welcome, not mandatory;
* RT02 (only a type on the first Returns line): numpydoc flags every *named*
  single return value, but naming it (``nll : float``, ``self : object``) is the
  numpydoc and scikit-learn convention and reads better;
* EX01 for methods and properties: as in scikit-learn, a class's examples live
  in the class docstring (:data:`METHOD_CHECKS`).

Module docstrings get the layout and summary checks only (:data:`MODULE_CHECKS`):
they have no parameters or returns, their examples are in the docs, and SS02 is
left out because a module summary may start with the lower-case package name
(``sklearn-lla: ...``).

A second test checks that every public class, function and method has a *literal*
docstring, the first statement of its body (``__doc__`` assigned or built by
concatenation is invisible to static tools and easy to break).
"""

import ast
import importlib
import importlib.util
import inspect
import textwrap

import pytest
from numpydoc.docscrape import get_doc_object
from numpydoc.validate import ERROR_MSGS, Validator, validate

#: Every module whose ``__all__`` is public API. Modules that do not exist yet are
#: skipped by name, so this tuple can grow ahead of the code.
PUBLIC_MODULES = (
    "sklearn_lla",
    "sklearn_lla.metrics",
    "sklearn_lla.nets",
    "sklearn_lla.datasets",
    "sklearn_lla.plotting",
    "sklearn_lla.diagnostics",
    "sklearn_lla.kernels",
    "sklearn_lla.pipeline",
    "sklearn_lla.compose",
    "sklearn_lla.model_selection",
)

_LAYOUT = {"GL01", "GL02", "GL03", "GL05", "GL06", "GL07", "GL08", "GL09", "GL10"}
_SUMMARY = {"SS01", "SS02", "SS03", "SS04", "SS05", "SS06"}
_PARAMETERS = {f"PR{i:02d}" for i in range(1, 11)}
_RETURNS = {"RT01", "RT03", "RT04", "RT05", "YD01"}
_SEE_ALSO = {"SA02", "SA03", "SA04"}

#: Checks for public classes, functions and callable objects (see module docstring).
CHECKS = frozenset(_LAYOUT | _SUMMARY | _PARAMETERS | _RETURNS | _SEE_ALSO | {"EX01"})
#: Checks for public methods and properties: the same without EX01.
METHOD_CHECKS = CHECKS - {"EX01"}
#: Checks for module docstrings: layout and summary, without SS02.
MODULE_CHECKS = frozenset((_LAYOUT | _SUMMARY) - {"SS02"})


def _import_public_modules():
    present, missing = {}, []
    for name in PUBLIC_MODULES:
        if importlib.util.find_spec(name) is None:
            missing.append(name)
        else:  # an import error inside an existing module is a failure, not a skip
            present[name] = importlib.import_module(name)
    return present, missing


def _own_function(attr, klass):
    """The function behind a class attribute when it is defined in ``klass``, else None."""
    if isinstance(attr, (staticmethod, classmethod)):
        func = attr.__func__
    elif isinstance(attr, property):
        func = attr.fget
    elif inspect.isfunction(attr):
        func = attr
    else:  # e.g. sklearn's available_if descriptor keeps the method in ``fn``
        func = getattr(attr, "fn", None)
    if not inspect.isfunction(func):
        return None
    if not (func.__module__ or "").startswith("sklearn_lla"):
        return None
    if not func.__qualname__.startswith(klass.__qualname__ + "."):
        return None
    return func


def _public_methods(cls):
    """``(name, object to validate, function)`` for the public methods of ``cls``."""
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("sklearn_lla"):
            continue
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)  # the first class in the MRO wins, as for attribute lookup
            func = _own_function(attr, klass)
            if func is not None:
                yield name, (attr if isinstance(attr, property) else func), func


def _collect():
    """``(objects, modules, missing)``: ``objects`` are ``(path, obj, kind)`` triples."""
    present, missing = _import_public_modules()
    objects, modules, seen = [], dict(present), set()

    def add(path, obj, kind):
        if id(obj) not in seen:
            seen.add(id(obj))
            objects.append((path, obj, kind))

    for mod_name, mod in present.items():
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            path = f"{mod_name}.{name}"
            if inspect.ismodule(obj):
                modules.setdefault(obj.__name__, obj)
            elif inspect.isclass(obj):
                add(path, obj, "class")
            elif inspect.isfunction(obj):
                add(path, obj, "function")
            elif callable(obj):
                add(path, obj, "object")
            # else: a data constant, documented with a ``#:`` comment

    for path, cls, kind in list(objects):
        if kind == "class":
            for name, target, func in _public_methods(cls):
                if id(func) not in seen:
                    seen.add(id(func))
                    objects.append((f"{path}.{name}", target, "method"))
    return objects, modules, missing


_OBJECTS, _MODULES, _MISSING = _collect()


class _Validator(Validator):
    """numpydoc's validator, built from an object rather than an import path."""

    def __init__(self, obj_name):
        super().__init__(get_doc_object(obj_name))

    @property
    def source_file_def_line(self):
        try:
            return super().source_file_def_line
        except StopIteration:  # numpydoc 1.11 on a module with no def or class in it
            return None


def _errors(obj, checks):
    result = validate(obj, validator_cls=_Validator)
    return [(code, msg) for code, msg in result["errors"] if code in checks], result


def _format_errors(errors, result):
    where = f"{result.get('file')}:{result.get('file_line')}"
    return "\n".join([f"docstring errors ({where}):"] + [f"  {c}: {m}" for c, m in errors])


def test_check_sets_are_known_numpydoc_codes():
    assert CHECKS <= set(ERROR_MSGS), sorted(CHECKS - set(ERROR_MSGS))


@pytest.mark.parametrize(
    "path, obj, kind", _OBJECTS, ids=[path for path, _, _ in _OBJECTS]
)
def test_docstring(path, obj, kind):
    if kind == "object":
        # A callable instance would otherwise be validated against its (private)
        # class docstring.
        assert "__doc__" in vars(obj), f"{path} has no docstring of its own"
    errors, result = _errors(obj, METHOD_CHECKS if kind == "method" else CHECKS)
    assert not errors, _format_errors(errors, result)


@pytest.mark.parametrize(
    "name", sorted(_MODULES) + _MISSING, ids=sorted(_MODULES) + _MISSING
)
def test_module_docstring(name):
    if name in _MISSING:
        pytest.skip(f"{name} does not exist (yet)")
    module = _MODULES[name]
    assert module.__doc__, f"{name} has no module docstring"
    errors, result = _errors(module, MODULE_CHECKS)
    assert not errors, _format_errors(errors, result)


_DEFINED = [(path, obj) for path, obj, kind in _OBJECTS if kind != "object"]


@pytest.mark.parametrize("path, obj", _DEFINED, ids=[path for path, _ in _DEFINED])
def test_docstring_is_a_literal(path, obj):
    func = obj.fget if isinstance(obj, property) else obj
    assert func.__doc__ is not None, f"{path}.__doc__ is None"
    source = textwrap.dedent(inspect.getsource(func))
    node = ast.parse(source).body[0]
    literal = ast.get_docstring(node, clean=True)
    assert literal is not None, (
        f"{path}: the first statement of its body is not a string literal "
        "(write the docstring as a literal; do not assign or concatenate __doc__)"
    )
    assert inspect.cleandoc(func.__doc__) == literal, (
        f"{path}.__doc__ differs from the literal docstring in its source "
        "(it is modified after definition)"
    )
