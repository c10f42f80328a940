"""What rank 0 says once when a loop does something that one device would do differently.

Each is a warning, not an error: the loop may mean it. The step cycle decides when, and that it
is said once per run.
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)


def own_counter(step: int, resumed_at: int) -> None:
    """A resumed run left the loader before the epoch's end: its own step counter started at 0."""
    log.warning(
        "the loop left run.loader's loop at step %d, before the epoch's end, in a run resumed at "
        "step %d: a loop that counts its own steps (if i == budget: break) counted from 0 again; "
        "use ddpkit.Run(steps=N), compare with run.step, or track the counter (run.track(loop=state))",
        step,
        resumed_at,
    )


def stale_weights(step: int) -> None:
    """A backward after a deferred optimizer step in the same micro-batch (a GAN's generator pass)."""
    log.warning(
        "step %d: run.backward after optimizer.step() in the same micro-batch: under micro_batch "
        "that step waits for the step's last micro-batch, so this loss saw the weights before it, "
        "where one device would use the stepped ones (a GAN's generator pass through the "
        "discriminator it just stepped); train the models on alternate steps (examples/gan.py) "
        "or leave micro_batch unset",
        step,
    )


# A group's parameters are no setting; its initial_lr is read as its lr (``_as_set``).
_NOT_SETTINGS = {"params", "param_names", "initial_lr"}
# The hyper-parameters each tracked optimizer and scheduler had when the script tracked it, by
# object (no attribute on the user's): a checkpoint keeps them, and a resumed run compares them
# with what the script sets now. Values set later (an lr set by hand each step) do not count.
_AT_TRACK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_settings(obj: object) -> None:
    """``run.track``: the hyper-parameters of an optimizer or LR scheduler as the script set them."""
    if isinstance(obj, torch.optim.Optimizer):
        _AT_TRACK[obj] = [
            {k: v for k, v in group.items() if k != "params" and (v is None or _plain(v))}
            for group in obj.param_groups
        ]
    elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        _AT_TRACK[obj] = {
            k: v
            for k, v in vars(obj).items()
            if not k.startswith("_") and k not in ("last_epoch", "base_lrs") and _plain(v)
        }  # base_lrs: each group's initial_lr again


def _plain(value: object) -> bool:
    """A number, a string, or a list or tuple of them: a setting a checkpoint can hold (not
    LambdaLR's functions)."""
    if isinstance(value, list | tuple):
        return all(isinstance(v, int | float | str) for v in value)
    return isinstance(value, int | float | str)


def _functions(value: object) -> bool:
    """A function, or a list of them (LambdaLR's ``lr_lambdas``): a setting that cannot be compared."""
    if isinstance(value, list | tuple):
        return bool(value) and all(callable(v) for v in value)
    return callable(value)


def settings(objects: dict) -> dict:
    """What a checkpoint keeps: each tracked object's hyper-parameters as the script set them."""
    return {name: _AT_TRACK[obj] for name, obj in objects.items() if obj in _AT_TRACK}


def _as_set(group: dict) -> dict:
    """A param group's settings as the script set them. Once a scheduler is built its lr is the
    schedule's first rate (a warm-up's 0 for every lr), and torch's LRScheduler has kept the
    script's in ``initial_lr``: that one is the group's lr here."""
    found = {k: v for k, v in group.items() if k not in _NOT_SETTINGS}
    if "initial_lr" in group:
        found["lr"] = group["initial_lr"]
    return found


def compare_settings(objects: dict, saved: dict) -> list[str]:
    """Each hyper-parameter the script sets otherwise than the run that wrote the checkpoint
    (``"optimizer: lr (group 0): 0.05 here, 0.1 saved"``); the resumed run keeps the saved ones."""
    found = []
    for name, theirs in saved.items():
        obj = objects.get(name)
        if obj is None or obj not in _AT_TRACK:
            continue
        mine = _AT_TRACK[obj]
        if isinstance(mine, list):
            pairs = [(_as_set(a), _as_set(b)) for a, b in zip(mine, theirs, strict=False)]
        else:
            pairs = [(mine, theirs)]
        for i, (a, b) in enumerate(pairs):
            where = f" (group {i})" if isinstance(mine, list) and len(mine) > 1 else ""
            found += [
                f"{name}: {k}{where} {_show(a[k])} here, {_show(b[k])} saved"
                for k in sorted(a.keys() & b.keys())
                if a[k] != b[k]
            ]
        _AT_TRACK[obj] = theirs  # the run trains on with the checkpoint's, and saves those again
    return found


def not_compared(objects: dict) -> list[str]:
    """The settings a scheduler holds as functions (LambdaLR's lr_lambdas: a warm-up's length, the
    total steps), which a checkpoint cannot compare: the script's own apply on resume."""
    return [
        f"{name}'s {k}"
        for name, obj in objects.items()
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)
        for k, v in vars(obj).items()
        if not k.startswith("_") and _functions(v)
    ]


def _show(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def resumed_with_other_settings(changes: list[str], unseen: list[str]) -> None:
    """One line: the script sets hyper-parameters the checkpoint holds otherwise (``unseen``: what
    could not be compared, the script's own applying)."""
    log.warning(
        "the script sets %s; the run trains on with the checkpoint's values, for an exact resume "
        "(to change one mid-run on purpose, set it after the first batch: docs/porting.md)%s",
        "; ".join(changes),
        f"; not compared, the script's own apply: {', '.join(unseen)} (functions)" if unseen else "",
    )
