"""A ``ddpkit train`` job's whole configuration: one section per component, written to OUT/config.json.

Each section is the frozen config of the component that reads it (``ddpkit.run.RunConfig``,
``DataConfig``, ``EngineConfig``, ``CheckpointConfig``, ``OptimConfig``, ``DiagnosticsConfig``,
and the Trainer's ``TrainConfig``). Field names are unique across sections, so a value is named
the same way everywhere: ``--global-batch`` on the command line, ``global_batch`` under
``[data]`` in ``--config run.toml``, ``"global_batch"`` in the ``"data"`` section of config.json.

Values are layered, later ones winning: each dataclass's default; what ``ddpkit train`` starts
with (``CLI_DEFAULTS``); the built-in workload's defaults; the TOML file; the flags.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.run.config import (
    CheckpointConfig,
    DataConfig,
    DiagnosticsConfig,
    EngineConfig,
    OptimConfig,
    RunConfig,
)
from ddpkit.train.config import TrainConfig

SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "data": DataConfig,
    "engine": EngineConfig,
    "checkpoint": CheckpointConfig,
    "optim": OptimConfig,
    "diagnostics": DiagnosticsConfig,
    "train": TrainConfig,
}
OWNER = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
if len(OWNER) != sum(len(fields(cls)) for cls in SECTIONS.values()):
    raise AssertionError("a field name appears in two config sections; flags and TOML keys would clash")

# Where the command differs from the library: a command line starts a new run unless told to
# continue (a script's ddpkit.Run resumes by itself, being re-run to continue).
CLI_DEFAULTS: dict[str, Any] = {"resume": "never"}

# What makes a run the run it is: resuming with any of these changed would continue another run.
# steps is among them: the default schedule decays over all of them, and a new total would make
# the learning rate jump (0.0010 to 0.0051 at step 100 of a 200-step toy run resumed for 400).
SAME_RUN = (
    "seed",
    "steps",
    "global_batch",
    "micro_batch",
    "drop_last",
    "shuffle",
    "precision",
    "grad_clip",
    "task",
    "data",
    "epochs",
    "lr",
    "warmup_steps",
    "weight_decay",
)


@dataclass(frozen=True)
class JobConfig:
    """Every component's config for one ``ddpkit train`` job."""

    run: RunConfig
    data: DataConfig
    engine: EngineConfig
    checkpoint: CheckpointConfig
    optim: OptimConfig
    diagnostics: DiagnosticsConfig
    train: TrainConfig

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> JobConfig:
        """Build every section from flat field values; fields left out take their defaults."""
        unknown = sorted(set(values) - set(OWNER))
        if unknown:
            raise ConfigError(f"unknown settings {unknown}; known ones are {sorted(OWNER)}")
        return cls(
            **{
                section: kind(**{k: v for k, v in values.items() if OWNER[k] == section})
                for section, kind in SECTIONS.items()
            }
        )

    def values(self) -> dict[str, Any]:
        """Flat field values of every section."""
        return {k: v for section in SECTIONS for k, v in dataclasses.asdict(getattr(self, section)).items()}

    def replace(self, **changes: Any) -> JobConfig:
        return JobConfig.from_values({**self.values(), **changes})

    def run_options(self) -> dict[str, Any]:
        """The keyword arguments of ``ddpkit.Run`` for this job: every section but the Trainer's."""
        return {k: v for k, v in self.values().items() if OWNER[k] != "train"}

    def to_json(self) -> str:
        sections = {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}
        return json.dumps(sections, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "config.json") -> JobConfig:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) - set(SECTIONS):
            raise ConfigError(
                f"{where} is not a ddpkit train config (sections {sorted(SECTIONS)}); it may come "
                "from an older ddpkit: start the run in a new --out"
            )
        flat: dict[str, Any] = {}
        for section, values in raw.items():
            misplaced = sorted(k for k in values if OWNER.get(k) != section)
            if misplaced:
                raise ConfigError(f"{where}: unknown keys {misplaced} in section {section!r}")
            flat.update(values)
        return cls.from_values(flat)


def layered(task: str, workload_defaults: dict[str, Any], *layers: dict[str, Any]) -> JobConfig:
    """The job's config: dataclass defaults < CLI_DEFAULTS < the workload's < each layer in order."""
    values: dict[str, Any] = {**CLI_DEFAULTS, **workload_defaults, "task": task}
    for layer in layers:
        values.update(layer)
    given = {name for layer in layers for name in layer}
    if "epochs" in given and "steps" not in given:  # asked for epochs: the workload's steps yield
        values["steps"] = None
    if values.get("out") is None:
        values["out"] = f"runs/{task_name(values['task'])}"
    return JobConfig.from_values(values)


def task_name(task: str) -> str:
    """A short name for a task: the workload, the file's stem, or the module's last part."""
    stem = task.rsplit("/", 1)[-1].removesuffix(".py")
    return stem.split(":")[0].rsplit(".", 1)[-1]


def check_same_run(saved: JobConfig, current: JobConfig, out: str) -> None:
    """Refuse to continue a run under settings that would make it another run."""
    before, now = saved.values(), current.values()
    for name in SAME_RUN:
        if _settled(name, before[name]) != _settled(name, now[name]):
            raise ConfigError(
                f"--resume: the run in {out!r} has {name}={before[name]!r} but this command gives "
                f"{now[name]!r}; {as_flag(name, before[name])} to continue it, or use --overwrite "
                "or another --out for a new run"
            )


# None for these means "the DataLoader's", and a workload hands run.loader a dataset, not a
# DataLoader: None is then what runs of older versions saved as the value.
_NONE_MEANS = {"drop_last": False, "shuffle": True}


def _settled(name: str, value: Any) -> Any:
    return _NONE_MEANS.get(name, value) if value is None else value


def as_flag(name: str, value: Any) -> str:
    """How to give ``name`` the value ``value`` on the command line, in words."""
    flag = "--" + name.replace("_", "-")
    if value is None:
        return f"leave {flag} out"
    if isinstance(value, bool):
        return f"pass {flag}" if value else f"pass --no-{flag[2:]}"
    return f"pass {flag} {value}"
