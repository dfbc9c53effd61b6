"""Notifications through Apprise, delivered to a real HTTP endpoint on loopback."""

from __future__ import annotations

import socket

from relax_core.ops.notify import Notifier, check_notify


def test_notifications_reach_every_url_with_the_run_in_the_title(hook):
    url, received = hook
    Notifier(f"{url}, {url}", "cpu-async-1").send(
        "rollout-0 restarted", "exited with -9", "warning"
    )
    assert len(received) == 2
    assert received[0]["title"] == "[cpu-async-1] rollout-0 restarted"
    assert received[0]["message"] == "exited with -9" and received[0]["type"] == "warning"


def test_an_unreachable_endpoint_costs_the_notification_not_the_run(hook, caplog):
    url, received = hook
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Notifier(f"json://127.0.0.1:{port}/hook", "r").send("run finished", "ok", "success")
    assert "was not delivered" in caplog.text
    assert received == []


def test_setting_is_checked_before_a_run_starts():
    assert check_notify("") == []
    assert check_notify("json://127.0.0.1:9/x") == []
    problems = check_notify("json://127.0.0.1:9/x, not-a-url")
    assert problems == ["services.notify: 'not-a-url' is not an Apprise URL Apprise can send to"]
    assert Notifier("", "r").send("t", "b") is None  # nothing configured: nothing sent
