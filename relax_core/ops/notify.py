"""Notifications about a run's health: restarts, giving up, the end of the run.

`services.notify` holds Apprise URLs (comma-separated: `slack://...`, `mailto://...`,
`json://host/path`, ...); empty sends nothing. Apprise is an optional dependency
(`pip install apprise`); a run that asks for notifications without it is refused before it
starts. A notification that cannot be delivered is logged and never fails the run.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def notify_urls(setting: str) -> list[str]:
    return [u.strip() for u in setting.split(",") if u.strip()]


def check_notify(setting: str) -> list[str]:
    """Problems with `services.notify` (empty when fine); needs no network."""
    urls = notify_urls(setting)
    if not urls:
        return []
    try:
        import apprise
    except ImportError:
        return ["services.notify: notifications need Apprise: pip install apprise"]
    bad = [u for u in urls if apprise.Apprise().add(u) is False]
    return [f"services.notify: {u!r} is not an Apprise URL Apprise can send to" for u in bad]


class Notifier:
    def __init__(self, setting: str, run_id: str) -> None:
        self.run_id = run_id
        self._apprise = None
        urls = notify_urls(setting)
        if urls:
            import apprise

            self._apprise = apprise.Apprise()
            for url in urls:
                self._apprise.add(url)

    def send(self, title: str, body: str, kind: str = "info") -> None:
        """`kind`: info, success, warning or failure."""
        if self._apprise is None:
            return
        try:
            ok = self._apprise.notify(title=f"[{self.run_id}] {title}", body=body, notify_type=kind)
        except Exception as exc:  # noqa: BLE001 - a lost notification must not cost the run
            log.warning("notification %r failed: %s", title, exc)
            return
        if not ok:
            log.warning("notification %r was not delivered", title)
