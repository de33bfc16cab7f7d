"""An agent whose reward depends on its tool's result, for the gateway's learning test.

Asked about three digits, the model may call ``lookup``, whose result (a digit drawn for
the episode: a reading only the tool knows) it then answers with; or it answers at once.
The reward is 1 for answering the reading and 0 otherwise, so an answer of the right
format earns nothing by itself: without the tool, or ignoring its result, a policy is
right one time in ten (``BLIND_REWARD``). The agent is written against the ``openai``
client only, as any agent would be.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

DIGITS = "0123456789"
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The reading asked about.",
        "parameters": {"type": "object", "properties": {}},
    },
}
BLIND_REWARD = 0.1
"""The mean reward of any policy that does not answer with the tool's result."""
CONTENT_BAR = 0.6
"""The learning test's bar on the mean reward of the last steps: six times what a policy
blind to the tool's result earns, and above what the first ten steps earn (about 0.5)."""


@dataclass(frozen=True)
class ToolEpisode:
    """What an episode came to: its reward, and whether the model called the tool."""

    reward: float
    called: bool


def score(answer: str | None, reading: str) -> float:
    return 1.0 if (answer or "").strip() == reading else 0.0


def play(client: Any, model: str, question: str, rng: random.Random) -> ToolEpisode:
    """One episode with ``client`` (an ``openai.OpenAI`` for the episode's base URL)."""
    reading = rng.choice(DIGITS)  # drawn before the model says anything
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=[LOOKUP_TOOL], max_tokens=8
    )
    message = reply.choices[0].message
    if not message.tool_calls:
        return ToolEpisode(score(message.content, reading), called=False)
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": reading})
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=[LOOKUP_TOOL], max_tokens=2
    )
    return ToolEpisode(score(reply.choices[0].message.content, reading), called=True)
