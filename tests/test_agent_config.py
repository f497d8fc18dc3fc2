"""The agent's configuration (bubbles.agent.config): one frozen object, loaded from file, environment and flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from bubbles.agent.config import AgentConfig, ConfigError, load_settings
from bubbles.core.api import FillMode, IsolationMode

NO_FLAGS: dict[str, Any] = {}


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "agent.yaml"
    cfg_file.write_text("executors: 2\ngrace_ms: 20\ntraining: from-file\nmode: naive\nisolation: none\n")
    env = {"BUBBLES_AGENT_GRACE_MS": "30", "BUBBLES_TRAINING": "from-env"}
    s = load_settings({"grace_ms": 40.0, "run_dir": tmp_path}, env, cfg_file)
    assert s.config.executors == 2  # the file only
    assert s.config.grace_s == pytest.approx(0.040)  # the flag beats the environment and the file
    assert s.config.training == "from-env"  # the environment beats the file
    assert s.config.mode is FillMode.NAIVE and s.config.isolation.mode is IsolationMode.NONE
    s = load_settings({"run_dir": tmp_path}, env, cfg_file)
    assert s.config.grace_s == pytest.approx(0.030)


def test_defaults_and_the_two_names_of_metrics(tmp_path: Path) -> None:
    s = load_settings({"run_dir": tmp_path}, {})
    assert (s.config.executors, s.config.mode, s.config.grace_s, s.config.metrics) == (1, FillMode.HARVEST, 0.05, False)
    any_port = load_settings({"run_dir": tmp_path, "metrics_port": 0}, {}).config
    assert any_port.metrics and any_port.metrics_port == 0  # 0 now means "any free port", never "off"
    off = load_settings({"run_dir": tmp_path, "metrics_port": 9500, "metrics": False}, {}).config
    assert not off.metrics and off.metrics_port == 9500
    with pytest.raises(dataclasses.FrozenInstanceError):
        off.executors = 3  # type: ignore[misc]


def test_the_tail_risk_is_no_cap_unless_given_and_reaches_the_core(tmp_path: Path) -> None:
    assert load_settings({"run_dir": tmp_path}, {}).config.core().tail_risk is None  # the fill jobs' own
    s = load_settings({"run_dir": tmp_path}, {"BUBBLES_AGENT_TAIL_RISK": "0.05"})
    assert s.config.tail_risk == 0.05 and s.config.core().tail_risk == 0.05


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"executors": 0}, {}, "--executors must be >= 1"),
        ({"grace_ms": 0.0}, {}, "--grace-ms must be > 0"),
        ({"init_timeout": -5.0}, {}, "--init-timeout must be > 0 seconds"),
        ({"init_timeout": float("inf")}, {}, "at most a day"),
        ({"init_timeout": 1e7}, {}, "at most a day"),
        ({}, {"BUBBLES_AGENT_INIT_TIMEOUT": "soon"}, "--init-timeout from $BUBBLES_AGENT_INIT_TIMEOUT"),
        ({"slowdown_budget": 1.5}, {}, "--slowdown-budget must be a fraction in (0, 1)"),
        ({"tail_risk": 0.8}, {}, "--tail-risk must be the accepted chance"),
        ({"tail_risk": float("nan")}, {}, "from 0 (never start one) to 0.5"),
        ({}, {"BUBBLES_AGENT_TAIL_RISK": "low"}, "--tail-risk from $BUBBLES_AGENT_TAIL_RISK"),
        ({"metrics_port": 70000}, {}, "--metrics-port must be a TCP port"),
        ({"mode": "sometimes"}, {}, "--mode must be one of off, naive, harvest"),
        ({"training": "Bad_Name"}, {}, "training name 'Bad_Name' is not valid"),
        ({}, {"BUBBLES_AGENT_EXECUTORS": "two"}, "--executors from $BUBBLES_AGENT_EXECUTORS: invalid literal"),
        ({}, {"BUBBLES_AGENT_PIN_CORES": "maybe"}, "--pin-cores from $BUBBLES_AGENT_PIN_CORES: expected true or false"),
        ({"devices": "cuda:x"}, {}, "--devices entry 'cuda:x' is neither cpu nor cuda:N"),
        ({"mps_thread_percentage": 0}, {}, "--mps-thread-percentage must be 1..100"),
        ({}, {"BUBBLES_AGENT_MPS_DAEMON": "theirs"}, "--mps-daemon must be own or external, got 'theirs'"),
        ({"cuda_context_mib": -1}, {}, "--cuda-context-mib must be whole MiB from 0 to 16384"),
        ({}, {"BUBBLES_AGENT_CUDA_CONTEXT_MIB": "half"}, "--cuda-context-mib from $BUBBLES_AGENT_CUDA_CONTEXT_MIB"),
        ({}, {"BUBBLES_AGENT_EXIT_WHEN_DONE": "maybe"},
         "--exit-when-done from $BUBBLES_AGENT_EXIT_WHEN_DONE: expected true or false, got 'maybe'"),
        ({"start_timeout": 60.0}, {}, "--start-timeout only applies with --exit-when-done"),
        ({"exit_when_done": True, "start_timeout": 0.0}, {}, "--start-timeout must be > 0 seconds and at most a day"),
        ({"exit_when_done": True, "start_timeout": float("nan")}, {}, "--start-timeout must be > 0 seconds"),
        ({"exit_when_done": True}, {"BUBBLES_AGENT_START_TIMEOUT": "soon"},
         "--start-timeout from $BUBBLES_AGENT_START_TIMEOUT"),
        ({"exit_when_done": True, "cluster": True, "node": "n"}, {}, "--exit-when-done is for local mode"),
    ],
)
def test_bad_values_name_the_flag_and_their_source(tmp_path: Path, flags: dict[str, Any], env: dict[str, str],
                                                   needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings({"run_dir": tmp_path, **flags}, env)
    assert needle in str(err.value)


def test_exit_when_done_comes_from_every_source_and_reaches_the_core(tmp_path: Path) -> None:
    off = load_settings({"run_dir": tmp_path}, {}).config
    assert (off.exit_when_done, off.start_timeout_s, off.core().exit_when_done) == (False, None, False)
    f = tmp_path / "agent.yaml"
    f.write_text("exit_when_done: true\nstart_timeout: 90\n")
    cfg = load_settings({"run_dir": tmp_path}, {}, f).config
    assert (cfg.core().exit_when_done, cfg.core().start_timeout_s) == (True, 90.0)
    assert load_settings({"run_dir": tmp_path}, {"BUBBLES_AGENT_EXIT_WHEN_DONE": "yes"}).config.exit_when_done
    assert not load_settings({"run_dir": tmp_path, "exit_when_done": False}, {}).config.exit_when_done
    # --no-exit-when-done on the command line beats the file (then the file's start_timeout is refused: say so).
    with pytest.raises(ConfigError, match="--start-timeout only applies with --exit-when-done"):
        load_settings({"run_dir": tmp_path, "exit_when_done": False}, {}, f)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("executors: [1, 2]\n", "--executors in "),
        ("exit_when_done: sometimes\n", "--exit-when-done in "),
        ("colour: blue\n", "unknown key(s) colour; known keys:"),
        ("- executors\n", "must be a mapping"),
        ("executors: 2\n  bad indent: [\n", "not valid YAML"),
    ],
)
def test_a_bad_configuration_file_is_refused_with_the_fix(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings({"run_dir": tmp_path}, {}, f)
    assert needle in str(err.value)
    with pytest.raises(ConfigError, match="cannot read the agent configuration"):
        load_settings(NO_FLAGS, {}, tmp_path / "missing.yaml")


def test_the_config_is_self_validating_when_built_directly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--executors must be >= 1"):
        AgentConfig(run_dir=tmp_path, training="t", executors=0)
    cfg = AgentConfig(run_dir=tmp_path, training="t", executors=3, devices=("cuda:0", "cpu"), pin_cores=False)
    assert cfg.executor_devices() == (("cuda:0", None), ("cpu:1", None), ("cuda:0", None))
    assert cfg.core().executors == cfg.executor_devices() and cfg.core().guard.budget == cfg.budget
