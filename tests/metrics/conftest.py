import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = REPO / "docs" / "metrics.md"


@pytest.fixture(scope="session")
def documented_families() -> set[str]:
    """Names in the first column of docs/metrics.md's tables."""
    return set(re.findall(r"^\| `(turboserve_\w+)` \|", METRICS_DOC.read_text(), flags=re.M))


def _exported_names(exposition: str) -> dict[str, set[str]]:
    """turboserve family -> the names a query may use for it (samples; histograms also by base name)."""
    names = {}
    for family in text_string_to_metric_families(exposition):
        # prometheus_client writes each counter's/histogram's creation time as its own *_created gauge.
        if family.name.startswith("turboserve_") and not family.name.endswith("_created"):
            usable = {s.name for s in family.samples if not s.name.endswith("_created")}
            if family.type == "histogram":
                usable.add(family.name)
            names[family.name] = usable
    return names


@pytest.fixture(scope="session")
def full_exposition() -> str:
    """An exposition in which every family has at least one sample (one of each kind of event)."""
    from server.kernels import timing
    from server.metrics import EngineMetrics, exposition

    m = EngineMetrics("exposition-fixture")
    m.kv.on_pool(num_pages=4, page_size=16, bytes_per_token=64, k_dtype="bf16", v_dtype="bf16", k_bits=16,
                 v_bits=16, bf16_bytes_per_token=64)  # fmt: skip
    m.process.on_start(device="cpu", kv_cache_dtype_k="bf16", kv_cache_dtype_v="bf16", kv_key_offset="none",
                       kv_key_turned_pairs=0, kv_balance="off", weight_formats="float32", kernels="reference")  # fmt: skip
    m.process.watch_engine(lambda: True)
    timing.set_sample_rate(1.0)
    with timing.timed("fixture_kernel", "cpu"):
        pass
    timing.set_sample_rate(0.0)
    return exposition()[0].decode()


@pytest.fixture(scope="session")
def exported_names():
    """The function: exposition text -> {family: names a query may use for it}."""
    return _exported_names


@pytest.fixture(scope="session")
def usable_names(full_exposition) -> set[str]:
    """Every name a query may use against a full exposition."""
    return set().union(*_exported_names(full_exposition).values())
