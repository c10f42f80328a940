"""``install_excepthook``: what makes an uncaught ConfigError one line where ddpkit starts a run."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from ddpkit.errors import ConfigError
from ddpkit.launch.uncaught import install_excepthook

install_excepthook()
hook = sys.excepthook
install_excepthook()
assert sys.excepthook is hook, "a second install_excepthook replaced the first"
raise ConfigError("global_batch=10 cannot be split evenly across 3 processes")
"""


def test_an_installed_hook_makes_a_config_error_one_line_and_exit_code_2():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (
        2,
        "ddpkit: error: global_batch=10 cannot be split evenly across 3 processes\n",
    ), done.stderr[-3000:]
