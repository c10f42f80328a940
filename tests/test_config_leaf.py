"""config.py is a leaf in fact: ``ddpkit train`` and the CLI's flags read the configs without the
runtime, so config.py and engine/config.py import only leaf modules (the standard library and
modules that import only leaves), read from the source as tests/test_layers.py reads it, and
checked by importing them."""

from __future__ import annotations

import ast
import subprocess
import sys

from test_layers import SRC, Module, fake, imported_from, known_module, ours, read_modules

# config.py and engine/config.py are read by ``ddpkit train`` and the CLI's flags without the
# runtime: they may import leaves only.
CONFIG_MODULES = ("ddpkit.run.config", "ddpkit.run.engine.config")


def module_level_imports(module: Module, modules: dict[str, Module]) -> set[str]:
    """What importing ``module`` runs: its imports outside functions and outside ``if TYPE_CHECKING:``.

    A ddpkit module comes with the packages above it (their ``__init__`` runs too), less those above
    ``module`` itself (they ran before it); any other import is named by its top-level package.
    """
    found: set[str] = set()
    statements = list(module.tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            statements.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            statements.extend(node.body + node.orelse + node.finalbody)
            statements.extend(s for handler in node.handlers for s in handler.body)
        elif isinstance(node, ast.Import):
            found.update(import_target(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and ours(source := imported_from(module, node)):
            for alias in node.names:
                target = f"{source}.{alias.name}"
                found.add(target if target in modules else known_module(source, modules))
        elif isinstance(node, ast.ImportFrom):
            found.add(import_target(source, modules))
    packages = {p for name in found if ours(name) for p in ancestors(name)}
    return (found | packages) - ancestors(module.name) - {module.name}


def import_target(name: str, modules: dict[str, Module]) -> str:
    return known_module(name, modules) if ours(name) else name.partition(".")[0]


def ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def leaves(modules: dict[str, Module]) -> set[str]:
    """The leaf modules: those whose import runs only the standard library and other leaves.

    So a module that imports only the standard library is a leaf (``ddpkit.errors``), a module
    that imports only those and the standard library is one, and so on. A module that imports
    torch (or any other installed package) is not, nor is one in an import cycle.
    """
    runs = {
        name: module_level_imports(module, modules) - set(sys.stdlib_module_names)
        for name, module in modules.items()
    }
    found: set[str] = set()
    while more := {name for name, imports in runs.items() if name not in found and imports <= found}:
        found |= more
    return found


def test_config_imports_only_leaves():
    modules = read_modules()
    leaf = leaves(modules)
    found = [
        f"{name} imports {other}, which is not a leaf"
        for name in CONFIG_MODULES
        for other in sorted(
            module_level_imports(modules[name], modules) - leaf - set(sys.stdlib_module_names)
        )
    ]
    assert not found, "config must import leaves only:\n  " + "\n  ".join(found)


def test_config_loads_no_runtime():
    """In fact: with the packages above config stood in by empty ones (``ddpkit/__init__`` loads the
    front door), importing the configs loads leaves and neither torch nor the engine."""
    probe = (
        "import sys, types\n"
        f"for name in ('ddpkit', 'ddpkit.run'):\n"
        "    package = sys.modules[name] = types.ModuleType(name)\n"
        f"    package.__path__ = [{str(SRC)!r} + '/' + name.replace('.', '/')]\n"
        f"for name in {CONFIG_MODULES!r}:\n"
        "    __import__(name)\n"
        "print(' '.join(sorted(m for m in sys.modules if m == 'torch' or m.startswith('ddpkit.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(done.stdout.split()) - {"ddpkit.run", *CONFIG_MODULES}
    assert loaded <= leaves(read_modules()), (
        f"importing config loads {sorted(loaded - leaves(read_modules()))}"
    )


def test_a_leaf_imports_only_leaves():
    modules = {
        m.name: m
        for m in [
            fake("ddpkit", "from ddpkit.heavy import x\n", is_package=True),
            fake("ddpkit.base", "import os.path\nfrom collections import abc\n"),
            fake("ddpkit.tensors", "import torch\n"),
            fake("ddpkit.mid", "from ddpkit.base import y\ndef f():\n    from ddpkit import heavy\n"),
            fake("ddpkit.heavy", "import ddpkit.pkg.inner\n"),
            fake("ddpkit.pkg", "from ddpkit.heavy import x\n", is_package=True),
            fake("ddpkit.pkg.inner", "from . import sibling\n"),
            fake(
                "ddpkit.pkg.sibling",
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ddpkit.heavy\n",
            ),
        ]
    }
    assert module_level_imports(modules["ddpkit.heavy"], modules) == {"ddpkit.pkg", "ddpkit.pkg.inner"}
    assert module_level_imports(modules["ddpkit.base"], modules) == {"os", "collections"}
    assert leaves(modules) == {"ddpkit.base", "ddpkit.mid", "ddpkit.pkg.inner", "ddpkit.pkg.sibling"}
