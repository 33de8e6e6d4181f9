"""A Prometheus exposition linter for tests: the rules of `promtool check metrics` that matter here.

`promtool` (Debian package `prometheus`) is not on every machine, so the tests always run this
equivalent and run promtool too where it is installed. The rules follow promtool's linter
(client_golang `testutil/promlint`) and https://prometheus.io/docs/practices/naming/:

- every family has HELP text and at most one HELP and TYPE line, declared before its samples,
  and its samples are contiguous;
- metric names match `[a-zA-Z_:][a-zA-Z0-9_:]*`, are snake_case and carry no `:` (recording rules
  only); label names match `[a-zA-Z_][a-zA-Z0-9_]*`, are snake_case and do not start with `__`;
- counters end in `_total`; nothing else does;
- `_bucket`, `_sum` and `_count` belong to histograms and summaries only, `le` to histogram buckets
  and `quantile` to summaries;
- base units only: no abbreviations (`_s`, `_ms`, `_us`, `_kib`, ...), no prefixed or non-base units
  (`_milliseconds`, `_microseconds`, `_kilobytes`, `_minutes`, `_bits`, ...);
- a name does not repeat its type (`_gauge`, `_counter`, ...);
- no series appears twice; values are numbers; a histogram's buckets are cumulative, end in `+Inf`,
  and `+Inf` equals `_count`.

Parsed by hand, not with `prometheus_client.parser`: that parser renames a counter's sample to
`<name>_total`, which would hide the very mistake the counter rule looks for.
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_CAMEL = re.compile(r"[a-z][A-Z]")
_SAMPLE = re.compile(
    r"(?P<name>[^\s{]+)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+(?P<ts>-?\d+))?"
)
_LABEL = re.compile(r'\s*(?P<name>[^\s=,]+)\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')

TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
SUMMARY_SUFFIXES = ("_sum", "_count")
BASE_UNITS = frozenset(
    {
        "amperes",
        "bytes",
        "celsius",
        "grams",
        "joules",
        "kelvin",
        "meters",
        "metres",
        "seconds",
        "volts",
    }
)
# Non-base units and the base unit to use instead (promlint's table).
OTHER_UNITS = {
    "minutes": "seconds",
    "hours": "seconds",
    "days": "seconds",
    "weeks": "seconds",
    "kelvins": "kelvin",
    "fahrenheit": "celsius",
    "rankine": "celsius",
    "inches": "meters",
    "yards": "meters",
    "miles": "meters",
    "bits": "bytes",
    "calories": "joules",
    "pounds": "grams",
    "ounces": "grams",
}
UNIT_PREFIXES = (
    "pico",
    "nano",
    "micro",
    "milli",
    "centi",
    "deci",
    "deca",
    "hecto",
    "kilo",
    "kibi",
    "mega",
    "mebi",
    "mibi",
    "giga",
    "gibi",
    "tera",
    "tebi",
    "peta",
    "pebi",
)
ABBREVIATED_UNITS = frozenset(
    {"s", "ms", "us", "ns", "sec", "secs", "msec", "usec", "b", "kb", "mb", "gb", "tb", "pb"}
    | {"kib", "mib", "gib", "tib", "m", "h", "d", "min", "hr"}
)


@dataclass(frozen=True, slots=True)
class Problem:
    metric: str
    text: str

    def __str__(self) -> str:
        return f"{self.metric}: {self.text}"


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    line: int


@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    samples: list[Sample] = field(default_factory=list)
    typed: bool = False


def lint(text: str) -> list[Problem]:
    """Every problem in a Prometheus text exposition (version 0.0.4); [] when it is clean."""
    families, problems = parse(text)
    for family in families.values():
        problems.extend(_lint_family(family))
    problems.extend(_duplicates(families))
    return problems


def parse(text: str) -> tuple[dict[str, Family], list[Problem]]:
    """Families by name (in order of appearance) and the problems found while parsing."""
    families: dict[str, Family] = {}
    problems: list[Problem] = []
    current: Family | None = None
    closed: set[str] = set()  # families whose samples ended (a later sample would be a split)
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # a comment
            name = parts[2]
            rest = parts[3] if len(parts) > 3 else ""
            family = families.get(name)
            if family is None:
                family = families[name] = Family(name)
            elif family.samples:
                problems.append(
                    Problem(name, f"{parts[1]} after the family's samples (line {number})")
                )
            if parts[1] == "HELP":
                if family.help is not None:
                    problems.append(Problem(name, "HELP declared twice"))
                family.help = rest
            else:
                if family.typed:
                    problems.append(Problem(name, "TYPE declared twice"))
                if rest not in TYPES:
                    problems.append(Problem(name, f"unknown type {rest!r}"))
                family.type, family.typed = rest, True
            if current is not None and current is not family:
                closed.add(current.name)
            current = family
            continue
        sample = _sample(line, number, problems)
        if sample is None:
            continue
        family = _family_of(sample.name, families)
        if family.name in closed:
            problems.append(Problem(family.name, f"samples not contiguous (line {number})"))
        if current is not None and current is not family:
            closed.add(current.name)
        current = family
        family.samples.append(sample)
    return families, problems


def _sample(line: str, number: int, problems: list[Problem]) -> Sample | None:
    match = _SAMPLE.fullmatch(line)
    if match is None:
        problems.append(Problem("?", f"unparsable line {number}: {line!r}"))
        return None
    labels: list[tuple[str, str]] = []
    body = match["labels"] or ""
    position = 0
    while position < len(body.rstrip()):
        label = _LABEL.match(body, position)
        if label is None:
            problems.append(Problem(match["name"], f"unparsable labels on line {number}"))
            return None
        labels.append((label["name"], label["value"]))
        position = label.end()
    try:
        value = float(match["value"])
    except ValueError:
        problems.append(Problem(match["name"], f"value {match['value']!r} is not a number"))
        return None
    return Sample(match["name"], tuple(labels), value, number)


def _family_of(sample_name: str, families: dict[str, Family]) -> Family:
    """The declared family a sample belongs to: its own name, or its name less a histogram or
    summary suffix when that family is a histogram or summary; else a new untyped family."""
    if sample_name in families:
        return families[sample_name]
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and families.get(base, Family(base)).type in (
            "histogram",
            "summary",
        ):
            return families[base]
    families[sample_name] = Family(sample_name)
    return families[sample_name]


def _lint_family(family: Family) -> Iterator[Problem]:
    name, kind = family.name, family.type
    yield from _lint_name(family)
    if not family.help:
        yield Problem(name, "no help text")
    if kind == "counter" and not name.endswith("_total"):
        yield Problem(name, 'counter metrics should have "_total" suffix')
    if kind != "counter" and name.endswith("_total"):
        yield Problem(name, 'non-counter metrics should not have "_total" suffix')
    if kind not in ("histogram", "summary"):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix):
                yield Problem(
                    name, f'non-histogram and non-summary metrics should not have "{suffix}" suffix'
                )
    for sample in family.samples:
        yield from _lint_sample(family, sample)
    if kind == "histogram":
        yield from _lint_histogram(family)


def _lint_name(family: Family) -> Iterator[Problem]:
    name = family.name
    if not _METRIC_NAME.fullmatch(name):
        yield Problem(name, "invalid metric name")
    if ":" in name:
        yield Problem(name, "metric names should not contain ':' (recording rules only)")
    if _CAMEL.search(name):
        yield Problem(name, "metric names should be written in 'snake_case' not 'camelCase'")
    tokens = name.lower().split("_")
    if any(t in ABBREVIATED_UNITS for t in tokens):
        yield Problem(name, "metric names should not contain abbreviated units")
    for token in tokens:
        base = _non_base_unit(token)
        if base is not None:
            yield Problem(name, f'use base unit "{base}" instead of "{token}"')
    if family.type != "untyped" and (
        f"_{family.type}_" in name.lower() or name.lower().endswith(f"_{family.type}")
    ):
        yield Problem(name, f"metric name should not include type '{family.type}'")


def _non_base_unit(token: str) -> str | None:
    if token in OTHER_UNITS:
        return OTHER_UNITS[token]
    for prefix in UNIT_PREFIXES:
        rest = token.removeprefix(prefix)
        if rest != token and (rest in BASE_UNITS or rest in OTHER_UNITS):
            return OTHER_UNITS.get(rest, rest)
    return None


def _lint_sample(family: Family, sample: Sample) -> Iterator[Problem]:
    allowed = {family.name}
    if family.type == "histogram":
        allowed = {family.name + s for s in HISTOGRAM_SUFFIXES}
    elif family.type == "summary":
        allowed |= {family.name + s for s in SUMMARY_SUFFIXES}
    if sample.name not in allowed:
        yield Problem(family.name, f"sample {sample.name!r} does not belong to a {family.type}")
    for label, _ in sample.labels:
        if not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
            yield Problem(family.name, f"invalid label name {label!r}")
        elif _CAMEL.search(label):
            yield Problem(family.name, f"label names should be written in 'snake_case': {label!r}")
        if label == "le" and not (family.type == "histogram" and sample.name.endswith("_bucket")):
            yield Problem(family.name, '"le" is reserved for histogram buckets')
        if label == "quantile" and family.type != "summary":
            yield Problem(family.name, '"quantile" is reserved for summaries')
    if len({label for label, _ in sample.labels}) != len(sample.labels):
        yield Problem(family.name, f"a label repeated on line {sample.line}")


def _lint_histogram(family: Family) -> Iterator[Problem]:
    series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    for s in family.samples:
        others = tuple(sorted((k, v) for k, v in s.labels if k != "le"))
        if s.name.endswith("_bucket"):
            le = dict(s.labels).get("le")
            if le is None:
                yield Problem(family.name, f"bucket without le on line {s.line}")
                continue
            series.setdefault(others, []).append((float(le), s.value))
        elif s.name.endswith("_count"):
            counts[others] = s.value
    for labels, buckets in series.items():
        bounds = [b for b, _ in buckets]
        if bounds != sorted(bounds) or not bounds or not math.isinf(bounds[-1]):
            yield Problem(family.name, f"buckets of {dict(labels)} are unsorted or lack +Inf")
            continue
        values = [v for _, v in buckets]
        if any(a > b for a, b in itertools.pairwise(values)):
            yield Problem(family.name, f"buckets of {dict(labels)} are not cumulative")
        if counts.get(labels) != values[-1]:
            yield Problem(family.name, f"+Inf bucket of {dict(labels)} differs from _count")
    if set(counts) - set(series):
        yield Problem(family.name, "_count without buckets")


def _duplicates(families: dict[str, Family]) -> Iterator[Problem]:
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for family in families.values():
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels)))
            if key in seen:
                yield Problem(family.name, f"duplicate series {s.name}{dict(s.labels)}")
            seen.add(key)


def values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample's value by (sample name, sorted labels): what tests look series up in."""
    families, _ = parse(text)
    return {
        (s.name, tuple(sorted(s.labels))): s.value for f in families.values() for s in f.samples
    }


def promtool_problems(text: str) -> list[str] | None:
    """`promtool check metrics` on the text: its problem lines ([] when clean), or None when promtool
    is not installed (`apt-get install -y --no-install-recommends prometheus`)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    done = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode not in (0, 3):  # 3: lint problems; anything else: promtool itself failed
        raise RuntimeError(f"promtool failed ({done.returncode}): {lines}")
    return lines
