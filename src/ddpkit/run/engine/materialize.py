"""A model built without its weights (``with torch.device("meta"): net = Net()``) given them at
``run.setup``: from a file (``weights=``), or from each module's own initialization.

On the fsdp engine the model is sharded while still on meta, then ``to_empty`` gives each rank
storage for its shards alone; on the others each rank allocates the whole model, as a replica
must. The values then come module by module, in ``model.modules()`` order: a module's own
tensors are built in full on the CPU (one module at a time), filled, and copied into the rank's
storage (a sharded parameter keeps only its shard, cut by torch's ``distribute_tensor``). So no
rank holds more than its shards plus one module in full.

Each tensor's values come from, first to last: the value it had if it was not on meta (a buffer
built on a real device), the weights file, the module's ``reset_parameters()`` followed by the
user's ``init(module)``. Every rank draws the same numbers under the run's seed, on the CPU as
an eager ``Net()`` does, so the weights are the same on any number of processes; they equal the
eager ``Net()``'s under the same seed when its construction draws layer by layer in module order
(each layer's ``reset_parameters``) and nothing re-draws them afterwards (an ``init`` re-draw
comes in a different order than ``model.apply(init)`` after construction). A tensor that ends
with no value is one line naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.run.engine.models import key_mismatch

Init = Callable[[nn.Module], object]


def has_meta(model: nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is on the meta device (no storage)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check_meta_buffers(model: nn.Module) -> None:
    """Refuse a buffer built on meta that no state dict holds (``persistent=False``: a rotary
    table, a causal mask): neither a file nor an initialization gives it its values."""
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta and name in module._non_persistent_buffers_set:
                where = f"{prefix}.{name}" if prefix else name
                raise ConfigError(
                    f"buffer {where!r} of {type(model).__name__} was built on the meta device and is "
                    "not in any state dict (persistent=False), so ddpkit cannot give it its values; "
                    "build the model under ddpkit.empty_init(), which puts only parameters on meta"
                )


def real_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that have values (not on meta), by state-dict name, kept before ``to_empty``."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: t.data for name, t in named if not t.is_meta}


def materialize(
    model: nn.Module,
    device: torch.device,
    kept: dict[str, torch.Tensor],
    source: Mapping | None,
    init: Init | None,
    values: bool = True,
) -> None:
    """Give ``model`` (sharded or not) storage on ``device`` and fill it: ``kept`` values first,
    then ``source`` (a ``WeightsSource`` or a state dict; None: initialize). ``values=False``
    puts back ``kept`` alone: a checkpoint gives the rest next.

    Raises:
        ConfigError: the source lacks a tensor of the model, holds one it lacks or of another
            shape, or a tensor got no value from either.
    """
    model.to_empty(device=device)
    if source is not None:
        _check_keys(model, source)
    done: set[int] = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if values:
                _fill_module(model, prefix, module, kept, source, init, done)
            else:
                _put_back(prefix, module, kept)


def _put_back(prefix: str, module: nn.Module, kept: dict) -> None:
    for _, name, real in _own(module):
        key = f"{prefix}.{name}" if prefix else name
        if key in kept:
            _copy_into(real, kept[key].cpu())


class WeightsPlan:
    """Where a model's values come from at ``run.setup``, decided once, applied around the engine.

    Args:
        model: the user's model (some of it on meta, or none).
        device: this rank's device.
        cfg: the engine's config: on fsdp a meta model gets storage after ``fully_shard`` (in
            host memory with ``offload``).
        saved: the checkpoint's entry for this model when the run resumes, else None.
        weights: ``run.setup(weights=)``, ignored on a resume (the checkpoint's weights win).
        init: ``run.setup(init=)``.
    """

    def __init__(self, model, device, cfg, saved, weights, init: Init | None) -> None:
        from ddpkit.checkpoint.dcp import is_sharded_entry
        from ddpkit.run.engine.weights_source import WeightsSource

        self.device = torch.device("cpu") if cfg.offload else device
        self.init, self.saved = init, saved
        self.meta = has_meta(model)
        self.late = self.meta and cfg.engine == "fsdp"  # storage after sharding
        self.in_checkpoint = saved is not None and is_sharded_entry(saved)  # filled by load_model
        if saved is not None:
            self.source = None if self.in_checkpoint else saved
        else:
            self.source = WeightsSource(weights) if weights is not None else None
        if self.meta:
            check_meta_buffers(model)
            self.kept = real_tensors(model)

    def before_wrap(self, model: nn.Module, load_saved: Callable[[nn.Module], None]) -> None:
        """A replica's values, before the engine copies rank 0's (or a plain model's file)."""
        if self.meta and not self.late:
            resumed = self.saved is not None
            source = None if resumed else self.source
            materialize(model, self.device, self.kept, source, self.init, values=not resumed)
        elif not self.meta and self.saved is None and self.source is not None:
            _check_keys(model, self.source)
            with torch.no_grad():
                for key, t in model.state_dict(keep_vars=True).items():
                    if key in self.source:
                        t.copy_(self.source.get(key))
        if self.saved is not None and not self.late:
            load_saved(model)

    def after_wrap(self, model: nn.Module) -> None:
        """A meta model sharded: storage for this rank's shards, then its values."""
        if self.late:
            materialize(model, self.device, self.kept, self.source, self.init, values=not self.in_checkpoint)


def _own(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) of the tensors ``module`` holds itself."""
    params = [("param", n, p) for n, p in module._parameters.items() if p is not None]
    return params + [("buffer", n, b) for n, b in module._buffers.items() if b is not None]


def _fill_module(
    model: nn.Module,
    prefix: str,
    module: nn.Module,
    kept: dict,
    source: Mapping | None,
    init: Init | None,
    done: set[int],
) -> None:
    own = _own(module)
    key = {name: f"{prefix}.{name}" if prefix else name for _, name, _ in own}
    if source is not None:  # a sharded tensor the file holds: only this rank's part is read
        shares = {name: real for _, name, real in own if _is_share(real, key[name], kept, source)}
        for name, real in shares.items():
            if id(real) not in done:
                done.add(id(real))
                _copy_share(real, source, key[name])
        own = [entry for entry in own if entry[1] not in shares]
    if not own:
        return
    full = {name: _blank(t) for _, name, t in own}  # this module's tensors, in full, on the CPU
    given = {name for name in full if key[name] in kept or (source is not None and key[name] in source)}
    for name in given:
        value = kept[key[name]] if key[name] in kept else source.get(key[name])
        full[name].copy_(value.to(full[name].dtype))
    if source is None and len(given) < len(full):  # initialize: the module's own draws on the CPU
        _draw(module, own, full, init)
    for kind, name, real in own:
        if id(real) in done:  # tied: filled through its first owner
            continue
        done.add(id(real))
        if full[name].is_floating_point() and torch.isnan(full[name]).any():
            raise ConfigError(
                f"{kind} {key[name]!r} of {type(model).__name__} got no value: {type(module).__name__} has "
                "no reset_parameters() that sets it; pass run.setup(model, init=fn) with fn(module) "
                "setting it (as model.apply(fn) would), or weights=FILE"
            )
        _copy_into(real, full[name])


def _blank(t: torch.Tensor) -> torch.Tensor:
    """A full-size CPU tensor for ``t`` (a shard's whole), NaN where it can be: what nothing filled shows."""
    shape = t.shape  # a DTensor's shape is the full one
    blank = torch.empty(shape, dtype=t.dtype, device="cpu")
    return blank.fill_(math.nan) if blank.is_floating_point() else blank.zero_()


def _draw(module: nn.Module, own: list, full: dict, init: Init | None) -> None:
    """``reset_parameters()`` (or torch's ``_reset_parameters()``) and ``init(module)`` on the
    module holding its full CPU tensors in place of its own, which are then put back."""
    saved = {name: (kind, t) for kind, name, t in own}
    for kind, name, _ in own:
        if kind == "param":
            module._parameters[name] = nn.Parameter(full[name], requires_grad=saved[name][1].requires_grad)
        else:
            module._buffers[name] = full[name]
    try:
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if callable(reset):
            reset()
        if init is not None:
            init(module)
        for kind, name, _ in own:  # an init may assign a new tensor rather than fill in place
            now = module._parameters[name] if kind == "param" else module._buffers[name]
            if now is not full[name] and now is not None:
                full[name].copy_(now.detach())
    finally:
        for kind, name, _ in own:
            (module._parameters if kind == "param" else module._buffers)[name] = saved[name][1]


def _is_share(real: torch.Tensor, key: str, kept: dict, source: Mapping) -> bool:
    return getattr(real, "placements", None) is not None and key not in kept and key in source


def _copy_share(real: torch.Tensor, source: Mapping, key: str) -> None:
    """This rank's shard of a DTensor, read from ``source`` alone: the slices its placements give
    it (``Shard(0)`` on fsdp: its rows), never the whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(real.shape, real.device_mesh, real.placements)
    local = real.to_local()
    if local.numel():
        index = tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
        part = source.get_part(key, index) if hasattr(source, "get_part") else source[key][index]
        local.copy_(part)  # copy_ converts the dtype


def _copy_into(real: torch.Tensor, full: torch.Tensor) -> None:
    """``full`` into the rank's storage: the whole of a plain tensor, this rank's shard of a DTensor."""
    placements = getattr(real, "placements", None)
    if placements is None:
        real.copy_(full)
        return
    from torch.distributed.tensor import distribute_tensor  # only a sharded model has DTensors

    mesh = real.device_mesh
    shard = distribute_tensor(full.to(mesh.device_type), mesh, placements, src_data_rank=None)
    real.to_local().copy_(shard.to_local())


def _check_keys(model: nn.Module, source: Mapping) -> None:
    """One line when the file is another model's: keys missing (a tied alias may be), unknown, or
    of another shape."""
    if (mismatch := key_mismatch(model, source)) is not None:
        raise ConfigError(
            f"the weights do not fit {type(model).__name__} ({mismatch}); give the weights of this "
            "model, saved from model.state_dict()"
        )


class empty_init:  # noqa: N801 - used as ``with ddpkit.empty_init():``, like torch.device("meta")
    """``with ddpkit.empty_init(): net = Net()``: parameters end on the meta device, buffers stay
    on the CPU as usual, so a rotary table or a causal mask computed in ``__init__`` keeps its
    values; ``run.setup`` then gives the parameters theirs. Each parameter is made and moved as it
    is registered (one layer in memory at a time), and torch's CPU generator is put back on exit,
    so ``run.setup`` draws what an eager ``Net()`` would have."""

    def __init__(self) -> None:
        self._register, self._rng = nn.Module.register_parameter, None

    def __enter__(self) -> empty_init:
        self._register, self._rng = nn.Module.register_parameter, torch.get_rng_state()
        register = self._register

        def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            register(module, name, param)

        nn.Module.register_parameter = to_meta
        return self

    def __exit__(self, *exc: object) -> None:
        nn.Module.register_parameter = self._register
        torch.set_rng_state(self._rng)
