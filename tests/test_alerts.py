"""The shipped alert rules are shown to fire, and not to misfire.

``deploy/prometheus/rules/tests/*.yml`` are ``promtool test rules`` unit tests of
``deploy/prometheus/rules/*.yml``: series in, alerts out (docs/deploy.md#alerts).
This module runs them, and checks that every alert the rule files define has a
case where it fires and one where it must not. That the rules load in a real
Prometheus, stay quiet on a healthy cluster and name only metrics the bridge
emits is tests/test_deploy.py's part.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.support.backends import require_binary
from tests.support.deploy_checks import DEPLOY

RULES = DEPLOY / "prometheus" / "rules"
RULE_FILES = sorted(RULES.glob("*.yml"))
RULE_TESTS = sorted((RULES / "tests").glob("*.yml"))


def alert_names() -> set[str]:
    return {rule["alert"] for path in RULE_FILES
            for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule}


@pytest.mark.parametrize("path", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests_of_the_rules_pass(path):
    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "test", "rules", str(path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_case_that_fires_and_one_that_must_not():
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        unit = yaml.safe_load(path.read_text())
        # The tests are of the shipped rule files, not of copies
        assert {(path.parent / f).resolve() for f in unit["rule_files"]} <= set(RULE_FILES)
        for test in unit["tests"]:
            for case in test.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = alert_names()
    assert len(alerts) >= 9
    assert alerts - fires == set(), "alerts never shown to fire"
    assert alerts - quiet == set(), "alerts never shown to stay quiet"
    assert fires | quiet <= alerts, "tests of alerts the rules do not define"
