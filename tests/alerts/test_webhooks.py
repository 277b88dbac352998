"""What a webhook receives, rendered without a daemon: the Slack message, the signature, the review page's URL."""

from __future__ import annotations

import json
from pathlib import Path

from collector.alerts.webhooks import body_for, headers, review_url, slack_message
from collector.config import Webhook, validate_config
from collector.system.runtime import RuntimeInfo

BODY = {"id": "a1", "type": "failure_rate", "at": "2026-03-01T12:00:00Z", "state": "open", "criterion": "red-flags",
        "monitor": "failure_rate:red-flags", "value": 0.031, "above": 0.02, "window": "1h"}


def test_a_slack_message_says_what_the_body_says_and_lets_no_text_ping_or_link() -> None:
    msg = slack_message({**BODY, "conversation_id": "<!channel> <https://evil.example|click> & co",
                         "evidence": ["line one\nline <two>"], "reasoning": "x" * 5000})
    assert msg["text"] == ("tracejudge: Failure rate above its threshold: red-flags in conversation "
                           "&lt;!channel&gt; &lt;https://evil.example|click&gt; &amp; co")
    header, fields, reasoning, evidence, context = msg["blocks"]
    assert header["text"]["text"] == "Failure rate above its threshold: red-flags"
    assert [f["text"] for f in fields["fields"]] == [
        "*criterion*\nred-flags", "*monitor*\nfailure_rate:red-flags", "*value*\n0.031", "*above*\n0.02", "*window*\n1h",
        "*conversation_id*\n&lt;!channel&gt; &lt;https://evil.example|click&gt; &amp; co"]
    assert len(reasoning["text"]["text"]) == 3000 and reasoning["text"]["text"].endswith("…")
    assert evidence["text"]["text"] == "*evidence*\n> line one\n> line &lt;two&gt;"
    assert context["elements"][0]["text"] == "tracejudge alert a1 (open), fired 2026-03-01T12:00:00Z"
    gone = slack_message({**BODY, "severity": "high", "state": "resolved", "resolved_at": "2026-03-01T13:00:00Z"})
    assert gone["blocks"][0]["text"]["text"] == "Resolved: Failure rate above its threshold: red-flags"
    assert gone["blocks"][-1]["elements"][0]["text"].endswith(", resolved 2026-03-01T13:00:00Z")


def test_the_bytes_sent_are_the_bytes_signed_and_the_same_every_time() -> None:
    notice = json.dumps(BODY, separators=(",", ":"))
    plain, slack = Webhook(url="https://h.example/a", secret="k"), Webhook(url="https://h.example/b", format="slack")
    assert body_for(plain, notice) == notice.encode()
    assert body_for(slack, notice) == body_for(slack, notice)
    sent = headers(plain, "failure_rate", "a1", b'{"id":"a1"}')
    # printf '%s' '{"id":"a1"}' | openssl dgst -sha256 -hmac k
    assert sent["X-Tracejudge-Signature"] == "sha256=fe5a619cb0698f1a0537eb4143af02c5bf9a27fdc526e223339f5a277ca4a652"
    assert (sent["X-Tracejudge-Event"], sent["X-Tracejudge-Id"]) == ("failure_rate", "a1")
    assert "X-Tracejudge-Signature" not in headers(slack, "failure_rate", "a1", b"{}")


def test_the_review_url_is_where_the_api_listens(tmp_path: Path) -> None:
    cfg, _ = validate_config({"storage": {"duckdb": {"path": "t.duckdb"}}, "api": {"endpoint": "127.0.0.1:0"}},
                             tmp_path, "t", environ={})
    assert review_url(cfg, 17) == "http://127.0.0.1:0/review/17"  # not started: the endpoint as configured
    RuntimeInfo(pid=1, version="0", duckdb="t.duckdb", grpc=None, http=None, api="http://127.0.0.1:43117",
                started_at="").write(cfg.runtime_file)
    assert review_url(cfg, "17/x") == "http://127.0.0.1:43117/review/17%2Fx"
    RuntimeInfo(pid=1, version="0", duckdb="t.duckdb", grpc=None, http=None, api="https://[::]:8318",
                started_at="").write(cfg.runtime_file)
    host = review_url(cfg, 1).split("//")[1].split(":8318")[0]
    assert host and host != "[::]"  # a wildcard address is no place to go: the machine's name
