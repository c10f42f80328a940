"""One owner per piece of state (STYLE.md): the step state has one writer, and no ``ddpkit_*``
attribute carries state from one module to another.

Read from the source with ``ast``, as tests/test_layers.py reads the import graph: an attribute
is set by ``x.name = ...``, ``setattr(x, "name", ...)`` or ``x.__dict__["name"] = ...``, and read
by ``x.name``, ``getattr``/``hasattr(x, "name")`` or ``x.__dict__["name"]``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator

from test_layers import Module, fake, read_modules

from ddpkit.run.step_state import StepState

OURS = re.compile(r"^_?ddpkit_\w+$")  # the attributes ddpkit sets on objects that are not its own
STEP_STATE_WRITERS = {"run/step/cycle.py"}  # StepCycle


def attribute_uses(module: Module) -> Iterator[tuple[str, str, int]]:
    """(name, "set" or "read", line) for every attribute the module sets or reads, by any spelling."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute):
            yield node.attr, "set" if isinstance(node.ctx, ast.Store | ast.Del) else "read", node.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            name = node.args[1]
            if node.func.id in ("setattr", "getattr", "hasattr") and isinstance(name, ast.Constant):
                yield str(name.value), "set" if node.func.id == "setattr" else "read", node.lineno
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "__dict__" and isinstance(node.slice, ast.Constant):
                kind = "set" if isinstance(node.ctx, ast.Store) else "read"
                yield str(node.slice.value), kind, node.lineno


def crossings(modules: dict[str, Module]) -> list[str]:
    """``ddpkit_*`` attributes read in a module that is not one of those that set them."""
    setters: dict[str, set[str]] = {}
    readers: dict[str, list[tuple[str, int]]] = {}
    for module in modules.values():
        for name, kind, line in attribute_uses(module):
            if OURS.match(name):
                if kind == "set":
                    setters.setdefault(name, set()).add(module.where)
                else:
                    readers.setdefault(name, []).append((module.where, line))
    return [
        f"{where}:{line} reads {name}, set in {', '.join(sorted(setters[name]))}"
        for name, uses in readers.items()
        if name in setters
        for where, line in uses
        if where not in setters[name]
    ]


def step_state_writes(modules: dict[str, Module]) -> list[str]:
    """Assignments to a step state's field (``<...>state.<field> = ...``) outside its writer."""
    fields = {f.name for f in dataclasses.fields(StepState)}
    found = []
    for module in modules.values():
        if module.where in STEP_STATE_WRITERS:
            continue
        for node in ast.walk(module.tree):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if not (stored and node.attr in fields):
                continue
            base = node.value
            name = getattr(base, "id", None) or getattr(base, "attr", "")  # state.x, gate.state.x
            if name in ("state", "_run_state", "_steps") or name.endswith("step_state"):
                found.append(f"{module.where}:{node.lineno} sets {ast.unparse(node)}")
    return found


def test_no_ddpkit_attribute_carries_state_between_modules():
    found = crossings(read_modules())
    assert not found, "attributes set in one module and read in another:\n  " + "\n  ".join(found)


def test_only_the_step_cycle_writes_the_step_state():
    found = step_state_writes(read_modules())
    assert not found, "the step state is written by StepCycle alone:\n  " + "\n  ".join(found)


def test_the_checks_see_every_spelling():
    setter = fake("ddpkit.a", "def f(m):\n    m.__dict__['ddpkit_step'] = 1\n    setattr(m, 'ddpkit_x', 2)\n")
    reader = fake("ddpkit.b", "def g(m):\n    return m.ddpkit_step, getattr(m, 'ddpkit_x', None)\n")
    owner = fake("ddpkit.c", "def h(m):\n    m.ddpkit_y = 1\n    return m.ddpkit_y\n")
    found = crossings({m.name: m for m in (setter, reader, owner)})
    assert [line.split(" reads ")[1].split(",")[0] for line in found] == ["ddpkit_step", "ddpkit_x"]
    writer = fake("ddpkit.d", "def k(gate):\n    gate.state.accumulating = True\n    gate.step = 1\n")
    assert [line.split(" sets ")[1] for line in step_state_writes({"ddpkit.d": writer})] == [
        "gate.state.accumulating"
    ]
