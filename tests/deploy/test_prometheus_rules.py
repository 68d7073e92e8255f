"""promtool: the config and the rules are valid, and each alert fires on a synthetic series."""

import subprocess

import yaml

from deploy_paths import DEPLOY, require_tool

HOW = "apt-get install -y --no-install-recommends prometheus (listed in scripts/system-packages.txt)"


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = require_tool("promtool", HOW)
    return subprocess.run([binary, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120)


def test_prometheus_config_and_rules_are_valid():
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml")):
        run = promtool(*args)
        assert run.returncode == 0, f"promtool {' '.join(args)}:\n{run.stdout}{run.stderr}"


def test_each_alert_fires_on_synthetic_series():
    run = promtool("test", "rules", "alerts_test.yml")
    assert run.returncode == 0, f"promtool test rules:\n{run.stdout}{run.stderr}"
    alerts = {r["alert"] for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    cases = yaml.safe_load((DEPLOY / "alerts_test.yml").read_text())["tests"]
    fired = {c["alertname"] for t in cases for c in t["alert_rule_test"] if c.get("exp_alerts")}
    quiet = {c["alertname"] for t in cases for c in t["alert_rule_test"] if not c.get("exp_alerts")}
    assert alerts - fired == set(), "alerts with no test case that expects them to fire"
    assert alerts - quiet == set(), "alerts with no test case that expects them to stay quiet"


def test_prometheus_scrapes_turboserve():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["turboserve"]["metrics_path"] == "/metrics"
    assert jobs["turboserve"]["static_configs"][0]["targets"] == ["turboserve:8000"]
    assert config["rule_files"] == ["alerts.yml"]
