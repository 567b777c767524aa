"""The Prometheus alerts and the Grafana dashboard the compose file ships ask only for series the monitor
exports, with labels those series have; and the files are where the compose file mounts them from."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from infra.launcher import PROMTOOL_VERSION, Launcher
from tests.unit.test_monitoring import T0, TOPICS, filled, metric, scrape

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
SERIES = re.compile(r"\b(trajpipe_[a-z_]+)\b(?:\{([^}]*)\})?")


def exported() -> dict[str, set[str]]:
    """Every series name the monitor exports (counters with their _total) -> its label names."""
    s = filled()
    for name, seconds in (("time/wait_data_s", 3.0), ("time/compute_s", 9.0)):  # as the learner publishes them
        s.observe(TOPICS.metrics, T0, metric(name, seconds))
    s.observe(TOPICS.events, T0, None, partition=0, offset=0)
    s.set_consumer_lag(T0, {("g", TOPICS.events): 5}, {("g", TOPICS.events): {0: 0}})
    s.observe(TOPICS.metrics, T0, metric("rollout/checkpoint_latency_s", 0.5, source="rollout"))
    found: dict[str, set[str]] = {}
    for (name, labels) in scrape(s):
        found.setdefault(name, set()).update(k for k, _ in labels)
    return found


def queries() -> list[tuple[str, str]]:
    alerts = yaml.safe_load((INFRA / "prometheus" / "alerts.yml").read_text())
    out = [(rule["alert"], rule["expr"]) for group in alerts["groups"] for rule in group["rules"]]
    dashboard = json.loads((INFRA / "grafana" / "dashboards" / "trajpipe.json").read_text())
    return out + [(panel["title"], t["expr"]) for panel in dashboard["panels"] for t in panel["targets"]]


def test_every_alert_and_panel_asks_for_series_the_monitor_exports_with_their_labels() -> None:
    have = exported()
    found = queries()
    assert len(found) >= 12
    for where, expr in found:
        series = SERIES.findall(expr)
        assert series, where
        for name, matchers in series:
            assert name in have, f"{where}: {name} is not exported (the monitor exports {sorted(have)})"
            for label in re.findall(r"([a-z_]+)\s*=~?", matchers):
                assert label in have[name], f"{where}: {name} has no label {label}"
        for label in re.findall(r"\{\{\s*\$labels\.([a-z_]+)\s*\}\}", expr):
            assert any(label in have[n] for n, _ in series), where


def test_the_alerts_cover_what_an_operator_acts_on_and_the_files_are_mounted() -> None:
    alerts = yaml.safe_load((INFRA / "prometheus" / "alerts.yml").read_text())
    names = {rule["alert"] for group in alerts["groups"] for rule in group["rules"]}
    assert {"StageStalled", "ConsumerLagGrowing", "QueueAging", "LearnerStarvedOfData", "DeadLetterSpike"} <= names
    for group in alerts["groups"]:
        for rule in group["rules"]:
            assert rule["for"] and rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
    config = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["monitor:9108"]
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for svc in ("prometheus", "grafana")
              for v in compose["services"][svc]["volumes"]}
    assert (INFRA / mounts["/etc/prometheus"]).is_dir()
    assert (INFRA / mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").is_file()
    assert (INFRA / mounts["/var/lib/grafana/dashboards"] / "trajpipe.json").is_file()
    datasource = yaml.safe_load((INFRA / "grafana/provisioning/datasources/prometheus.yml").read_text())
    dashboard = json.loads((INFRA / "grafana" / "dashboards" / "trajpipe.json").read_text())
    assert all(p["datasource"]["uid"] == datasource["datasources"][0]["uid"] for p in dashboard["panels"])


def test_promtool_checks_the_rules_and_each_alert_fires_on_its_series_and_not_on_a_healthy_one() -> None:
    """Prometheus's own promtool (built from its Go module by `python -m infra fetch`, as CI does) parses the
    rules and evaluates alerts_test.yml: the series that should wake an operator, and healthy ones."""
    promtool = Launcher().root / "promtool" / PROMTOOL_VERSION / "promtool"
    assert promtool.exists(), "no promtool: run `python -m infra fetch`"
    rules = INFRA / "prometheus" / "alerts.yml"
    check = subprocess.run([str(promtool), "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run([str(promtool), "test", "rules", str(INFRA / "prometheus" / "alerts_test.yml")],
                            capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = yaml.safe_load(rules.read_text())
    covered = {case["alertname"] for test in yaml.safe_load((INFRA / "prometheus" / "alerts_test.yml").read_text())["tests"]
               for case in test["alert_rule_test"]}
    assert covered == {rule["alert"] for group in alerts["groups"] for rule in group["rules"]}
