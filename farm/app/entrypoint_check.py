"""Before `farm submit` uploads anything: does the shipped module define the
factory the entrypoint names? Read with ``ast``, never imported (the CLI runs
no model code). A name it cannot be sure of (a star import, a module
``__getattr__``, a file it cannot parse) is left to the trace stage."""

from __future__ import annotations

import ast
import difflib
from pathlib import Path


def module_file(source: Path, module: str) -> Path | None:
    """The file of dotted ``module`` in what is shipped (a file, a package
    directory, or a directory of import roots)."""
    if source.is_file():
        return source if source.suffix == ".py" else None
    parts = module.split(".")
    for root in (source, source.parent):
        for candidate in (
            root.joinpath(*parts).with_suffix(".py"),
            root.joinpath(*parts, "__init__.py"),
        ):
            if candidate.is_file():
                return candidate
    return None


def top_level_names(tree: ast.Module) -> set[str] | None:
    """Names the module binds at its top level; None when it may bind more."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                return None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        else:
            # if/try/with blocks at top level: whatever they bind counts too.
            names.update(
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            )
            names.update(
                n.name
                for n in ast.walk(node)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            )
            for n in ast.walk(node):
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    names.update(a.asname or a.name.partition(".")[0] for a in n.names)
    return names


def missing_factory(source: Path | None, entrypoint: str, shown: str) -> str | None:
    """Why ``entrypoint`` (``module:attr``) cannot be found in ``source``, with
    a did-you-mean; None when it is there or when that cannot be told."""
    module, _, attr = entrypoint.partition(":")
    if source is None or not attr:
        return None
    path = module_file(source, module)
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    names = top_level_names(tree)
    first = attr.partition(".")[0]
    if names is None or first in names:
        return None
    callables = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    close = difflib.get_close_matches(first, callables or sorted(names), n=3)
    hint = (
        f"did you mean {' or '.join(repr(c) for c in close)}?"
        if close
        else f"its functions and classes: {', '.join(callables) or 'none'}"
    )
    return f"{shown}: {path.name} defines no {first!r} at its top level; {hint}"
