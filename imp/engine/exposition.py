"""Several engines' Prometheus expositions as one, each sample labelled with its model.

Every model of a fleet (imp.engine.fleet) has its own metrics actor and registry, so a swapped
model's numbers are never its predecessor's (API reference: imp_model_loaded{model=...}). A scrape
must still be one valid exposition: each family once, its samples from every model, told apart by
the `model` label. Parsed and rendered by prometheus-client, never by string surgery.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def merge(parts: list[tuple[str, bytes]]) -> bytes:
    """parts: (model name, its exposition), in listing order. A sample that has a model label keeps it; a part
    named "" adds none (figures of no one model)."""
    fams: dict[str, Metric] = {}
    for model, text in parts:
        for f in text_string_to_metric_families(text.decode()):
            into = fams.get(f.name)
            if into is None:
                into = fams[f.name] = Metric(f.name, f.documentation, f.type, f.unit)
            for s in f.samples:
                labels = s.labels if "model" in s.labels or not model else {"model": model, **s.labels}
                into.samples.append(s._replace(labels=labels))

    class _Parsed:
        def collect(self):
            return list(fams.values())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Parsed())
    return generate_latest(reg)
