"""The days of the course, in one registry: `DAYS[name]` is a `DaySpec` (torchtitan's train-spec idea).

Everything that needs the list of days reads it here: `dlo.config` (a day's presets, its own
parameters and preflight checks, for `dlo.setup` and `dlo run` alike), `dlo plan` and `dlo doctor` (its
planner: `plan_day`, `plan_main`), `dlo.checks` (its checks module), the tests, and the harness
(`dlo release`, `check`, `run`, `grade`: `names`, checked against the folders on disk by `dlo.harness.days`).
A course of one's own (the harness tests' toy course) names its days in $DLO_DAYS instead: days with a
notebook and no spec, run and graded like the others (no presets, planner or preflight).

A spec names its modules (experiments, planner, checks, preflight) as strings, imported when first
used: the registry sits on a low floor (`dlo.config` reads it for every notebook) and the day modules
are heavy. The arrows go one way: those modules import `dlo.plan` (the planners' building blocks) and
never this registry, so there is no cycle, visible or by string.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from dlo import presets as P

# What every day's parameters cell declares (papermill's flat scalars), resolved by `dlo.config.resolve`;
# here, beside the days' own ones (`DaySpec.parameters`), so that `dlo release` reads it without torch.
# CPU seconds to grade a day nobody estimated (a course of one's own): only the order of the estimates matters
UNKNOWN_GRADE_CPU_S = 30.0

PARAMETERS = ("profile", "device", "seed", "max_steps", "world_size", "data_dir", "log_dir")


@dataclass(frozen=True)
class DaySpec:
    """One day: its folder and notebook name (`solutions/<name>/<name>.ipynb`), its presets (one per
    profile, instances of `preset_class`) and the modules that serve it (`module` or `module:function`)."""

    name: str                      # "day5_fsdp": the folder, the notebook and `dlo.setup`'s first argument
    number: int                    # 5: the modules below are named after it (`dlo.experiments.day5`)
    preset_class: type
    presets: dict[str, Any]        # profile ("tiny", "full") -> preset
    experiments: str               # what the notebook runs: `dlo.experiments.dayN`
    planner: str                   # `plan(preset, *, gpus, gpu_mem_gb) -> rows` of `dlo plan` (`dlo.plan`)
    checks: str                    # the autograder's checks its test cells call: `dlo.checks.dayN`
    preflight: str = ""            # `preflight(run)`: ValueError (one line) before any work; "" for none
    parameters: tuple[str, ...] = field(default=())  # the day's own parameters-cell names, beside the common ones
    data: tuple[str, ...] = field(default=())  # what it reads from data_dir (`dlo.data.layout.KINDS`), checked by
                                               # `dlo.data.check` (`dlo.config.resolve`, `dlo data check`)
    # CPU seconds to grade its solution at the tiny profile (cells up to the last graded one), the process
    # tree of a `dlo grade --jobs 1` of that day alone on 2 idle cores (2026-11-29 20:10, /proc sampled every
    # 0.2 s); `dlo grade` and `dlo run --jobs` start the longest first (`dlo.harness.schedule`): only the order
    # matters
    grade_cpu_s: float = UNKNOWN_GRADE_CPU_S
    # wall seconds to run its whole solution notebook at the tiny profile, two notebooks at a time on 2 idle
    # cores (`make run`, 2026-11-29 19:56); `dlo run --jobs` starts the longest first, so the longest runs beside
    # the others instead of alone at the end with half the cores idle: only the order matters
    run_s: float = 0.0

    @property
    def short(self) -> str:
        """"day5": the name of the day's modules."""
        return f"day{self.number}"

    def load(self, target: str):
        """The module, or `module:function`, that `target` names (one of this spec's fields)."""
        module, _, name = target.partition(":")
        try:
            loaded = importlib.import_module(module)
            return getattr(loaded, name) if name else loaded
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"{self.name}: {target} cannot be loaded: {exc}") from None


def _day(number: int, name: str, preset_class: type, presets: dict, experiments: str = "", planner: str = "",
         **more) -> DaySpec:
    short = f"day{number}"
    return DaySpec(name=name, number=number, preset_class=preset_class, presets=presets,
                   experiments=experiments or f"dlo.experiments.{short}",
                   planner=planner or f"dlo.experiments.{short}:plan", checks=f"dlo.checks.{short}", **more)


DAYS: dict[str, DaySpec] = {d.name: d for d in (
    _day(1, "day1_optimizers", P.Day1Preset, P.DAY1, data=("cifar10",), grade_cpu_s=21.6, run_s=70.2),
    _day(2, "day2_mixed_precision", P.Day2Preset, P.DAY2, data=("cifar10",), grade_cpu_s=20.4, run_s=36.7),
    _day(3, "day3_checkpointing", P.Day3Preset, P.DAY3, grade_cpu_s=21.2, run_s=28.4),
    _day(4, "day4_ddp", P.Day4Preset, P.DAY4, grade_cpu_s=22.8, run_s=42.3),
    _day(5, "day5_fsdp", P.Day5Preset, P.DAY5, planner="dlo.experiments.day5_report:plan",
         preflight="dlo.experiments.day5_report:preflight", parameters=("weights_dir",), data=("tokens",),
         grade_cpu_s=27.7, run_s=32.6),
    _day(6, "day6_pipeline", P.Day6Preset, P.DAY6, planner="dlo.experiments.day6_report:plan", grade_cpu_s=34.9,
         run_s=36.8),
    _day(7, "day7_tensor_parallel", P.Day7Preset, P.DAY7, planner="dlo.experiments.day7_report:plan",
         grade_cpu_s=24.9, run_s=26.3),
    _day(8, "day8_quantization_pruning", P.Day8Preset, P.DAY8, preflight="dlo.experiments.day8_smooth:preflight",
         parameters=("weights_dir",), data=("cifar10",), grade_cpu_s=25.9, run_s=59.5),
    _day(9, "day9_inference", P.Day9Preset, P.DAY9, grade_cpu_s=33.2, run_s=17.5),
    _day(10, "day10_context_experts", P.Day10Preset, P.DAY10, grade_cpu_s=29.5, run_s=17.6),
    _day(11, "day11_learning_faster", P.Day11Preset, P.DAY11, data=("cifar10",), grade_cpu_s=21.4, run_s=46.9),
)}


def names() -> list[str]:
    """The days' names, in order: DAYS's, or those $DLO_DAYS lists (space-separated, when set) for a
    course of one's own."""
    own = os.environ.get("DLO_DAYS")
    return own.split() if own is not None else list(DAYS)


def plan_day(day: str, gpus: int | None = None, gpu_mem_gb: float = 80.0) -> list[dict]:
    """The rows of `day`'s planner for its `full` preset on `gpus` GPUs (None: the preset's ranks, 1 on
    single-process days) of `gpu_mem_gb` GB each. ValueError (one line) for an unknown day or a bad
    number, and from a planner whose work cannot be split over `gpus` ranks (`dlo.plan.split_evenly`)."""
    if day not in DAYS:
        # in the registry's order (by number): sorted names would put day10 before day1
        raise ValueError(f"no planner for {day!r}; days with one: {', '.join(DAYS) or '(none)'}")
    if (gpus is not None and gpus < 1) or gpu_mem_gb <= 0:
        raise ValueError(f"need gpus >= 1 and gpu_mem_gb > 0, got gpus={gpus}, gpu_mem_gb={gpu_mem_gb}")
    day_spec = DAYS[day]
    preset = day_spec.presets["full"]
    return day_spec.load(day_spec.planner)(preset, gpus=gpus or int(getattr(preset, "world_size", 1)),
                                           gpu_mem_gb=gpu_mem_gb)


def plan_main(day: str, gpus: int | None = None, gpu_mem_gb: float = 80.0) -> int:
    """`dlo plan DAY`: print the rows; exit 1 when a main configuration does not fit; BadInput (exit 2)
    for an unknown day or a bad number."""
    from dlo.errors import BadInput
    from dlo.plan import DoesNotFit, check_fits, format_rows, main_configs

    try:
        rows = plan_day(day, gpus, gpu_mem_gb)
    except ValueError as exc:  # an unknown day or a bad number: one line, no traceback
        raise BadInput(str(exc)) from None
    print(f"{day}, full profile: bytes per rank on GPUs of {gpu_mem_gb:g} GiB")
    print(format_rows(rows))
    try:
        check_fits(rows, main_configs(rows))
    except DoesNotFit as exc:
        raise SystemExit(f"does not fit: {exc}") from None
    return 0
