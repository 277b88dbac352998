"""The whole loop, as a team runs it: a production failure, confirmed, exported as a scenario, shown to
reproduce against the bot, fixed, and the fix shown to fix it without breaking anything.

The real daemon takes real OTLP; the review, the export, the verification and the simulation are the CLI;
the simulated user is a loopback model spoken to through OpenAI's wire format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ..support.api_http import post_json
from ..support.daemon import run_cli
from ..support.review import CARRIER, carrier_conversation, send_conversations, start_daemon, wait_items
from ..support.roleplay import RolePlayModel

pytestmark = pytest.mark.slow  # it runs the whole loop from a failure to a fix


def test_production_failure_to_a_verified_fix(tmp_path: Path) -> None:
    model = RolePlayModel()
    incoming = tmp_path / "incoming"
    daemon = start_daemon(tmp_path, scenarios={"out_dir": str(incoming), "draft_with_provider": False},
                          simulate={"user": {"provider": {"type": "openai_compatible", "model": "user-sim",
                                                          "base_url": model.url + "/v1"}},
                                    "replicates": 3})
    config = str(daemon.config_path)
    try:
        # 1. Production traffic fails a criterion.
        send_conversations(daemon.grpc, [carrier_conversation("loop-1")])
        item, = [i for i in wait_items(daemon, {("loop-1", CARRIER)}) if i["criterion_id"] == CARRIER]
        # 2. A person confirms it.
        reply = post_json(daemon.api, f"/api/review/{item['id']}/decision", {"decision": "confirm",
                                                                            "reviewer": "Dr. Amal"})
        assert reply.status == 200, reply.body
        # 3. It becomes a scenario.
        exported = run_cli("scenarios", "export", "--json", "--config", config)
        assert exported.returncode == 0, exported.stderr
        written, = json.loads(exported.stdout)["written"]
        scenario_file = incoming / f"{written['id']}.yaml"
        # 4. It reproduces against the bot as it is.
        verified = run_cli("scenarios", "verify", "--bot", "tests.support.roleplay:broken",
                           "--out", str(tmp_path / "before"), "--json", "--config", config)
        assert verified.returncode == 0, verified.stderr
        found = yaml.safe_load(scenario_file.read_text())["source"]["reproduced"]
        assert found["criterion"] == CARRIER and found["failed"] == found["replicates"] == 3
        # 5. The bot is fixed; 6. the fix fixes it, and nothing broke.
        after = run_cli("simulate", str(incoming), "--bot", "tests.support.roleplay:fixed", "--out",
                        str(tmp_path / "after"), "--baseline", str(tmp_path / "before"), "--config", config)
        assert after.returncode == 0, after.stdout + after.stderr
        assert f"{written['id']}  fixed" in after.stdout and f"{CARRIER} 3/3 -> 0/3" in after.stdout, after.stdout
        report = json.loads((tmp_path / "after" / "report.json").read_text())
        assert report["summary"]["fixed"] == 1 and report["summary"]["broke"] == 0
        assert daemon.stop() == 0
    finally:
        daemon.end()
        model.close()
