"""What a webhook receives: the body in its ``format``, its headers and signature, and the review page's URL.

The body of a ``json`` webhook is the notice's JSON exactly as stored
(``store``); a ``slack`` webhook gets a Slack incoming-webhook message saying the
same (``slack_message``). Either is rendered the same way on every attempt, so a
retry carries the very bytes of the first, and its signature: ``sha256=`` and the
hex HMAC-SHA256 of the raw body with the webhook's ``secret``, computed at each
send (a secret changed between restarts signs what is still pending).
"""

from __future__ import annotations

import functools
import hashlib
import json
import socket
from importlib.metadata import version
from typing import Any
from urllib.parse import quote

from ..auth import signature
from ..config import Config, Webhook, split_host
from ..system.runtime import RuntimeInfo
from . import TITLES

EVENT_HEADER = "X-Tracejudge-Event"
SIGNATURE_HEADER = "X-Tracejudge-Signature"
ID_HEADER = "X-Tracejudge-Id"

_SHOWN_APART = ("id", "type", "at", "state", "resolved_at", "evidence", "reasoning", "review_url")
"""Body keys a Slack message shows in places of their own; every other key is a field."""


def webhook_key(url: str) -> str:
    """How deliveries name a webhook: a digest of its URL (which may hold a credential, so it is not stored)."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def body_for(webhook: Webhook, notice: str) -> bytes:
    """The bytes POSTed to ``webhook`` for a notice whose JSON body is ``notice``."""
    if webhook.format == "slack":
        return json.dumps(slack_message(json.loads(notice)), ensure_ascii=False, separators=(",", ":")).encode()
    return notice.encode()


def headers(webhook: Webhook, alert_type: str, alert_id: str, body: bytes) -> dict[str, str]:
    """The headers of a POST of ``body``: content type, event, alert id and, with a secret, the signature."""
    out = {"Content-Type": "application/json", "User-Agent": _user_agent(), EVENT_HEADER: alert_type,
           ID_HEADER: alert_id}
    if webhook.secret:
        out[SIGNATURE_HEADER] = signature(webhook.secret, body)
    return out


@functools.cache
def _user_agent() -> str:
    return f"tracejudge/{version('tracejudge')}"


def slack_message(body: dict[str, Any]) -> dict[str, Any]:
    """A Slack incoming-webhook message (``text`` and ``blocks``) saying what the JSON ``body`` says.

    Text from the body is escaped for Slack's mrkdwn (``&``, ``<``, ``>``), so a quote cannot mention
    ``@channel`` or make a link; each piece is cut to Slack's limits.
    """
    resolved = body.get("state") == "resolved"
    title = ("Resolved: " if resolved else "") + TITLES.get(str(body.get("type")), str(body.get("type")))
    if body.get("criterion"):
        title += f": {body['criterion']}"
    if body.get("severity") and not resolved:
        title += f" ({body['severity']})"
    facts = [(k, v) for k, v in body.items() if k not in _SHOWN_APART]
    blocks: list[dict[str, Any]] = [{"type": "header", "text": {"type": "plain_text", "text": _cut(title, 150)}}]
    if facts:
        blocks.append({"type": "section", "fields": [
            {"type": "mrkdwn", "text": _cut(f"*{_escape(k)}*\n{_escape(_text(v))}", 2000)} for k, v in facts[:10]]})
    if body.get("reasoning"):
        blocks.append(_section(f"*reasoning*\n{_escape(_text(body['reasoning']))}"))
    quotes = [q for q in body.get("evidence") or [] if q] if isinstance(body.get("evidence"), list) else []
    if quotes:
        lines = ["> " + line for q in quotes for line in _escape(_text(q)).splitlines() or [""]]
        blocks.append(_section("*evidence*\n" + "\n".join(lines)))
    if body.get("review_url"):
        blocks.append({"type": "actions", "elements": [{"type": "button", "text": {
            "type": "plain_text", "text": "Open in review"}, "url": str(body["review_url"])}]})
    when = f"fired {body.get('at')}" + (f", resolved {body['resolved_at']}" if body.get("resolved_at") else "")
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": _escape(
        f"tracejudge alert {body.get('id')} ({body.get('state')}), {when}")}]})
    where = f" in conversation {body['conversation_id']}" if body.get("conversation_id") else ""
    link = f" <{body['review_url']}|review>" if body.get("review_url") else ""
    return {"text": _cut(f"tracejudge: {_escape(title)}{_escape(where)}", 3000) + link, "blocks": blocks}


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": _cut(text, 3000)}}


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


def review_url(cfg: Config, item_id: int | str) -> str:
    """The review page of an item, as a receiver of an alert opens it.

    The API's address as this daemon listens (its runtime file: the actual port when the endpoint's is 0),
    else ``api.endpoint``; a wildcard host (``0.0.0.0``, ``::``) is replaced by this machine's name.
    """
    info = RuntimeInfo.read(cfg.runtime_file)
    if info is not None and info.api:
        scheme, _, hostport = info.api.partition("://")
    else:
        scheme, hostport = ("https" if cfg.api.tls.enabled else "http"), cfg.api.endpoint
    host, port = split_host(hostport)
    if host in ("0.0.0.0", "::"):
        host = socket.getfqdn()
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}{'' if port is None else f':{port}'}/review/{quote(str(item_id), safe='')}"
