"""Multi-policy runs without services: each policy's view of the config, the record's
policy checked where it is scored, peer policies inside a producer, the propose-solve
task, and garbage at every new input (policy names, tables, peer samples, observations).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import tomllib
from pathlib import Path

import numpy as np
import pytest
from support.fake_engine import TOKEN, FakeBackend, FakePublisher
from support.streams import synthetic

from consumers.batching import pack
from core.config import ConfigurationError, merge_tables
from core.models import BOS_ID, DIGIT0_ID, EOS_ID, SEP_ID
from producers.config import RolloutConfig, SamplingConfig
from producers.rollout.credit import AdmissionCredit
from producers.rollout.episodes import EpisodeRunner
from producers.rollout.peers import PeerEngine, Peers
from producers.rollout.publishing import Outbox, ProducerIdentity
from producers.rollout.worker import RolloutWorker, WorkerLinks
from producers.tasks.base import Prompt, TaskContext
from producers.tasks.catalog import make_task
from producers.tasks.environments import EpisodeLimits, Observation
from producers.tasks.games import ProposeSolve, problem_form, problem_of
from producers.tasks.peers import PeerSample, PeerTurn
from rollstream.config.settings import RollstreamConfig, load_config, parse_assignments
from schemas.codec import decode, encode, routing_headers
from schemas.control import DeadLetter
from schemas.trajectory import EpisodeEnd
from schemas.validation import ValidationLimits, validate
from streams.config import StreamsConfig
from streams.processor import Message, Processor
from streams.staleness import VersionTracker
from weights.store import WeightStore

TWO_POLICIES = """
run_id = "mp"
[trainer.checkpoint]
dir = "/tmp/ckpt"
[trainer]
metrics_file = "/tmp/run/trainer.jsonl"
[policies.proposer.producers.rollout]
task = "propose-solve"
peers = ["solver"]
[policies.solver.streams.staleness]
max_staleness = 1
"""


def _config_file(tmp_path: Path, text: str = TWO_POLICIES) -> Path:
    path = tmp_path / "rollstream.toml"
    path.write_text(text)
    return path


# --- each policy's view ----------------------------------------------------------------------


def test_each_policy_gets_its_own_topics_groups_paths_and_settings(tmp_path: Path) -> None:
    path = _config_file(tmp_path)
    root = load_config(path)
    assert root.policy == "" and root.policy_names == ["proposer", "solver"]
    solver = load_config(path, policy="solver")
    proposer = load_config(path, policy="proposer")
    assert solver.policy == "solver" and solver.run_id == root.run_id == "mp"
    assert solver.producers.rollout.topic == "rollouts.raw.solver"
    assert solver.streams.topics.raw == "rollouts.raw.solver"
    assert solver.streams.topics.scored == solver.trainer.topics.scored == "rollouts.scored.solver"
    assert solver.streams.topics.dlq == "rollouts.dlq.solver"
    assert solver.weights.topic == solver.streams.topics.versions == "policy.versions.solver"
    assert solver.trainer.topics.versions == "policy.versions.solver"
    assert solver.presence.topic == "rollstream.roles.solver"
    assert solver.streams.app_id == f"{root.streams.app_id}-solver"
    assert solver.trainer.topics.group_id == f"{root.trainer.topics.group_id}-solver"
    assert str(solver.trainer.metrics_file) == "/tmp/run/trainer.solver.jsonl"
    assert str(solver.trainer.checkpoint.dir) == "/tmp/ckpt/solver"
    # a policy's own table: the solver's window, the proposer's task
    assert solver.streams.staleness.max_staleness == 1
    assert proposer.streams.staleness.max_staleness == root.streams.staleness.max_staleness
    assert proposer.producers.rollout.task == "propose-solve"
    assert proposer.producers.rollout.peers == ["solver"]
    assert solver.producers.rollout.peers == []
    # no name of one policy's data flow is another's
    names = {
        p: {s.name for s in load_config(path, policy=p).topic_specs()} for p in root.policy_names
    }
    assert names["proposer"].isdisjoint(names["solver"])
    assert {s.name for s in root.run_topic_specs()} == names["proposer"] | names["solver"]


def test_the_policy_can_be_named_by_the_environment(tmp_path, monkeypatch) -> None:
    path = _config_file(tmp_path)
    monkeypatch.setenv("ROLLSTREAM_POLICY", "solver")
    view = load_config(path)
    assert view.policy == "solver" and view.streams.topics.raw == "rollouts.raw.solver"


def test_a_single_policy_run_is_unchanged(tmp_path: Path) -> None:
    config = load_config(_config_file(tmp_path, 'run_id = "one"\n'))
    assert config.policy == "" and config.policy_names == [""]
    assert config.streams.topics.raw == "rollouts.raw" and config.weights.topic == "policy.versions"
    config.require_policy()  # nothing to name
    assert config.run_topic_specs() == config.topic_specs()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[policies."Bad Name"]\n', "policy name"),
        ("[policies.a-very-long-policy-name-over-thirty-two-chars]\n", "policy name"),
        ("[policies.solver]\nrun_id = 'other'\n", "may not set run_id"),
        ("[policies.solver]\npolicies = {}\n", "may not set policies"),
        ("policies = { solver = 3 }\n", "valid dictionary"),
    ],
)
def test_malformed_policy_tables_are_refused_with_the_reason(
    tmp_path: Path, table: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(_config_file(tmp_path, table))


def test_a_policy_table_with_a_bad_setting_fails_every_role_at_start(tmp_path: Path) -> None:
    path = _config_file(tmp_path, "[policies.solver.trainer]\nno_such_key = 1\n[policies.ok]\n")
    with pytest.raises(ConfigurationError, match=r"\[policies.solver\] is not valid"):
        load_config(path, policy="ok")  # any role of the run, not only the solver's


def test_unknown_policies_and_roles_without_one_are_refused(tmp_path: Path) -> None:
    path = _config_file(tmp_path)
    with pytest.raises(ConfigurationError, match=r"unknown policy 'critic'.*proposer, solver"):
        load_config(path, policy="critic")
    with pytest.raises(ConfigurationError, match="name the one to serve with"):
        load_config(path).require_policy()
    with pytest.raises(ValueError, match="already policy 'solver'"):
        load_config(path, policy="solver").view("proposer")


def test_each_policy_has_its_own_weight_lineage() -> None:
    assert WeightStore(None, "b", "run", policy="solver").run_prefix == "weights/run/solver/"
    assert WeightStore(None, "b", "run").run_prefix == "weights/run/"
    with pytest.raises(ValueError, match="no '/'"):
        WeightStore(None, "b", "run", policy="a/b")


# --- the record's policy, where it is scored -----------------------------------------------


def _processor(policy: str) -> Processor:
    config = StreamsConfig.model_validate({"old_logits": {"mode": "off"}})
    return Processor(config, "run", VersionTracker(), {}, served_policy=policy)


def _message(traj, offset: int = 0) -> Message:
    key = traj.group_id.encode()
    return Message("rollouts.raw", 0, offset, key, encode(traj), tuple(routing_headers(traj)))


def test_a_stream_never_scores_another_policys_record() -> None:
    processor = _processor("solver")
    theirs = dataclasses.replace(synthetic(group_id="g", group_size=2), policy="proposer")
    step = processor.handle(_message(theirs), 1_000_000)
    (dead,) = [DeadLetter.from_headers(s.headers) for s in step.sends]
    assert dead.reason == "foreign_policy" and "'proposer'" in dead.detail
    assert step.closings == [] and not [w for w in step.writes if w[0].startswith(b"s")]
    ours = dataclasses.replace(synthetic(group_id="h", group_size=2), policy="solver")
    step = processor.handle(_message(ours, 1), 1_000_000)
    assert not [s for s in step.sends if s.topic.endswith("dlq")]  # assembled, not rejected
    # the unnamed policy of a single-policy run is a policy too
    step = _processor("").handle(_message(theirs), 1_000_000)
    assert [DeadLetter.from_headers(s.headers).reason for s in step.sends] == ["foreign_policy"]


# --- the propose-solve task ----------------------------------------------------------------


def test_problem_form_and_problem_take_any_turn() -> None:
    d = DIGIT0_ID
    assert problem_form(3, 2, [d + 3, d + 7, EOS_ID]) == 1.0
    assert problem_form(3, 2, [d + 4, d + 7, EOS_ID]) == pytest.approx(2 / 3)
    assert problem_form(3, 2, []) == 0.0
    assert problem_form(3, 2, [SEP_ID, SEP_ID, SEP_ID, 99, -1]) == 0.0
    assert problem_form(3, 2, [EOS_ID, EOS_ID, EOS_ID]) == pytest.approx(1 / 3)
    assert problem_form(3, 2, [d + 3]) == pytest.approx(1 / 3)
    assert problem_of([d + 1, d + 2, d + 3, EOS_ID], 2) == [1, 2]
    assert problem_of([d + 1, SEP_ID, d + 3], 3) == [1]
    assert problem_of([BOS_ID, d + 1], 2) == []
    assert problem_of([], 2) == []


def test_propose_solve_needs_its_peer_and_sane_options(tmp_path: Path) -> None:
    context = TaskContext(cache_dir=tmp_path)
    with pytest.raises(ValueError, match="needs the peer policy 'solver'"):
        make_task("propose-solve", None, context)
    peers = Peers({"solver": _peer(FakeBackend())})
    with pytest.raises(ValueError, match=r"problem_digits must be 1\.\.6"):
        make_task("propose-solve", {"problem_digits": 0}, TaskContext(tmp_path, peers=peers))
    with pytest.raises(ValueError, match="needs the peer policy 'critic'"):
        make_task("propose-solve", {"solver": "critic"}, TaskContext(tmp_path, peers=peers))
    with pytest.raises(ConfigurationError, match="unknown option 'bogus'"):
        make_task("propose-solve", {"bogus": 1}, TaskContext(tmp_path, peers=peers))


def _peer(backend: FakeBackend, version: int = 0) -> PeerEngine:
    return PeerEngine(
        "solver",
        backend,
        SamplingConfig(ignore_eos=True, stop_token_ids=[]),
        staleness_window=2,
        wait_for_first_version=False,
        initial_version=version,
    )


def test_one_episode_gives_the_proposer_its_record_and_the_solver_its_sample() -> None:
    solver = _peer(FakeBackend(version=5), version=5)
    task = ProposeSolve(solver=solver)
    prompt = task.sample(random.Random(0))
    seed = prompt.meta["seed"]

    async def proposer_turn(history, max_new_tokens, turn):  # "seed 2 EOS": well formed
        return PeerTurn("x", 0, history, [DIGIT0_ID + seed, TOKEN, EOS_ID], [-0.1] * 3, "stop", 0)

    class Turn:
        def __init__(self, t: PeerTurn) -> None:
            self.response_ids, self.logprobs = t.response_ids, t.logprobs
            self.segments, self.finish_type, self.interruptions = [[0, 3]], "stop", 0

    async def generate(history, max_new_tokens, turn):
        return Turn(await proposer_turn(history, max_new_tokens, turn))

    result = asyncio.run(EpisodeRunner(task, task.limits, 16).run(prompt, generate))
    (sample,) = result.peer_samples
    assert sample.turn.policy == "solver" and sample.turn.version == 5
    problem = [seed, TOKEN - DIGIT0_ID]
    assert sample.turn.prompt_ids == [BOS_ID, *(DIGIT0_ID + p for p in problem), SEP_ID]
    # the fake engine writes TOKEN three times: right at the problem's 2nd digit only
    expected = (int(problem[0] == TOKEN - DIGIT0_ID) + 1) / 3
    assert sample.reward == pytest.approx(expected)
    assert result.details["form"] == 1.0 and result.details["solver_version"] == 5
    assert result.reward == pytest.approx((1.0 + expected) / 2)


class _Junk:
    """An episode whose peer samples and observations are garbage."""

    def __init__(self, observation: Observation, samples: object) -> None:
        self.observation, self.samples = observation, samples

    async def step(self, turn_ids):
        return self.observation

    def reward(self):
        return 0.5, {}

    def peer_samples(self):
        if isinstance(self.samples, Exception):
            raise self.samples
        return self.samples


class _JunkEnv:
    name = "junk"
    max_new_tokens = 2
    stop_token_ids = ()
    limits = EpisodeLimits(max_turns=2, max_total_tokens=32)

    def __init__(self, episode: _Junk) -> None:
        self.episode = episode

    def start(self, prompt):
        return self.episode

    def encode(self, text):
        return [1]


def _run(episode: _Junk):
    class Turn:
        response_ids, logprobs, segments = [DIGIT0_ID], [-0.1], [[0, 1]]
        finish_type, interruptions = "stop", 0

    async def generate(history, max_new_tokens, turn):
        return Turn()

    env = _JunkEnv(episode)
    return asyncio.run(EpisodeRunner(env, env.limits, 16).run(Prompt([BOS_ID]), generate))


@pytest.mark.parametrize(
    "samples",
    [
        ["not a sample"],
        [PeerSample(PeerTurn("solver", 0, [1], [2], [-0.1], "stop", 0), float("nan"))],
        [PeerSample(PeerTurn("solver", 0, [1], [2], [-0.1], "stop", 0), "1.0")],  # type: ignore[arg-type]
        RuntimeError("peer broke"),
        42,
    ],
)
def test_garbage_peer_samples_are_left_out_and_said(samples: object) -> None:
    result = _run(_Junk(Observation(done=True), samples))
    assert result.peer_samples == [] and "peer_error" in result.details
    assert result.reward == 0.5  # the episode itself is scored as usual


@pytest.mark.parametrize("policy", ["Bad Name", 7, "x" * 40, "a/b"])
def test_an_observation_naming_no_policy_ends_its_episode(policy: object) -> None:
    result = _run(_Junk(Observation(ids=[SEP_ID], policy=policy), []))  # type: ignore[arg-type]
    assert result.end == EpisodeEnd.TOOL_EXCEPTION and "policy" in result.end_detail


def test_a_peers_turn_in_the_history_is_named_in_the_record() -> None:
    steps = iter(
        [Observation(ids=[DIGIT0_ID + 1, SEP_ID], policy="solver"), Observation(done=True)]
    )

    class Episode(_Junk):
        async def step(self, turn_ids):
            return next(steps)

    result = _run(Episode(Observation(), []))
    fields = result.trajectory_fields("proposer")
    assert fields["turn_policies"] == ["proposer", "solver", "proposer"]
    assert result.trajectory_fields("proposer")["turn_kinds"] == [0, 1, 0]


# --- peers inside a producer ----------------------------------------------------------------


def _worker(
    backend: FakeBackend, solver: PeerEngine, publisher, peer_publisher, task=None
) -> RolloutWorker:
    config = RolloutConfig.model_validate(
        {
            "group_size": 4,
            "seed": 0,
            "progress": False,
            "follow_weights": False,
            "ledger_fsync": False,
            "sampling": SamplingConfig(ignore_eos=True, stop_token_ids=[]),
            "peers": ["solver"],
        }
    )
    return RolloutWorker(
        config,
        backend,
        task or ProposeSolve(solver=solver),
        Outbox(publisher, {"solver": peer_publisher}),
        ProducerIdentity(run_id="run", producer_id="p0", region="local", policy="proposer"),
        links=WorkerLinks(peers=Peers({"solver": solver})),
    )


def test_a_producer_publishes_each_policys_records_to_that_policy_only() -> None:
    solver = _peer(FakeBackend(version=3), version=3)
    own, theirs = FakePublisher(), FakePublisher()
    worker = _worker(FakeBackend(), solver, own, theirs)
    report = asyncio.run(asyncio.wait_for(worker.run(groups=3), 30))
    assert report.groups_delivered == 3 and len(own.groups) == len(theirs.groups) == 3
    for mine, peer in zip(own.groups, theirs.groups, strict=True):
        assert {t.policy for t in mine} == {"proposer"} and {t.policy for t in peer} == {"solver"}
        assert {t.group_id for t in peer} == {f"{mine[0].group_id}-solver"}
        assert all(t.segment_versions.tolist() == [3] for t in peer)  # the peer's version
        assert all(t.segment_versions.tolist() == [0] for t in mine)
        for record in [*mine, *peer]:
            assert validate(record, ValidationLimits()) == [] and decode(encode(record)) == record
        solved = [t.reward for t in peer]
        assert [t.reward_details["solver_score"] for t in mine] == solved


def test_a_peer_without_weights_or_credit_pauses_the_producer() -> None:
    solver = PeerEngine(
        "solver", FakeBackend(), SamplingConfig(), staleness_window=1, groups_per_version=1
    )
    assert "first version" in (solver.pause_reason() or "")
    solver.version = 0
    assert solver.pause_reason() is None
    solver.started()
    solver.started()
    assert "waiting for the trainer" in (solver.pause_reason() or "")


def test_admission_credit_settles_with_each_trained_version() -> None:
    credit = AdmissionCredit(groups_per_version=2)
    assert credit.pause(None, 1, 0) is None
    for _ in range(4):
        credit.started()
    assert credit.lead == 2.0 and credit.pause(None, 1, 0) is not None
    assert credit.pause(None, 1, 1) is None and credit.lead == 1.0  # one version trained


def test_root_config_round_trips_with_its_policies(tmp_path: Path) -> None:
    from rollstream.up.plan import write_config

    root = load_config(_config_file(tmp_path))
    write_config(root, tmp_path / "again.toml")
    again = tomllib.loads((tmp_path / "again.toml").read_text())
    assert RollstreamConfig.model_validate(again).policies == root.policies


def test_the_live_display_shows_every_policys_roles(tmp_path: Path) -> None:
    from rollstream.up.display import Dashboard, TrainerLog
    from rollstream.up.plan import plan_policies, policy_ports

    root = load_config(_config_file(tmp_path))
    logs = {}
    for name in root.policy_names:
        path = tmp_path / f"trainer.{name}.jsonl"
        path.write_text('{"step": 3, "version": 3, "reward/mean": 0.25}\n')
        logs[name] = TrainerLog(path)
    ports = policy_ports()
    assert ports["streams"]["metrics_port"] != ports["trainer"]["prometheus_port"]
    config = root.model_copy(
        update={"policies": {n: merge_tables(policy_ports(), t) for n, t in root.policies.items()}}
    )
    alive = {"trainer-proposer": "pid 1", "streams-solver": "exit 0", "producer-proposer": "pid 2"}
    rows = Dashboard(config, plan_policies(config), logs).rows(alive)
    by_role = {role: (state, figures) for role, state, figures in rows}
    assert by_role["trainer-solver"][0] == "-" and "reward 0.250" in by_role["trainer-solver"][1]
    assert by_role["streams-solver"][0] == "exit 0"
    assert "groups -" in by_role["producer-proposer"][1]  # its endpoint is not up: no figures
    assert "v-" in by_role["producer-proposer"][1] and "records -" in by_role["streams-solver"][1]
    assert "producer-solver" not in by_role  # generated inside the proposer's producer


def test_a_stopping_producer_says_in_each_peer_ledger_what_it_did(tmp_path: Path) -> None:
    from producers.rollout.ledger import Ledger, StopRecord, read_ledger
    from producers.rollout.metrics import ProducerMetrics
    from producers.rollout.peers import PeerSide

    ledger = Ledger(tmp_path / "solver", fsync=False).open()
    ledger.pending("a-solver", ["a-solver-0", "a-solver-1"])
    ledger.pending("b-solver", ["b-solver-0", "b-solver-1"])
    ledger.delivered("b-solver", ["b-solver-0", "b-solver-1"], [(0, 1), (0, 2)])
    side = PeerSide(None, "p0", ProducerMetrics(), stop=None)
    side.publishers["solver"] = FakePublisher(ledger=ledger)  # type: ignore[arg-type]
    side.stopped(StopRecord("finish", finished=["a", "b", "c"], aborted=["d"], unacknowledged=[]))
    ledger.close()
    (stop,) = read_ledger(tmp_path / "solver" / "ledger.jsonl").stops
    assert stop.policy == "finish" and stop.aborted == ["d-solver"]
    assert stop.finished == ["a-solver", "b-solver"]  # c's peer group was never published
    assert "a-solver" in stop.unacknowledged


def test_a_peer_engine_that_is_away_regenerates_the_group_instead_of_scoring_it() -> None:
    from producers.engine.client import EngineUnavailable

    class Flaky(FakeBackend):
        failures: int = 1

        async def generate(self, prompts, sampling, rids):
            if self.failures:
                self.failures -= 1
                raise EngineUnavailable("connection refused")
            return await super().generate(prompts, sampling, rids)

    solver = _peer(Flaky(version=2), version=2)
    own, theirs = FakePublisher(), FakePublisher()
    worker = _worker(FakeBackend(), solver, own, theirs)
    report = asyncio.run(asyncio.wait_for(worker.run(groups=1), 30))
    assert report.groups_delivered == 1 and worker.metrics.get("engine_errors_total") == 1
    (mine,) = own.groups
    assert all("tool_exception" not in str(t.reward_details) for t in mine)
    assert len(theirs.groups) == 1 and len(theirs.groups[0]) == 4  # every episode solved


def test_up_starts_every_role_of_every_policy_with_its_policy(tmp_path: Path) -> None:
    from rollstream.config.settings import UpConfig
    from rollstream.up.plan import Ports, build_config, role_specs, write_config

    up = UpConfig(producers=2, stream_workers=2, trainer_ranks=2)
    root = load_config(_config_file(tmp_path))
    config = build_config(root, up, "mp", tmp_path / "run", Ports.free())
    path = tmp_path / "run" / "rollstream.toml"
    write_config(config, path)
    specs = {spec.name: spec.argv for spec in role_specs(path, config, None)}
    policy_of = {
        **{f"streams-{p}{i}": p for p in ("proposer", "solver") for i in ("", "-1")},
        "trainer-proposer": "proposer",
        "trainer-solver": "solver",
        **{
            f"{kind}-proposer{i}": "proposer" for kind in ("engine", "producer") for i in ("", "-1")
        },
    }
    assert sorted(specs) == sorted(policy_of)  # the solver is generated in the proposer's
    ports: dict[str, int] = {}
    for name, argv in specs.items():
        assert argv[argv.index("--policy") + 1] == policy_of[name], name
        sets = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        view = load_config(path, policy=policy_of[name], **parse_assignments(sets))
        if name.startswith("streams"):
            ports[name] = int(view.streams.metrics_port or 0)
        elif name.startswith("producer"):
            ports[name] = int(view.producers.rollout.metrics_port or 0)
        elif name.startswith("trainer"):
            ports[name] = int(view.trainer.prometheus_port or 0)
            assert "torch.distributed.run" in argv
    assert all(ports.values()) and len(set(ports.values())) == len(ports)  # none shared


def test_set_on_the_command_line_wins_over_a_policy_table(tmp_path: Path) -> None:
    path = _config_file(tmp_path, TWO_POLICIES + "[policies.solver.streams]\nmetrics_port = 9400\n")
    assert load_config(path, policy="solver").streams.metrics_port == 9400
    view = load_config(path, policy="solver", streams={"metrics_port": 9401})
    assert view.streams.metrics_port == 9401


def test_a_policys_own_profile_holds_under_up(tmp_path: Path) -> None:
    from rollstream.config.settings import UpConfig
    from rollstream.up.plan import Ports, build_config, write_config

    text = TWO_POLICIES + '[policies.solver.profile]\nmodel = "tiny:num_layers=3"\n'
    by_hand = load_config(_config_file(tmp_path, text), policy="solver")
    root = load_config(_config_file(tmp_path, text))
    path = tmp_path / "run" / "rollstream.toml"
    write_config(build_config(root, UpConfig(), "mp", tmp_path / "run", Ports.free()), path)
    under_up = load_config(path, policy="solver")
    for view in (by_hand, under_up):
        assert view.producers.engine.model == "tiny:num_layers=3"
        assert view.streams.old_logits.model == view.trainer.model.spec == "tiny:num_layers=3"
    assert load_config(path, policy="proposer").producers.engine.model == "tiny"


@pytest.mark.parametrize(
    ("peers", "message"),
    [
        ({"a": ["b"], "b": ["a"]}, "none drives an episode"),
        ({"a": ["a"], "b": []}, "peers names a"),
        ({"a": ["critic"], "b": []}, "peers names critic"),
    ],
)
def test_peers_must_be_other_policies_and_one_must_drive(
    tmp_path: Path, peers: dict, message: str
) -> None:
    text = "".join(
        f"[policies.{name}.producers.rollout]\npeers = {list(called)!r}\n".replace("'", '"')
        for name, called in peers.items()
    )
    with pytest.raises(ConfigurationError, match=message):
        load_config(_config_file(tmp_path, text))


def test_a_policy_may_not_look_like_a_version_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="looks like a weight version"):
        load_config(_config_file(tmp_path, "[policies.v0000000001]\n"))


def test_commands_that_need_one_policy_say_so(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from rollstream.cli.main import main

    path = _config_file(tmp_path)
    runner = CliRunner()
    for argv in (["weights", "ls"], ["stream", "--check"], ["train", "--dry-run"], ["up"]):
        policy = ["--policy", "solver"] if argv == ["up"] else []
        result = runner.invoke(main, ["--config", str(path), *policy, *argv])
        assert result.exit_code != 0, argv
        assert "policy" in result.output.lower(), (argv, result.output)
    result = runner.invoke(main, ["--config", str(path), "--policy", "solver", "stream", "--check"])
    assert result.exit_code == 0 and "rollouts.raw.solver" in result.output


def test_credit_rule_is_the_one_the_worker_had() -> None:
    """``AdmissionCredit`` against the worker's inline rule before it moved out."""
    from schemas.control import VersionAnnouncement

    def old_rule(state: dict, configured, trainer, window: int, version: int):
        share = configured
        if share is None and trainer is not None and trainer.groups_per_step is not None:
            share = trainer.groups_per_step / max(1, trainer.producers or 1)
        state["share"] = share
        if share is None:
            return None
        trained = max(trainer.version, version) if trainer is not None else version
        if state["settled"] is None:
            state["settled"] = trained
        elif trained > state["settled"]:
            state["lead"] = max(0.0, state["lead"] - (trained - state["settled"]))
            state["settled"] = trained
        behind = trained - version
        return state["lead"] + behind >= window + 1 - 1e-9

    rng = random.Random(7)
    for configured in (None, 1, 3):
        credit, state = AdmissionCredit(configured), {"lead": 0.0, "share": None, "settled": None}
        trained = engine = 0
        for _ in range(300):
            trained += rng.random() < 0.3
            engine = min(trained, engine + (rng.random() < 0.5))
            producers = rng.choice([None, 1, 2, 3])
            trainer = None
            if rng.random() < 0.8:
                trainer = VersionAnnouncement(
                    run="run",
                    version=trained,
                    uri="s3://b/k",
                    parent=None,
                    base=trained,
                    sha256="0" * 64,
                    bytes=1,
                    published_at_ms=1,
                    groups_per_step=rng.choice([None, 4, 8]),
                    producers=producers,
                )
            window = rng.choice([0, 1, 2])
            paused = credit.pause(trainer, window, engine) is not None
            assert paused == bool(old_rule(state, configured, trainer, window, engine))
            assert credit.lead == state["lead"]
            if not paused and rng.random() < 0.7:
                credit.started()
                if state["share"] is not None:
                    state["lead"] += 1 / state["share"]


def test_multi_agent_rounds_name_the_peers_turns_in_the_drivers_record() -> None:
    solver = _peer(FakeBackend(version=1), version=1)
    own, theirs = FakePublisher(), FakePublisher()
    task = make_task(
        "propose-solve",
        {"rounds": 2},
        TaskContext(Path("/nonexistent"), peers=Peers({"solver": solver})),
    )
    worker = _worker(FakeBackend(), solver, own, theirs, task)
    worker.generator.episodes = EpisodeRunner(task, task.limits, 16)
    report = asyncio.run(asyncio.wait_for(worker.run(groups=1), 30))
    assert report.groups_delivered == 1
    (mine,) = own.groups
    (peer,) = theirs.groups
    assert len(peer) == 2 * len(mine)  # one solver answer per round of every episode
    for record in mine:
        assert record.turn_policies == ("proposer", "solver", "proposer")
        assert record.turn_kinds.tolist() == [0, 1, 0]
        assert record.reward_details["rounds_played"] == 2
        assert validate(record, ValidationLimits()) == [] and decode(encode(record)) == record
    # in the proposer's training batch the solver's turn is context only: no loss on it
    batch = pack([dataclasses.replace(record, advantage=1.0) for record in mine])
    for row, record in enumerate(mine):
        owners = np.repeat(np.array(record.turn_policies), record.turn_lengths)
        trained = batch.loss_mask[row, : record.num_response_tokens].numpy()
        assert (owners == "solver").any()
        assert np.array_equal(trained, owners == "proposer")
    assert sorted(s.reward_details["round"] for s in peer) == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match=r"rounds must be 1\.\.4"):
        make_task("propose-solve", {"rounds": 9}, TaskContext(Path("/x"), peers=solver_peers()))


def solver_peers() -> Peers:
    return Peers({"solver": _peer(FakeBackend())})


def test_peer_samples_of_no_peer_are_dropped_and_a_missing_group_refunds_credit() -> None:
    from producers.rollout.episodes import EpisodeResult

    solver = _peer(FakeBackend(version=1), version=1)
    solver.credit.groups_per_version = 1
    assert solver.pause_reason() is None
    worker = _worker(FakeBackend(), solver, FakePublisher(), FakePublisher())
    solver.started()
    assert solver.credit.lead == 1.0

    def sample(policy: str) -> PeerSample:
        return PeerSample(
            PeerTurn(policy, 1, [BOS_ID, SEP_ID], [DIGIT0_ID], [-0.1], "stop", 0), 1.0
        )

    episodes = [
        EpisodeResult(peer_samples=[sample("critic"), sample("proposer")]) for _ in range(2)
    ]
    assert worker.records.peer_groups(episodes, "g", 0) == []
    dropped = worker.metrics.registry.get_sample_value(
        "rollstream_producer_peer_samples_dropped_total", {"policy": "unknown"}
    )
    assert dropped == 4
    assert solver.credit.lead == 0.0  # no solver group came of it: the charge is back
    episodes = [EpisodeResult(peer_samples=[sample("solver")]) for _ in range(3)]
    ((policy, group_id, records),) = worker.records.peer_groups(episodes, "g", 0)
    assert policy == "solver" and group_id == "g-solver" and len(records) == 3
