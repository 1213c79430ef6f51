"""A search space written as a config: each hyperparameter's distribution, read from JSON or YAML.

    {"lr": {"log_uniform": [1e-4, 1e-1]}, "momentum": {"uniform": [0.8, 0.99]},
     "width": {"choice": [16, 32, 64]}, "layers": {"int": [1, 4]}}

Every search draws from the same `Space`: grid points, random samples (Bergstra & Bengio 2012: random
search spends its budget on more distinct values of the hyperparameters that matter), the unit cube a
Gaussian process models, and the perturbations of population-based training. A trial's config i is drawn
from (seed, i) alone, so a resumed search proposes the same configs in the same order.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlo.errors import BadInput

KINDS = ("choice", "uniform", "log_uniform", "int")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str            # one of KINDS
    values: tuple        # choice: the values; the others: (low, high)

    def to_unit(self, value) -> float:
        """Where `value` sits in [0, 1] (log scale for log_uniform, the index for a choice)."""
        if self.kind == "choice":
            return self.values.index(value) / max(len(self.values) - 1, 1)
        low, high = self.values
        if self.kind == "log_uniform":
            return (math.log(value) - math.log(low)) / (math.log(high) - math.log(low))
        return (value - low) / (high - low)

    def from_unit(self, u: float):
        u = min(max(float(u), 0.0), 1.0)
        if self.kind == "choice":
            return self.values[round(u * (len(self.values) - 1))]
        low, high = self.values
        if self.kind == "log_uniform":
            return float(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))
        if self.kind == "int":
            return int(round(low + u * (high - low)))
        return float(low + u * (high - low))

    def grid(self, points: int) -> list:
        if self.kind == "choice":
            return list(self.values)
        if self.kind == "int":
            low, high = self.values
            return sorted({self.from_unit(u) for u in np.linspace(0, 1, min(points, high - low + 1))})
        return [self.from_unit(u) for u in np.linspace(0, 1, points)]


def _draw(p: Param, rng: np.random.Generator):
    if p.kind == "choice":
        return p.values[rng.integers(len(p.values))]
    if p.kind == "int":   # every integer equally likely (rounding a uniform draw would halve the two ends)
        return int(rng.integers(p.values[0], p.values[1] + 1))
    return p.from_unit(rng.random())


def _param(name: str, spec) -> Param:
    where = f"search space: {name!r}"
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise BadInput(f"{where} must be one of {{kind: values}} with kind in {', '.join(KINDS)}; got {spec!r}")
    kind, values = next(iter(spec.items()))
    if not isinstance(values, (list, tuple)) or not values:
        raise BadInput(f"{where}: {kind} needs a non-empty list, got {values!r}")
    if kind == "choice":
        return Param(name, kind, tuple(values))
    if len(values) != 2 or not all(isinstance(v, (int, float)) for v in values) or not values[0] < values[1]:
        raise BadInput(f"{where}: {kind} needs [low, high] numbers with low < high, got {values!r}")
    if kind == "log_uniform" and values[0] <= 0:
        raise BadInput(f"{where}: log_uniform needs low > 0, got {values[0]} (use uniform for ranges through 0)")
    if kind == "int" and not all(isinstance(v, int) for v in values):
        raise BadInput(f"{where}: int needs integer bounds, got {values!r}")
    return Param(name, kind, tuple(values))


class Space:
    """The hyperparameters of a search, in the order written."""

    def __init__(self, spec: dict):
        if not isinstance(spec, dict) or not spec:
            raise BadInput(f"search space: expected a non-empty mapping of name -> {{kind: values}}, got {spec!r}")
        self.spec = spec
        self.params = [_param(name, s) for name, s in spec.items()]

    @classmethod
    def load(cls, path) -> Space:
        return cls(read_config(path))

    def sample(self, rng: np.random.Generator) -> dict:
        return {p.name: _draw(p, rng) for p in self.params}

    def config(self, seed: int, index: int) -> dict:
        """Trial `index`'s random config: drawn from (seed, index) only, whatever ran before."""
        return self.sample(np.random.default_rng([seed, index]))

    def grid(self, points: int = 3) -> list[dict]:
        """Every combination: a choice's values, `points` evenly spaced values of each range."""
        axes = [p.grid(points) for p in self.params]
        return [dict(zip([p.name for p in self.params], combo)) for combo in itertools.product(*axes)]

    def to_unit(self, config: dict) -> np.ndarray:
        return np.array([p.to_unit(config[p.name]) for p in self.params])

    def from_unit(self, u) -> dict:
        return {p.name: p.from_unit(x) for p, x in zip(self.params, u)}

    def perturb(self, config: dict, rng: np.random.Generator, factors=(0.8, 1.2)) -> dict:
        """PBT's explore (Jaderberg et al. 2017, 4.1 "perturb"): each range multiplied by one of `factors`,
        kept inside its bounds; a choice moves to a neighbouring value; an int that the factor would round back
        to itself (1 x 1.2, 2 x 0.8) moves by one in the factor's direction, or small ints would never move; a
        float at 0 moves by (factor - 1) of its range, or it would never leave 0."""
        out = dict(config)
        for p in self.params:
            if p.kind == "choice":
                i = p.values.index(config[p.name]) + int(rng.choice([-1, 1]))
                out[p.name] = p.values[min(max(i, 0), len(p.values) - 1)]
                continue
            factor = float(rng.choice(factors))
            value = config[p.name] * factor
            if value == config[p.name] == 0 and p.kind != "int":
                # a product never leaves 0 (weight decay at its lower bound): step by (factor - 1) of the range
                value = (factor - 1) * (p.values[1] - p.values[0])
            if p.kind == "int":
                value = int(round(value))
                if value == config[p.name] and factor != 1:
                    value += 1 if (factor > 1) == (value >= 0) else -1
            out[p.name] = min(max(value, p.values[0]), p.values[1])
        return out


def read_config(path) -> dict:
    """A JSON file, or YAML when it ends in .yaml/.yml; a missing or unreadable file is refused in one line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise BadInput(f"cannot read config {path}: {err.strerror}; give the path of a JSON or YAML file") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # in the lock (Jupyter's dependency); imported only for YAML files
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:  # json.JSONDecodeError, yaml.YAMLError: the first line says where
        raise BadInput(f"config {path} is not valid {path.suffix[1:] or 'JSON'}: {err}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise BadInput(f"config {path} must hold a mapping at its top level, got {type(data).__name__}")
    return data
