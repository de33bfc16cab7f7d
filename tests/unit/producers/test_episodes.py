"""Multi-turn episodes in the producer: the runner's layout of turns, versions and
log-probs, every limit, every way a tool can fail (a clear reason, the worker alive,
nothing lost), and the calculator's parser fed garbage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.envs import BrokenEnvironment
from support.fake_engine import FakeBackend, FakePublisher

from core.models import BOS_ID, DIGIT0_ID, EOS_ID, SEP_ID
from producers.config import RolloutConfig, SamplingConfig
from producers.rollout.episodes import EpisodeResult, EpisodeRunner
from producers.rollout.publishing import Outbox, ProducerIdentity
from producers.rollout.worker import RolloutWorker
from producers.tasks.base import Prompt, TaskContext
from producers.tasks.catalog import make_task
from producers.tasks.environments import (
    CalculatorEpisode,
    EchoDigits,
    EpisodeLimits,
    MalformedToolCall,
    evaluate_expression,
)
from schemas.trajectory import EpisodeEnd, Trajectory, TurnKind
from schemas.validation import ValidationLimits, validate

pytestmark = pytest.mark.unit

CONTEXT = TaskContext(cache_dir=Path("/nonexistent"))


@dataclass
class Turn:
    response_ids: list[int]
    logprobs: list[float]
    segments: list[list[int]]
    finish_type: str = "stop"
    interruptions: int = 0


@dataclass
class ScriptedPolicy:
    """Answers each turn from a script; a turn may span two versions (an interruption)."""

    answers: list[list[int]]
    versions: list[list[int]] = field(default_factory=list)  # per turn: [v] or [v1, v2]
    histories: list[list[int]] = field(default_factory=list)
    delay_s: float = 0.0

    async def __call__(self, history: list[int], max_new_tokens: int, turn: int) -> Turn:
        self.histories.append(list(history))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        ids = self.answers[turn % len(self.answers)][:max_new_tokens]
        versions = self.versions[turn] if turn < len(self.versions) else [0]
        if len(versions) == 2 and len(ids) > 1:
            segments = [[versions[0], 1], [versions[1], len(ids) - 1]]
        else:
            segments = [[versions[0], len(ids)]]
        return Turn(ids, [-0.25] * len(ids), segments, interruptions=len(versions) - 1)


def digit(d: int) -> int:
    return DIGIT0_ID + d


def record(result: EpisodeResult, prompt: Prompt) -> Trajectory:
    """The record the worker builds from an episode."""
    return Trajectory.create(
        run_id="r",
        trajectory_id="g-0",
        group_id="g",
        group_size=1,
        sample_index=0,
        producer_id="p",
        region="local",
        task="t",
        prompt_ids=prompt.ids,
        **result.trajectory_fields(),
        reward_details=result.details,
        created_at_ms=1,
        finished_at_ms=2,
    )


def play(env, policy: ScriptedPolicy, limits: EpisodeLimits | None = None, prompt=None):
    prompt = prompt or env.sample(__import__("random").Random(0))
    runner = EpisodeRunner(env, limits or env.limits, vocab_size=16)
    result = asyncio.run(runner.run(prompt, policy))
    traj = record(result, prompt)
    assert validate(traj, ValidationLimits(vocab_size=16)) == []  # always publishable
    return result, traj, prompt


def test_a_perfect_echo_episode_alternates_turns_and_masks_the_environment() -> None:
    env = EchoDigits(turns=3)
    prompt = Prompt([BOS_ID, digit(4), SEP_ID], {"digits": [4, 7, 1]})

    class Echo(ScriptedPolicy):
        async def __call__(self, history, max_new_tokens, turn):
            self.histories.append(list(history))
            ids = [history[-2], EOS_ID]  # repeat the digit before the last SEP
            return Turn(ids, [-0.1, -0.2], [[turn, 2]])

    policy = Echo([])
    result, traj, _ = play(env, policy, prompt=prompt)
    assert result.end == EpisodeEnd.DONE and result.reward == pytest.approx(1.0)
    assert list(traj.turn_kinds) == [TurnKind.POLICY, TurnKind.ENV] * 2 + [TurnKind.POLICY]
    assert list(traj.turn_lengths) == [2] * 5
    assert list(traj.response_ids) == [
        digit(4), EOS_ID, digit(7), SEP_ID, digit(7), EOS_ID, digit(1), SEP_ID, digit(1), EOS_ID
    ]  # fmt: skip
    assert list(traj.loss_mask) == [1, 1, 0, 0] * 2 + [1, 1]
    assert [float(x) for x in traj.logp_infer[traj.loss_mask == 0]] == [0.0] * 4
    # the environment's tokens ride in the segment of the policy token before them
    assert list(traj.segment_versions) == [0, 1, 2]
    assert list(traj.segment_lengths) == [4, 4, 2]
    # every turn was sent the whole history
    assert policy.histories[2] == prompt.ids + list(traj.response_ids[:8])
    assert traj.reward_details["turns"] == 3 and traj.episode_end == "done"


def test_wrong_answers_score_partial_credit_and_a_turn_can_span_versions() -> None:
    env = EchoDigits(turns=2)
    prompt = Prompt([BOS_ID, digit(4), SEP_ID], {"digits": [4, 7]})
    policy = ScriptedPolicy([[digit(4), EOS_ID], [digit(2), digit(3), EOS_ID]], [[0], [0, 1]])
    result, traj, _ = play(env, policy, prompt=prompt)
    assert 0 < result.reward < 1 and result.interruptions == 1
    assert list(traj.segment_versions) == [0, 1]
    assert traj.reward_details["turns_correct"] == 1


@pytest.mark.parametrize(
    ("how", "end", "detail"),
    [
        ("raise", EpisodeEnd.TOOL_EXCEPTION, "RuntimeError: the tool crashed"),
        ("hang", EpisodeEnd.TOOL_TIMEOUT, "no observation within 0.2s"),
        ("flood", EpisodeEnd.OBSERVATION_TOO_LARGE, "100000 observation tokens, limit 256"),
        ("malformed", EpisodeEnd.MALFORMED_TOOL_CALL, "no closing tag"),
        ("bad_ids", EpisodeEnd.TOOL_EXCEPTION, "invalid"),
        ("text_ids", EpisodeEnd.TOOL_EXCEPTION, "observation token ids"),
        ("not_an_observation", EpisodeEnd.TOOL_EXCEPTION, "not an Observation"),
        ("nan_reward", EpisodeEnd.TOOL_EXCEPTION, "observation reward nan"),
    ],
)
def test_every_tool_failure_ends_the_episode_with_its_reason(
    how: str, end: EpisodeEnd, detail: str
) -> None:
    policy = ScriptedPolicy([[digit(1), EOS_ID]])
    result, traj, _ = play(BrokenEnvironment(how), policy)
    assert result.end == end and traj.episode_end == end.value
    assert detail in traj.reward_details["episode_end_detail"]
    # the first turn and its observation are kept; the failing call counted when made
    assert list(traj.turn_kinds) == [TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY]
    assert traj.reward == 0.5


def test_a_scoring_failure_gives_zero_reward_and_says_why() -> None:
    for how, key in (("bad_reward", "reward_error"), ("bad_details", "details_error")):
        env = BrokenEnvironment(how, limits=EpisodeLimits(max_turns=1))
        result, traj, _ = play(env, ScriptedPolicy([[digit(1)]]))
        assert key in traj.reward_details, how
        assert result.end == EpisodeEnd.MAX_TURNS


def test_limits_end_episodes_that_do_not_end_themselves() -> None:
    policy = ScriptedPolicy([[digit(1), digit(2), EOS_ID]])
    env = BrokenEnvironment("never_done")
    result, traj, _ = play(env, policy, EpisodeLimits(max_turns=3))
    assert result.end == EpisodeEnd.MAX_TURNS and traj.reward_details["turns"] == 3
    result, traj, _ = play(env, policy, EpisodeLimits(max_turns=50, max_total_tokens=10))
    assert result.end == EpisodeEnd.MAX_TOKENS and len(traj.response_ids) <= 10
    # 0.3 s a turn against 1 s: four calls at most, and a second one with 0.7 s to spare
    slow = ScriptedPolicy([[digit(1), EOS_ID]], delay_s=0.3)
    result, _, _ = play(env, slow, EpisodeLimits(max_turns=50, episode_timeout_s=1.0))
    assert result.end == EpisodeEnd.EPISODE_TIMEOUT and 2 <= len(slow.histories) <= 4


def test_garbage_tool_calls_never_reach_eval() -> None:
    assert evaluate_expression("(12 + 3) * 4") == 60
    assert evaluate_expression(" 7/2 ") == 3.5
    assert evaluate_expression("-3 - -4") == 1
    assert evaluate_expression("1,200 + 5") == 1205
    for garbage in (
        "__import__('os').system('true')",
        "2 ** 10 ** 10",
        "1/0",
        "",
        "9" * 200,
        "[1, 2]",
        "lambda: 1",
        "x + 1",
        "10**6 * 10**7",
        "'a' * 3",
        "(1 +",
        "1e999",
        "-1e999",
        "1e999 - 1e999",
        "0 * 1e999",
        "99999999999999",
    ):
        with pytest.raises(MalformedToolCall):
            evaluate_expression(garbage)


def test_the_calculator_answers_calls_and_ends_at_the_final_answer() -> None:
    texts = iter(["Let me compute <calc>12*7</calc>", "So. Answer: 84", "<calc>3+"])
    episode = CalculatorEpisode(84, lambda ids: next(texts))
    first = asyncio.run(episode.step([1]))
    assert first.text == "<result>84</result>\n" and first.tool_call and not first.done
    assert asyncio.run(episode.step([2])).done
    assert episode.reward() == (1.0, {**episode.reward()[1]}) and episode.calls == 1
    with pytest.raises(MalformedToolCall, match="closing"):
        asyncio.run(episode.step([3]))


def _worker(backend: FakeBackend, publisher: FakePublisher, task, **rollout) -> RolloutWorker:
    config = RolloutConfig.model_validate(
        {
            "group_size": 2,
            "seed": 0,
            "progress": False,
            "follow_weights": False,
            "ledger_fsync": False,
            "sampling": SamplingConfig(max_new_tokens=3, ignore_eos=True, stop_token_ids=[]),
            "episode": {"tool_timeout_s": 0.1},
            **rollout,
        }
    )
    return RolloutWorker(
        config,
        backend,
        task,
        Outbox(publisher),  # type: ignore[arg-type]
        ProducerIdentity(run_id="run", producer_id="p0", region="local"),
        vocab_size=16,
    )


@pytest.mark.parametrize("how", ["raise", "hang", "flood", "malformed"])
def test_a_failing_tool_never_stops_the_worker_and_every_episode_is_published(how: str) -> None:
    task = make_task("support.envs:broken", {"how": how}, CONTEXT)  # a user's, by dotted path
    backend, publisher = FakeBackend(), FakePublisher(auto_ack=True)
    worker = _worker(backend, publisher, task)
    report = asyncio.run(asyncio.wait_for(worker.run(groups=3), 30))
    assert report.groups_delivered == 3 and len(publisher.groups) == 3
    for group in publisher.groups:
        for traj in group:
            assert traj.episode_end != "" and traj.reward_details["episode_end_detail"]
            assert validate(traj, ValidationLimits(vocab_size=16)) == []
    # the episode limits of [producers.rollout.episode] override the environment's
    assert worker.episodes is not None and worker.episodes.limits.tool_timeout_s == 0.1
    # every turn is its own engine call with its own request id
    rids = [rid for call in backend.calls for rid in call]
    assert len(rids) == len(set(rids))


def test_echo_digits_is_a_registered_environment() -> None:
    env = make_task("echo-digits", {"turns": 4}, CONTEXT)
    assert isinstance(env, EchoDigits) and env.turns == 4
    with pytest.raises(ValueError, match="at least one turn"):
        make_task("echo-digits", {"turns": 0}, CONTEXT)


def test_a_version_change_mid_episode_interrupts_the_turn_and_tags_both_versions() -> None:
    async def scenario() -> tuple[FakeBackend, FakePublisher]:
        task = make_task("echo-digits", {"turns": 3}, CONTEXT)
        backend, publisher = FakeBackend(), FakePublisher(auto_ack=True)
        worker = _worker(backend, publisher, task, max_inflight_groups=1)
        backend.hold_after(4)  # the first group's two episodes parked in the middle of a turn
        run = asyncio.create_task(worker.run(groups=2))
        await backend.wait_generated(4)
        await worker.on_new_version(1, {})  # interrupt: abort, load, continue each turn
        backend.release()
        await asyncio.wait_for(run, 30)
        return backend, publisher

    backend, publisher = asyncio.run(scenario())
    assert backend.loaded == [1]
    first, second = publisher.groups
    for traj in first:
        assert validate(traj, ValidationLimits(vocab_size=16)) == []
        assert list(traj.segment_versions) == [0, 1]  # one episode, two policy versions
        assert traj.reward_details["interruptions"] >= 1
        assert list(traj.turn_kinds) == [TurnKind.POLICY, TurnKind.ENV] * 2 + [TurnKind.POLICY]
    for traj in second:
        assert list(traj.segment_versions) == [1]


def test_the_run_sampling_limit_never_lets_a_turn_overrun_the_room_left() -> None:
    task = make_task("echo-digits", {"turns": 3}, CONTEXT)
    backend, publisher = FakeBackend(), FakePublisher(auto_ack=True)
    sampling = SamplingConfig(max_new_tokens=50, ignore_eos=True, stop_token_ids=[])
    worker = _worker(backend, publisher, task, sampling=sampling, episode={"max_total_tokens": 5})
    asyncio.run(asyncio.wait_for(worker.run(groups=1), 30))
    for traj in publisher.groups[0]:
        assert len(traj.response_ids) <= 5  # 50 tokens a turn would have overrun it
        assert traj.episode_end == EpisodeEnd.MAX_TOKENS
