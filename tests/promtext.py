"""Reading a Prometheus text exposition in tests, with prometheus_client's own parser: every
sample by name and labels, and one value looked up (a missing sample fails naming it)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels or ''} in {sorted({n for n, _ in samples})}"
    return samples[key]


def labelled(samples: Samples, name: str, label: str) -> dict[str, float]:
    """{value of `label`: sample} of every sample of `name`."""
    return {dict(ls)[label]: v for (n, ls), v in samples.items() if n == name}
