"""An agent written against the OpenAI API, trained unchanged through ``rollstream gateway``.

What differs from the agent as it would run anywhere else is marked ``# rollstream``: it
opens an episode, points the ``openai`` client's ``base_url`` at that episode, and reports
the reward when it is done. The rest (messages, a tool, the loop) is the agent's own.

The task is ``rollstream up``'s default (``copy-first-digit-twice`` on the tiny model) or a
file task of three-digit chat prompts: the user says three digits, the assistant answers the
first one twice; the "tool" checks the answer and asks again; the reward scores both answers.

    python examples/gateway_agent.py --gateway http://127.0.0.1:8100 --api-key KEY --episodes 50

``--episodes 0`` plays until the gateway goes away (its run ended) once it has played one.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
import openai

RETRYABLE = (429, 503)
GONE = (httpx.TransportError, openai.APIConnectionError)
"""What a call to a gateway that has stopped listening raises."""
ENDED = (409, 503)
"""A call's answer when the gateway ended the episode: its limits, or the run stopping."""


def open_episode(
    http: httpx.Client,
    gateway: str,
    api_key: str,
    timeout_s: float = 600.0,
    wait_for_start: bool = True,
) -> dict[str, Any]:
    """Claim a slot of a group (``POST /v1/episodes``), waiting while generation is held
    back (429/503 with ``Retry-After``) or, with ``wait_for_start``, while the gateway is
    not up yet; without it, a gateway not listening raises ``httpx.TransportError``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = http.post(
                f"{gateway}/v1/episodes",
                headers={"Authorization": f"Bearer {api_key}"},
                timeout=60,
            )
            if answer.status_code == 201:
                return answer.json()
            if answer.status_code not in RETRYABLE:
                answer.raise_for_status()
            wait = float(answer.headers.get("Retry-After", "1"))
        except httpx.TransportError:  # not listening yet, restarting, or gone
            if not wait_for_start:
                raise
            wait = 1.0
        if time.monotonic() > deadline:
            raise TimeoutError(f"no episode from {gateway} within {timeout_s:g}s")
        time.sleep(wait)


def score(answer: str, digits: str) -> float:
    """Half for two digits, half for the right ones."""
    if len(answer) != 2 or not answer.isdigit():
        return 0.0
    return 0.5 + 0.5 * (answer == digits[0] * 2)


def first_messages(prompt: dict[str, Any], system_prompt: str) -> list[dict[str, Any]]:
    """The conversation an episode starts from: a file task's row (``metadata.example``),
    else the task's question as the user's message."""
    example = prompt["metadata"].get("example")
    messages = example["messages"] if example else [{"role": "user", "content": prompt["text"]}]
    return [{"role": "system", "content": system_prompt}, *messages]


def play(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> float:
    """The agent: answer, hear from the tool, answer again; the mean score of both."""
    digits = messages[-1]["content"]
    scores = []
    for turn in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        answer = reply.choices[0].message.content or ""
        scores.append(score(answer, digits))
        messages = [*messages, {"role": "assistant", "content": answer}]
        if turn == 0:  # the tool's answer, as the user's next message: the question again
            messages.append({"role": "user", "content": digits})
    return sum(scores) / len(scores)


def play_episode(
    http: httpx.Client,
    gateway: str,
    api_key: str,
    system_prompt: str,
    open_timeout_s: float = 600.0,
    wait_for_start: bool = True,
) -> float:
    """One episode from opening to reward; returns the reward. ``http`` is the agent's one
    connection pool, shared by its episodes' clients: a client of its own per episode
    would set up a new TLS context each time (about 30 ms of CPU)."""
    episode = open_episode(http, gateway, api_key, open_timeout_s, wait_for_start)  # rollstream
    client = openai.OpenAI(
        base_url=gateway + episode["base_url_path"],  # rollstream
        api_key=api_key,
        max_retries=0,
        http_client=http,
    )
    try:
        model = client.models.list().data[0].id  # the model the gateway serves
        reward = play(client, model, first_messages(episode["prompt"], system_prompt))
    except openai.APIError as exc:
        reason = {"reason": f"{type(exc).__name__}: {exc}"[:200]}
        http.post(
            f"{gateway}/v1/episodes/{episode['episode_id']}/abort",
            json=reason,
            headers={"Authorization": f"Bearer {api_key}"},
        )
        raise
    http.post(  # rollstream
        f"{gateway}/v1/episodes/{episode['episode_id']}/close",
        json={"reward": reward},
        headers={"Authorization": f"Bearer {api_key}"},
    ).raise_for_status()
    return reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8100")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--episodes", type=int, default=20, help="0: until the run ends")
    parser.add_argument("--system-prompt", default="copy the first digit twice")
    args = parser.parse_args()
    played = 0
    with httpx.Client(timeout=60) as http:
        while args.episodes == 0 or played < args.episodes:
            try:
                reward = play_episode(
                    http, args.gateway, args.api_key, args.system_prompt,
                    wait_for_start=played == 0,
                )  # fmt: skip
            except (openai.APIStatusError, httpx.HTTPStatusError) as exc:
                # a call (the openai client) or the close (httpx) answered that the
                # gateway ended the episode: the run stopping between the two, say
                status = exc.response.status_code
                if status not in ENDED:
                    raise
                played += 1
                print(f"episode {played}: ended by the gateway ({status})")
                continue
            except GONE:
                if args.episodes or not played:
                    raise
                print(f"the gateway went away after {played} episodes: its run ended")
                return
            played += 1
            print(f"episode {played}: reward {reward:.2f}")


if __name__ == "__main__":
    main()
