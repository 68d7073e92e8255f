"""docs/metrics.md, the Grafana dashboard and the alert rules agree with what /metrics exports."""

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "turboserve.json"
ALERTS = REPO / "deploy" / "alerts.yml"
METRIC_NAME = re.compile(r"\bturboserve_\w+")


def test_every_exported_family_is_documented_and_every_documented_one_exported(
    full_exposition, exported_names, documented_families, usable_names
):
    exported = exported_names(full_exposition)
    documented = documented_families
    assert documented - usable_names == set(), "docs/metrics.md lists families /metrics does not export"
    undocumented = {family for family, names in exported.items() if not names & documented}
    assert undocumented == set(), "families exported but missing from docs/metrics.md"


def test_every_family_carries_model_name(full_exposition, exported_names):
    exported = exported_names(full_exposition)
    for family in text_string_to_metric_families(full_exposition):
        if family.name in exported:
            for s in family.samples:
                assert "model_name" in s.labels, f"{s.name} has no model_name label: {s.labels}"


def dashboard_expressions() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    found = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    found += [("variable " + v["name"], v["definition"]) for v in board["templating"]["list"]]
    return found


def test_dashboard_expressions_use_only_exported_families(usable_names):
    usable = usable_names
    expressions = dashboard_expressions()
    assert len(expressions) > 20
    for title, expr in expressions:
        names = set(METRIC_NAME.findall(expr))
        assert names, f"panel {title!r} queries no turboserve family: {expr}"
        assert names <= usable, f"panel {title!r} uses {names - usable}, which /metrics does not export"


def test_dashboard_covers_what_operators_asked_for():
    exprs = " ".join(e for _, e in dashboard_expressions())
    for needed in ["turboserve_request_success_total", "turboserve_time_to_first_token_seconds_bucket",
                   "turboserve_inter_token_latency_seconds_bucket", "turboserve_e2e_request_latency_seconds_bucket",
                   "turboserve_num_requests_running", "turboserve_num_requests_waiting",
                   "turboserve_num_preemptions_total", "turboserve_generation_tokens_total",
                   "turboserve_kv_pages_used", "turboserve_kv_pool_tokens", "turboserve_kv_compression_ratio",
                   "turboserve_kernel_duration_seconds_sum"]:  # fmt: skip
        assert needed in exprs, f"the dashboard has no panel on {needed}"


def test_dashboard_panels_do_not_overlap():
    cells = set()
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"panel {p['title']!r} runs past the 24-column grid"
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_alert_rules_use_only_exported_families(usable_names):
    usable = usable_names
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {
        "TurboserveEngineDown", "TurboserveTTFTHigh", "TurboserveKVPoolNearlyFull", "TurboserveRequestFailures"
    }  # fmt: skip
    for rule in rules:
        names = set(METRIC_NAME.findall(rule["expr"]))
        assert names <= usable, f"alert {rule['alert']} uses {names - usable}, which /metrics does not export"
