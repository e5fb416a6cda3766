"""Quick consistency checks of the documentation sources (``make docs`` builds them).

Building the site takes a minute and runs an example, so the test suite does not
build it; these checks catch, in milliseconds, what would otherwise only fail
``make docs`` (or silently leave something out of the site):

* every public name (``__all__`` of the modules in tests/test_docstrings.py's
  ``PUBLIC_MODULES``) is listed in the API reference, docs/api.rst, and every name
  listed there exists;
* every page in docs/ is reached from the toctree of docs/index.md, directly or
  through the toctree of a section page (a glob counts), and every page a toctree
  names exists;
* relative links between pages point to existing files;
* every example has the reST title sphinx-gallery needs, is in the gallery and is
  executed by the docs build (``sphinx_gallery_conf`` in docs/conf.py), only uses
  public names, and is run by ``make examples``;
* every example runs (``-m slow``: about a minute each on 2 cores).
"""

import ast
import fnmatch
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api.rst"
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _public_modules():
    """``PUBLIC_MODULES`` of tests/test_docstrings.py, read without importing it."""
    tree = ast.parse((ROOT / "tests" / "test_docstrings.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "PUBLIC_MODULES" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_docstrings.py defines no PUBLIC_MODULES")


def _api_reference():
    """``(names, modules)``: the autosummary entries (fully qualified) and automodules."""
    names, modules = set(), set()
    current, in_summary = None, False
    for line in API.read_text().splitlines():
        stripped = line.strip()
        if m := re.match(r"\.\. currentmodule:: (\S+)", stripped):
            current, in_summary = m.group(1), False
        elif m := re.match(r"\.\. automodule:: (\S+)", stripped):
            modules.add(m.group(1))
            in_summary = False
        elif stripped.startswith(".. autosummary::"):
            in_summary = True
        elif in_summary:
            if line and not line[0].isspace():
                in_summary = False
            elif stripped and not stripped.startswith(":"):
                assert current is not None, f"autosummary entry {stripped!r} before currentmodule"
                names.add(f"{current}.{stripped}")
    return names, modules


def _toctrees(docname):
    """The ``(entries, glob)`` of each toctree of a page (docname relative to docs/).

    Entries are docnames relative to docs/; an entry ``Title <doc>`` counts as
    ``doc``. Markdown pages use ``{toctree}`` fences, reST pages ``.. toctree::``
    (autosummary's ``:toctree:`` option generates pages and is not a toctree here).
    """
    path = next((DOCS / f"{docname}{ext}" for ext in (".md", ".rst")
                 if (DOCS / f"{docname}{ext}").exists()), None)
    if path is None:
        return []
    text = path.read_text()
    if path.suffix == ".md":
        blocks = re.findall(r"```\{toctree\}[^\n]*\n(.*?)```", text, flags=re.S)
    else:
        blocks = re.findall(r"^\.\. toctree::[^\n]*\n((?:[ \t]+.*\n|[ \t]*\n)*)", text,
                            flags=re.M)
    base = str(Path(docname).parent)
    trees = []
    for block in blocks:
        lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
        options = {ln for ln in lines if ln.startswith(":")}
        entries = []
        for ln in lines:
            if ln.startswith(":"):
                continue
            m = re.fullmatch(r".*<([^<>]+)>", ln)
            target = m.group(1) if m else ln
            entries.append(target if base == "." else f"{base}/{target}")
        trees.append((entries, ":glob:" in options))
    return trees


def _toctree_graph():
    """``{page: [(entries, glob), ...]}`` for every page reached from docs/index.md."""
    graph, todo = {}, ["index"]
    while todo:
        page = todo.pop()
        if page in graph:
            continue
        graph[page] = _toctrees(page)
        for entries, glob in graph[page]:
            for e in entries:
                if glob and any(c in e for c in "*?["):
                    todo.extend(p for p in _pages() if fnmatch.fnmatch(p, e))
                elif not e.startswith("auto_examples/"):
                    todo.append(e)
    return graph


def _index_toctree():
    """The entries of the ``{toctree}`` block of docs/index.md and whether it globs."""
    trees = _toctrees("index")
    assert len(trees) == 1, "docs/index.md should have exactly one toctree"
    return trees[0]


def _pages():
    """Source pages of the site in docs/ (top level), as docnames."""
    return sorted(
        p.stem for p in DOCS.iterdir()
        if p.suffix in (".md", ".rst") and p.stem != "index" and p.name != "README.md"
        and not p.name.startswith("sg_execution_times")
    )


PUBLIC = [m for m in _public_modules() if importlib.util.find_spec(m) is not None]


@pytest.mark.parametrize("module_name", PUBLIC)
def test_every_public_name_is_in_the_api_reference(module_name):
    names, modules = _api_reference()
    module = importlib.import_module(module_name)
    assert module_name in modules, f"docs/api.rst has no '.. automodule:: {module_name}'"
    missing = []
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            if obj.__name__ not in modules:
                missing.append(f".. automodule:: {obj.__name__}")
        elif f"{module_name}.{name}" not in names:
            missing.append(f"{module_name}.{name}")
    assert not missing, f"add to docs/api.rst: {missing}"


def test_api_reference_names_exist():
    names, modules = _api_reference()
    assert names, "no autosummary entries found in docs/api.rst"
    for full in sorted(names):
        module_name, _, attr = full.rpartition(".")
        module = importlib.import_module(module_name)
        assert hasattr(module, attr), f"docs/api.rst lists {full}, which does not exist"
        assert attr in getattr(module, "__all__", ()), f"{full} is not in {module_name}.__all__"
    for module_name in modules:
        importlib.import_module(module_name)


def test_every_page_is_in_the_toctree():
    graph = _toctree_graph()
    reached, listed = set(graph), []
    for page, trees in graph.items():
        for entries, glob in trees:
            for entry in entries:
                if glob and any(c in entry for c in "*?["):
                    matches = [p for p in _pages() if fnmatch.fnmatch(p, entry)]
                    # Sphinx warns (an error with -W) on a glob that matches nothing.
                    assert matches, f"{page}: the toctree glob {entry!r} matches no page"
                    reached.update(matches)
                    continue
                listed.append(entry)
                if entry == "auto_examples/index":  # generated by sphinx-gallery
                    assert (ROOT / "examples" / "GALLERY_HEADER.rst").exists()
                    continue
                assert (DOCS / f"{entry}.md").exists() or (DOCS / f"{entry}.rst").exists(), (
                    f"the toctree of {page} names {entry!r}, which is not a page in docs/"
                )
    dupes = sorted({e for e in listed if listed.count(e) > 1})
    assert not dupes, f"pages listed in more than one toctree: {dupes}"
    orphans = [p for p in _pages() if p not in reached]
    assert not orphans, (
        f"pages reached from no toctree: {orphans}; add each to the toctree of its "
        "section (user-guide.md, choosing-a-method.md, benchmarks.md, contributing.md)"
    )


def test_top_bar_titles_are_short():
    """The root toctree is the top bar: one short title per section, no file paths."""
    text = (DOCS / "index.md").read_text()
    block = re.search(r"```\{toctree\}[^\n]*\n(.*?)```", text, flags=re.S).group(1)
    entries = [ln.strip() for ln in block.splitlines()
               if ln.strip() and not ln.strip().startswith(":")]
    assert 4 <= len(entries) <= 8
    for entry in entries:
        m = re.fullmatch(r"(.+?)\s*<([^<>]+)>", entry)
        assert m, f"give the top-bar entry {entry!r} a short explicit title: 'Title <page>'"
        assert len(m.group(1)) <= 20, f"top-bar title {m.group(1)!r} is too long"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # skip code blocks
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        if target.startswith("auto_examples/"):  # built by sphinx-gallery
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_have_a_gallery_title(example):
    doc = ast.get_docstring(ast.parse(example.read_text()), clean=False) or ""
    lines = doc.strip("\n").splitlines()
    assert len(lines) >= 2 and lines[0].strip(), f"{example.name}: no docstring title"
    underline = lines[1].strip()
    assert underline and set(underline) <= set("=-~^") and len(underline) >= len(
        lines[0].strip()
    ), (
        f"{example.name}: sphinx-gallery needs a reST title: the first docstring line "
        "underlined with '=' of at least its length"
    )


def _gallery_conf():
    """``sphinx_gallery_conf`` of docs/conf.py, read without running Sphinx."""
    tree = ast.parse((DOCS / "conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "sphinx_gallery_conf" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("docs/conf.py defines no sphinx_gallery_conf")


def test_every_example_is_in_the_gallery_and_executed():
    conf = _gallery_conf()
    dirs = conf["examples_dirs"]
    dirs = [dirs] if isinstance(dirs, str) else list(dirs)
    assert [(DOCS / d).resolve() for d in dirs] == [ROOT / "examples"]
    assert str(conf.get("plot_gallery", "True")) == "True", "the gallery must run the examples"
    assert EXAMPLES, "no examples found"
    for example in EXAMPLES:
        # sphinx-gallery executes a script when filename_pattern matches its full path
        # and builds no page for it when ignore_pattern matches its name.
        assert not re.search(conf.get("ignore_pattern", r"__init__\.py"), example.name), (
            f"{example.name} is left out of the gallery by ignore_pattern"
        )
        assert re.search(conf["filename_pattern"], str(example)), (
            f"{example.name} would be shown without being run (no image, no output): "
            "widen filename_pattern in docs/conf.py"
        )


def test_make_examples_runs_every_example():
    try:
        out = subprocess.run(["make", "-n", "-s", "examples"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("make is not installed")
    assert out.returncode == 0, out.stderr
    missing = [e.name for e in EXAMPLES if f"examples/{e.name}" not in out.stdout]
    assert not missing, f"`make examples` does not run {missing}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_compile_and_use_public_names(example):
    tree = ast.parse(example.read_text(), filename=str(example))
    compile(tree, str(example), "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sklearn_lla"):
            assert not any(part.startswith("_") for part in node.module.split(".")), (
                f"{example.name} imports from the private module {node.module}"
            )
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{example.name} imports private names {private}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sklearn_lla"):
                    assert not any(p.startswith("_") for p in alias.name.split(".")), (
                        f"{example.name} imports the private module {alias.name}"
                    )


#: Each example is written to run in under 60 s on 2 CPU cores (GALLERY_HEADER.rst);
#: the test allows three times that, for a loaded machine, to catch an example that
#: grew into minutes without failing on a busy one.
EXAMPLE_TIME_GUARD_S = 180


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example):
    env = dict(os.environ, MPLBACKEND="Agg")
    out_dir = ROOT / "examples" / "output"
    start = time.time()
    proc = subprocess.run([sys.executable, str(example)], cwd=example.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    elapsed = time.time() - start
    assert proc.returncode == 0, f"{example.name} failed:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{example.name} printed nothing"
    saved = [p for p in out_dir.glob(f"{example.stem}*.png") if p.stat().st_mtime >= start - 1]
    assert saved, f"{example.name} saved no figure examples/output/{example.stem}*.png"
    assert elapsed <= EXAMPLE_TIME_GUARD_S, (
        f"{example.name} took {elapsed:.0f} s; examples must run in under 60 s on 2 cores"
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_run_under_sphinx_gallery(example):
    """sphinx-gallery runs an example without ``__file__`` (by design: its issues 166,
    212), so a bare ``Path(__file__)`` fails the docs build after minutes. Use it only
    inside ``try: ... except NameError:`` (falling back to the working directory, which
    sphinx-gallery sets to ``examples/``)."""
    tree = ast.parse(example.read_text())
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            h.type is not None and "NameError" in ast.unparse(h.type) for h in node.handlers
        ):
            for stmt in node.body:
                guarded.update(id(n) for n in ast.walk(stmt))
    bare = [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id == "__file__" and id(n) not in guarded]
    assert not bare, (
        f"{example.name} uses __file__ outside try/except NameError (lines {bare}); "
        "sphinx-gallery does not define it: see examples/quickstart.py for the pattern"
    )


# ---------------------------------------------------------------------------------
# Numbers the docs cite for limits and defaults equal the code's constants
# ---------------------------------------------------------------------------------


def _cited_numbers(text, pattern):
    """Every number captured by ``pattern`` in ``text`` (``10,000``, ``10{,}000``)."""
    return [int(re.sub(r"[^0-9]", "", m)) for m in re.findall(pattern, text)]


#: (file, pattern capturing exact LLA's size limit, fewest citations expected).
_EXACT_LIMIT_CITATIONS = (
    ("README.md", r"min\(P, N x outputs\) <= ([0-9][0-9,]*)", 1),
    ("docs/choosing-a-method.md", r"\\min\(P, NC\) \\le ([0-9][0-9{},]*)", 2),
    ("docs/exact.md", r"above ([0-9][0-9,{}]*) the estimator", 1),
    ("docs/budgets.md", r"above its ([0-9][0-9,]*) limit", 1),
)


@pytest.mark.parametrize("path, pattern, at_least", _EXACT_LIMIT_CITATIONS,
                         ids=[c[0] for c in _EXACT_LIMIT_CITATIONS])
def test_docs_cite_the_exact_size_limit_of_the_code(path, pattern, at_least):
    from sklearn_lla._posteriors.exact import MAX_EXACT_DIM

    cited = _cited_numbers((ROOT / path).read_text(), pattern)
    assert len(cited) >= at_least, f"{path} no longer cites exact LLA's limit as expected"
    assert set(cited) == {MAX_EXACT_DIM}, (
        f"{path} cites exact LLA's size limit as {sorted(set(cited))}; the code's "
        f"MAX_EXACT_DIM is {MAX_EXACT_DIM}")


def test_no_page_cites_another_exact_limit():
    """Any ``min(P, NC) <= N`` anywhere in the docs is the code's limit."""
    from sklearn_lla._posteriors.exact import MAX_EXACT_DIM

    pattern = r"min\(P, ?(?:NC|N ?C|N x outputs)\) ?(?:<=|\\le) ?([0-9][0-9,{}]*)"
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for n in _cited_numbers(page.read_text(), pattern):
            assert n == MAX_EXACT_DIM, f"{page.name} cites min(P, NC) <= {n}"


def test_docs_cite_the_conformal_row_counts_of_the_code():
    """predict_interval / predict_set and docs/conformal.md say how many calibration
    rows each confidence needs (9 for 0.9, ...): conformal_rank's own answer."""
    from sklearn_lla._conformal import conformal_rank

    def needed(confidence):
        return next(n for n in range(1, 10_000) if _rank_ok(conformal_rank, n, confidence))

    text = (ROOT / "sklearn_lla" / "_conformal.py").read_text()
    cited = re.findall(r"\((\d+) rows for 0\.9, (\d+) for 0\.95, (\d+) for 0\.99\)", text)
    assert cited, "predict_interval's docstring no longer cites the row counts"
    for row in cited:
        assert tuple(int(v) for v in row) == (needed(0.9), needed(0.95), needed(0.99))


def _rank_ok(conformal_rank, n, confidence):
    try:
        conformal_rank(n, confidence)
    except ValueError:
        return False
    return True
