"""The env: section and loading env.factory: every mistake is a ConfigError naming the key, the value and the fix."""

from __future__ import annotations

import pytest

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import load_config
from asyncgrpo.environments.factories import load_factory
from asyncgrpo.environments.hosts import check_env, open_host
from asyncgrpo.environments.process_host import ProcessHost
from asyncgrpo.environments.thread_host import ThreadHost
from asyncgrpo.errors import ConfigError
from tests import envs


def test_no_reward_functions_need_an_environment_that_gives_a_reward():
    with pytest.raises(ConfigError, match=r"reward.functions is empty and no env: section"):
        load_config(None, ["reward.functions=[]"])
    with pytest.raises(ConfigError, match=r"env.reward_weight = 0"):
        load_config(None, ["reward.functions=[]", "env.factory=tests.envs:Counting", "env.reward_weight=0"])
    cfg = load_config(None, ["reward.functions=[]", "env.factory=tests.envs:Counting", "eval.every_steps=0"])
    assert cfg.env is not None and cfg.env.isolation == "thread" and cfg.env.observation_role == "user"


def test_env_keys_are_checked_with_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"env.max_turn: unknown key. Fix: did you mean env.max_turns\?"):
        load_config(None, ["env.factory=tests.envs:Counting", "env.max_turn=3"])
    with pytest.raises(ConfigError, match=r"env.max_turns = 0"):
        load_config(None, ["env.factory=tests.envs:Counting", "env.max_turns=0"])


def test_the_cancel_grace_fits_in_the_shutdown_bound():
    with pytest.raises(ConfigError, match=r"env.cancel_grace_s = 30 is not below run.shutdown_timeout_s = 30"):
        load_config(None, ["env.factory=tests.envs:Counting", "env.cancel_grace_s=30"])


def test_distillation_of_episodes_is_refused_until_the_teacher_scores_them():
    cfg = load_config(None, ["env.factory=tests.envs:Counting", "algorithm=distill", "rollout.group_size=1",
                             "rollout.min_group_survivors=1", "rollout.filter_zero_variance=false"])
    with pytest.raises(ConfigError, match=r"algorithm = 'distill' with an env: section"):
        algorithm_for(cfg)  # the algorithm's own rule, checked when it is built


@pytest.mark.parametrize(("spec", "message"), [
    ("no_colon", r"env.factory = 'no_colon' is not of the form module:callable"),
    ("tests.envs:Nope", r"env.factory = 'tests.envs:Nope': module 'tests.envs' has no attribute 'Nope'"),
    ("tests.envs:STARTED", r"is a Semaphore, not a class or function"),
    ("no_such_module_xyz:Env", r"env.factory = 'no_such_module_xyz:Env': module 'no_such_module_xyz' cannot be imported"),
])
def test_a_bad_factory_is_a_config_error_naming_it(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_factory(spec)


def test_hosts_follow_env_isolation():
    cfg = load_config(None, ["env.factory=tests.envs:Counting", "eval.every_steps=0"])
    assert load_factory("tests.envs:Counting") is envs.Counting
    assert isinstance(open_host(cfg.env), ThreadHost)
    process = load_config(None, ["env.factory=tests.envs:Counting", "env.isolation=process", "eval.every_steps=0"])
    check_env(process.env)
    assert isinstance(open_host(process.env), ProcessHost)
