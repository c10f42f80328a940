"""Layering: the launchers read the hang monitor's pieces from diagnostics/, never the watchdog."""

from __future__ import annotations

import subprocess
import sys

# ddpkit's own __init__ imports Run, which uses the watchdog; a bare package object in its place
# shows what ddpkit.launch itself pulls in.
PROBE = """
import importlib.util, sys, types
bare = types.ModuleType("ddpkit")
bare.__path__ = list(importlib.util.find_spec("ddpkit").submodule_search_locations)
sys.modules["ddpkit"] = bare
import ddpkit.launch, ddpkit.launch.elastic
print(sorted(m for m in sys.modules if m.startswith("ddpkit.")))
"""


def test_the_launchers_do_not_load_the_watchdog():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = eval(done.stdout)  # the list printed above
    assert "ddpkit.diagnostics.hang.monitor" in loaded and "ddpkit.diagnostics.hang.report" in loaded, loaded
    assert "ddpkit.diagnostics.hang.watchdog" not in loaded, loaded
