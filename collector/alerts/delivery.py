"""The daemon's ``alerts`` stage: every alert notice POSTed to its webhooks, at least once, across restarts.

Durable in DuckDB. ``store.fire`` and ``store.resolve`` write the notice in the
transaction of whoever found the cause, so a notice exists exactly when its
finding was committed, and survives ``kill -9`` with it. (The forward stage's
on-disk queue is a separate SQLite file: a notice put there could not commit
with the finding, and its cursor per exporter has no room for a per-delivery
outcome kept visible.) Each cycle, twice a second:

1. **queue**: each notice not taken yet becomes one ``alert_deliveries`` row per
   webhook configured now whose ``events`` include the alert's type, in one
   transaction with the mark that it was taken.
2. **send**: each webhook's pending deliveries, in the order they were fired, one
   at a time; a webhook whose first is waiting to be retried sends nothing else
   meanwhile. The answer decides:

   - 2xx: ``delivered``.
   - no answer, a timeout (``timeout`` bounds the whole exchange), 408, 429, 5xx,
     or a redirect not followed: retried after ``Retry-After`` when the receiver
     sent one (at most 5 minutes), else after a backoff (1 s doubling to 5
     minutes, each wait cut by up to half at random); the time of the next try is
     stored, so a restart keeps to it.
   - any other answer: ``refused``, for good: logged, counted and listed with the
     alert (``GET /api/alerts``).

   Redirects (301, 302, 307, 308) are followed with the same POST within the
   webhook's origin (scheme, host and port), never to another.

A delivery is marked after its answer: a crash in between sends it again, with
the same ``id`` (receivers drop repeats by ``id`` and ``state``). Deliveries still
pending to a webhook no longer configured are ``dropped`` at start, with a
warning.

On /metrics: ``tracejudge_alert_deliveries_total{outcome}`` (delivered, retried,
refused: attempts since the start), and, read from the tables at each scrape,
``tracejudge_alerts_fired_total{type}``, ``tracejudge_alerts_open{type}`` (open and
not acknowledged) and ``tracejudge_alerts_undelivered_oldest_seconds``.
"""

from __future__ import annotations

import datetime as dt
import http.client
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urljoin, urlsplit

import duckdb

from judges import Backoff

from ..background import Stage
from ..config import Webhook
from ..errors import StoreUnavailable
from ..forward.send import FOLLOWED, MAX_REDIRECTS, Answer, Connection
from ..metrics import Counter, Metrics
from ..store import Store, Transaction
from ..words import masked_url, plural
from . import ALERT_TYPES
from .store import ensure_schema
from .webhooks import body_for, headers, webhook_key

log = logging.getLogger("tracejudge.alerts")

INTERVAL = 0.5
"""Seconds between two looks for new notices and deliveries due."""
BATCH = 100
BACKOFF = Backoff(1.0, 300.0, jitter=0.5)
"""The wait before retrying a delivery the receiver did not time (``Retry-After``)."""
OUTCOMES = ("delivered", "retried", "refused")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class AlertDelivery(Stage):
    """Sends alert notices to ``alerts.webhooks`` (see the module docstring)."""

    name = "alerts"

    def __init__(self, store: Store, metrics: Metrics, webhooks: Sequence[Webhook], *,
                 clock: Callable[[], dt.datetime] = _now, interval: float = INTERVAL,
                 backoff: Backoff = BACKOFF) -> None:
        super().__init__(store, metrics)
        self.webhooks = {webhook_key(w.url): w for w in webhooks}
        self.clock, self.interval, self.backoff = clock, interval, backoff
        self._http = {key: Connection(w.timeout) for key, w in self.webhooks.items()}
        self._errors: dict[str, str] = {}  # each webhook's last retryable error, while it lasts
        self._failed: dict[str, int] = {}  # attempts retried since each webhook's last delivery
        self.pending: dict[str, int] = {}  # each webhook's deliveries pending at the end of the last cycle
        self.outcomes = Counter("tracejudge_alert_deliveries_total",
                                "Attempts to deliver an alert notice to a webhook, by outcome: delivered, retried "
                                "(no answer, a timeout, 408, 429, 5xx), refused (any other answer; not retried).",
                                ("outcome",))
        for outcome in OUTCOMES:
            self.outcomes.declare(outcome=outcome)
        metrics.add_instruments(self.outcomes)
        metrics.add_collector(self._gauges)

    def _open(self) -> None:
        assert self.cur is not None
        ensure_schema(self.cur)
        gone = self.cur.execute(
            "UPDATE alert_deliveries SET state = 'dropped', done_at = ?, "
            "last_error = 'its webhook is no longer in alerts.webhooks' "
            "WHERE state = 'pending' AND NOT list_contains(?, webhook) RETURNING url", [self.clock(), list(self.webhooks)]
        ).fetchall()
        for url in sorted({u for (u,) in gone}):
            log.warning("alerts: %s pending to %s dropped: that webhook is no longer in alerts.webhooks",
                        plural(sum(1 for (u,) in gone if u == url), "delivery", "deliveries"), url)

    def status(self) -> dict[str, Any]:
        """For /api/status: each webhook (its URL masked), its deliveries pending and its last error while it
        retries."""
        return {"alert_deliveries_pending": sum(self.pending.values()),
                "alert_webhooks": [{"url": masked_url(w.url), "format": w.format, "events": list(w.events),
                                    "pending": self.pending.get(key, 0), "last_error": self._errors.get(key)}
                                   for key, w in self.webhooks.items()]}

    def _run(self) -> None:
        self.run_cycles(self.cycle, "delivering alerts failed", self.interval)

    def _wake(self) -> None:
        for conn in self._http.values():  # an exchange under way ends now; its delivery is retried after a restart
            conn.close()

    # ------------------------------------------------------------ a cycle

    def cycle(self) -> bool:
        """Queue new notices for their webhooks, then send what is due; whether more may be due at once."""
        queued = self._queue_new()
        sent = self._send_due()
        return queued == BATCH or sent == BATCH

    def _queue_new(self) -> int:
        assert self.cur is not None
        cur, now = self.cur, self.clock()
        notices = cur.execute(
            "SELECT n.seq, a.type FROM alert_notices n JOIN alerts a ON a.id = n.alert_id WHERE NOT n.queued "
            "ORDER BY n.seq LIMIT ?", [BATCH]).fetchall()
        if not notices:
            return 0
        rows = [(seq, key, masked_url(w.url), now) for seq, kind in notices
                for key, w in self.webhooks.items() if kind in w.events]
        with Transaction(cur):
            if rows:
                cur.executemany("INSERT INTO alert_deliveries (notice_seq, webhook, url, state, next_at) "
                                "VALUES (?, ?, ?, 'pending', ?)", rows)
            cur.execute("UPDATE alert_notices SET queued = true WHERE list_contains(?, seq)",
                        [[seq for seq, _ in notices]])
        return len(notices)

    def _send_due(self) -> int:
        """Send each webhook's due deliveries in order; how many were looked at."""
        assert self.cur is not None
        now = self.clock()
        # A webhook with a delivery waiting for its retry sends none of its others meanwhile: they keep their order.
        due = self.cur.execute(
            "SELECT d.notice_seq, d.webhook, d.attempts, n.body, n.alert_id, a.type "
            "FROM alert_deliveries d JOIN alert_notices n ON n.seq = d.notice_seq JOIN alerts a ON a.id = n.alert_id "
            "WHERE d.state = 'pending' AND d.webhook NOT IN "
            "(SELECT webhook FROM alert_deliveries WHERE state = 'pending' AND next_at > ?) "
            "ORDER BY d.webhook, d.notice_seq LIMIT ?", [now, BATCH]).fetchall()
        held: set[str] = set()
        for seq, key, attempts, notice, alert_id, kind in due:
            if key in held or self.stopping.is_set():
                continue
            if not self._send(seq, self.webhooks[key], key, attempts, notice, alert_id, kind):
                held.add(key)
        self.pending = dict(self.cur.execute("SELECT webhook, count(*) FROM alert_deliveries WHERE state = 'pending' "
                                             "GROUP BY webhook").fetchall())
        return len(due)

    def _send(self, seq: int, webhook: Webhook, key: str, attempts: int, notice: str, alert_id: str,
              kind: str) -> bool:
        """One attempt; False when the webhook is to wait (a retry)."""
        body = body_for(webhook, notice)
        try:
            answer = self._post(key, webhook.url, body, headers(webhook, kind, alert_id, body))
        except (OSError, http.client.HTTPException) as exc:
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return self._retry(seq, webhook, key, attempts, None, what, None)
        status = answer.status
        if 200 <= status < 300:
            self._mark(seq, key, "delivered", attempts, status, None)
            self.outcomes.inc(outcome="delivered")
            if self._failed.pop(key, 0):
                log.warning("alerts: %s delivers again", masked_url(webhook.url))
            self._errors.pop(key, None)
            return True
        if status in (408, 429) or status >= 500 or 300 <= status < 400:
            what = f"answered {status}" + (f" redirecting to {masked_url(urljoin(webhook.url, answer.location))}, "
                                           "not followed" if 300 <= status < 400 and answer.location else "")
            return self._retry(seq, webhook, key, attempts, status, what, answer.retry_after)
        what = f"answered {status}: a permanent refusal, not retried"
        self._mark(seq, key, "refused", attempts, status, what)
        self.outcomes.inc(outcome="refused")
        log.warning("alerts: %s %s (alert %s, %s)", masked_url(webhook.url), what, alert_id, kind)
        return True

    def _post(self, key: str, url: str, body: bytes, sent: dict[str, str]) -> Answer:
        for _ in range(MAX_REDIRECTS + 1):
            answer = self._http[key].post(url, body, sent)
            if answer.status not in FOLLOWED or not answer.location:
                break
            target = urljoin(url, answer.location)
            if _origin(target) != _origin(url):
                break
            url = target
        return answer

    def _retry(self, seq: int, webhook: Webhook, key: str, attempts: int, status: int | None, what: str,
               retry_after: float | None) -> bool:
        wait = retry_after or self.backoff.delay(attempts + 1)  # "Retry-After: 0" would be a busy loop: back off
        assert self.cur is not None
        self.cur.execute("UPDATE alert_deliveries SET attempts = attempts + 1, last_status = ?, last_error = ?, "
                         "next_at = ? WHERE notice_seq = ? AND webhook = ?",
                         [status, what, self.clock() + dt.timedelta(seconds=wait), seq, key])
        self.outcomes.inc(outcome="retried")
        self._failed[key] = self._failed.get(key, 0) + 1
        if self._errors.get(key) != what:
            log.warning("alerts: %s %s; its alerts wait, retried with backoff", masked_url(webhook.url), what)
        self._errors[key] = what
        return False

    def _mark(self, seq: int, key: str, state: str, attempts: int, status: int, error: str | None) -> None:
        assert self.cur is not None
        self.cur.execute("UPDATE alert_deliveries SET state = ?, attempts = ?, last_status = ?, last_error = ?, "
                         "done_at = ? WHERE notice_seq = ? AND webhook = ?",
                         [state, attempts + 1, status, error, self.clock(), seq, key])

    # ------------------------------------------------------------ /metrics

    def _gauges(self) -> list[str]:
        try:
            cur = self.store.cursor()
            try:
                by_type = cur.execute("SELECT type, count(*), count(*) FILTER (WHERE state = 'open') FROM alerts "
                                      "GROUP BY type").fetchall()
                oldest = cur.execute(
                    "SELECT min(made_at) FROM alert_notices n WHERE NOT queued OR EXISTS (SELECT 1 FROM "
                    "alert_deliveries d WHERE d.notice_seq = n.seq AND d.state = 'pending')").fetchall()[0][0]
            finally:
                cur.close()
        except (duckdb.Error, StoreUnavailable) as exc:  # the file is being attached again: /metrics still answers
            return [f"# tracejudge_alerts unavailable: {str(exc).splitlines()[0]}"]
        fired = {t: 0 for t in ALERT_TYPES} | {t: n for t, n, _ in by_type}
        still = {t: 0 for t in ALERT_TYPES} | {t: n for t, _, n in by_type}
        age = max(0.0, (self.clock() - oldest).total_seconds()) if oldest is not None else 0.0
        return ["# HELP tracejudge_alerts_fired_total Alerts fired, by type (kept in DuckDB: counted across restarts).",
                "# TYPE tracejudge_alerts_fired_total counter",
                *(f'tracejudge_alerts_fired_total{{type="{t}"}} {n}' for t, n in sorted(fired.items())),
                "# HELP tracejudge_alerts_open Alerts open and not acknowledged, by type.",
                "# TYPE tracejudge_alerts_open gauge",
                *(f'tracejudge_alerts_open{{type="{t}"}} {n}' for t, n in sorted(still.items())),
                "# HELP tracejudge_alerts_undelivered_oldest_seconds Age of the oldest alert notice a webhook has "
                "not answered 2xx yet (0: none waits).",
                "# TYPE tracejudge_alerts_undelivered_oldest_seconds gauge",
                f"tracejudge_alerts_undelivered_oldest_seconds {age:.3f}"]


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urlsplit(url)
    return u.scheme.lower(), (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(u.scheme.lower())
