"""What an agent runner is handed: the session's URLs and key, nothing else of rollbus.

A runner talks to the model through ``base_url`` (OpenAI) or ``anthropic_base_url``
(Anthropic) with ``api_key``, and posts its reward to ``reward_url``
(``{"reward_info": {"reward": 1.0, ...}}``, the key as a bearer token). ``reward_info_url``
is the same URL under the name uni-agent runners use. A handle without a ``reward_url``
is the evaluation path: an external OpenAI-compatible server, no training records.
"""

from __future__ import annotations

import msgspec


class SessionHandle(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    base_url: str
    anthropic_base_url: str = ""
    reward_url: str = ""  # "": an external endpoint (evaluation): nothing to post a reward to
    api_key: str = ""

    @property
    def reward_info_url(self) -> str:
        return self.reward_url

    @property
    def records(self) -> bool:
        """Whether this session writes training records (a rollbus session, not an external URL)."""
        return bool(self.reward_url)

    @classmethod
    def external(cls, base_url: str, api_key: str = "EMPTY", *, session_id: str = "eval") -> SessionHandle:
        """An agent pointed at any OpenAI-compatible URL: the evaluation path."""
        return cls(session_id=session_id, base_url=base_url, api_key=api_key)
