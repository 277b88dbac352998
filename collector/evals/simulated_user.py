"""Who played the user of a simulated conversation, and the built-in criterion people judge it on.

``tracejudge simulate`` records its simulated user in each conversation's
``attributes.simulated_user`` (provider, model, prompt_sha256, temperature).
A sample of the imported ones become blind labelling tasks of ``REALISM``
(``collector.review.calibration.choose_simulated``), and the labels count for
that identity only (``collector.review.realism``): a new model, prompt or
temperature needs new labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REALISM = "simulated_user_realistic"
"""The built-in criterion people label simulated conversations on: does the simulated user read like a real
user? No judge runs it, and its calibration items are simulated conversations' (their own id space). Criteria
files' ids are kebab-case (docs/criteria.md): none can take this one."""


@dataclass(frozen=True)
class SimulatedUser:
    """Who played the user of a simulated conversation: ``attributes.simulated_user``'s ``provider``, ``model``,
    ``prompt_sha256`` and ``temperature``. Realism labels hold for one identity: all four must match."""

    provider: str
    model: str
    prompt_sha256: str
    temperature: float | None
    """None: none was sent (Anthropic's Messages API takes none on current models)."""

    @classmethod
    def of(cls, value: Any) -> SimulatedUser:
        """The identity in a mapping (extra keys ignored).

        Raises:
            ValueError: not a mapping, a key missing or empty, or a temperature that is neither a number nor null.
        """
        if not isinstance(value, dict):
            raise ValueError("a simulated user is an object with provider, model, prompt_sha256 and temperature")
        missing = [k for k in ("provider", "model", "prompt_sha256") if not isinstance(value.get(k), str)
                   or not value[k].strip()]
        if missing:
            raise ValueError(f"the simulated user's {', '.join(missing)} must be given, as non-empty text")
        if "temperature" not in value:
            raise ValueError("the simulated user's temperature must be given (null when none was sent)")
        temperature = value["temperature"]
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
            raise ValueError(f"the simulated user's temperature must be a number or null, not {temperature!r}")
        return cls(value["provider"], value["model"], value["prompt_sha256"],
                   None if temperature is None else float(temperature))

    @classmethod
    def of_record(cls, attributes: Any) -> SimulatedUser | None:
        """The identity in a record's ``attributes``; None when it carries none (or an incomplete one, which no
        identity could ever match)."""
        try:
            return cls.of(attributes.get("simulated_user")) if isinstance(attributes, dict) else None
        except ValueError:
            return None

    def to_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "model": self.model, "prompt_sha256": self.prompt_sha256,
                "temperature": self.temperature}
