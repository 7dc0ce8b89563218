"""How every benchmark is measured: interleaved variants, repeats, medians, spread, ratios.

This machine is noisy (a virtual core sometimes runs at half speed for seconds), so a single
A-then-B timing means little. Variants run interleaved (A B, then B A, ...) so that slow phases
hit both alike; the first ``warmup`` rounds are discarded; each summary keeps every value, the
median and the spread; a ratio is reported both as the ratio of the medians and as the median of
the per-round ratios (A_i / B_i from the same round), and both come straight from the values kept.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable


@dataclass
class Summary:
    values: list[float]
    median: float = 0.0
    minimum: float = 0.0
    maximum: float = 0.0

    def __post_init__(self):
        if self.values:
            self.median = statistics.median(self.values)
            self.minimum = min(self.values)
            self.maximum = max(self.values)

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree."""
        return (self.maximum - self.minimum) / self.median if self.median else 0.0


@dataclass
class Ratio:
    numerator: str
    denominator: str
    of_medians: float
    paired_median: float
    """Median over rounds of numerator_i / denominator_i."""
    paired: list[float]


def ratio(name_a: str, a: list[float], name_b: str, b: list[float]) -> Ratio:
    paired = [x / y for x, y in zip(a, b) if y]
    return Ratio(name_a, name_b, statistics.median(a) / statistics.median(b),
                 statistics.median(paired), paired)


def interleave(variants: dict[str, Callable[[], dict]], *, repeats: int, warmup: int = 0,
               log: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """Run every variant ``warmup + repeats`` times, alternating their order each round."""
    names = list(variants)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            measurement = variants[name]()
            label = "warm-up" if round_index < warmup else f"round {round_index - warmup + 1}"
            log(f"  {label}: {name}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in measurement.items() if isinstance(v, (int, float))))
            if round_index >= warmup:
                results[name].append(measurement)
    return results


@dataclass
class Comparison:
    """One row of the report: variants measured interleaved, and the ratio that matters."""

    name: str
    metric: str
    """Key of the measured value in each measurement (higher is better unless noted)."""
    unit: str
    measurements: dict[str, list[dict]]
    numerator: str
    denominator: str
    target: float | None = None
    """The ratio must reach at least this (for ratios where lower is better, see lower_is_better)."""
    lower_is_better: bool = False
    note: str = ""
    summaries: dict[str, Summary] = field(default_factory=dict)
    result: Ratio | None = None

    def __post_init__(self):
        self.summaries = {name: Summary([m[self.metric] for m in runs])
                          for name, runs in self.measurements.items()}
        self.result = ratio(self.numerator, self.summaries[self.numerator].values,
                            self.denominator, self.summaries[self.denominator].values)

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        value = self.result.of_medians
        return value <= self.target if self.lower_is_better else value >= self.target

    @classmethod
    def from_dict(cls, data: dict) -> "Comparison":
        """The comparison as stored by to_dict, rebuilt from its measurements alone (so every
        summary and ratio of a stored result is recomputed, never read back)."""
        return cls(data["name"], data["metric"], data["unit"], data["measurements"],
                   data["numerator"], data["denominator"], data.get("target"),
                   data.get("lower_is_better", False), data.get("note", ""))

    def to_dict(self) -> dict:
        data = asdict(self)
        data["met"] = self.met
        for name, summary in self.summaries.items():
            data["summaries"][name]["spread"] = summary.spread
        return data
