"""What DataLoader workers need from the machine that torch does not check before they start."""

from __future__ import annotations

import tempfile

import torch.multiprocessing

from ddpkit.errors import ConfigError

# A worker hands each batch over through a socket of Python's multiprocessing at
# TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (torch's default "file_descriptor" sharing), and an
# AF_UNIX path holds at most 107 characters on Linux.
SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
AF_UNIX_MAX = 107


def check_socket_dir(num_workers: int) -> None:
    """Refuse workers whose batches could never come back: with a TMPDIR longer than 75
    characters the worker's socket cannot bind, it dies in a feeder thread without a word, and
    the loop waits for its batch for ever."""
    if num_workers <= 0 or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    folder = tempfile.gettempdir()
    if len(folder) + SOCKET_SUFFIX > AF_UNIX_MAX:
        raise ConfigError(
            f"TMPDIR={folder!r} is {len(folder)} characters: DataLoader workers hand batches over "
            f"through a socket under it, whose path would pass AF_UNIX's {AF_UNIX_MAX} "
            f"(workers would hang); set TMPDIR to a folder of at most {AF_UNIX_MAX - SOCKET_SUFFIX} "
            "characters (/tmp), or num_workers=0"
        )
