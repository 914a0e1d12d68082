"""The Python API's config: recipes, dicts, TRL's names and Python objects become one validated config."""

from __future__ import annotations

import functools
import logging
import signal
from pathlib import Path

import datasets
import pytest

from asyncgrpo import objects
from asyncgrpo.api import Trainer
from asyncgrpo.api_config import build_config
from asyncgrpo.config import load_config
from asyncgrpo.data.loading import read_rows
from asyncgrpo.environments.factories import load_factory
from asyncgrpo.errors import ConfigError
from asyncgrpo.rewards.resolve import resolve_reward
from asyncgrpo.tasks import repeat_letter_reward
from asyncgrpo.training.resume import plan_resume
from tests.unit.test_resume_plan import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": "say a: ", "letter": "a"}, {"prompt": "say b: ", "letter": "b"}]


def local_reward(prompts, completions, **kwargs):
    return [1.0 for _ in completions]


local_reward.__module__ = "__main__"  # as if defined in a script or a notebook


def test_a_recipe_dotted_overrides_and_sections_layer_like_the_cli():
    prepared = build_config(ROOT / "recipes/demo.yaml", overrides={"train.max_steps": 7, "rollout": {"group_size": 4}})
    cli = load_config(ROOT / "recipes/demo.yaml", ["train.max_steps=7", "rollout.group_size=4"])
    assert prepared.config == cli and prepared.objects == {}


def test_trainer_takes_trls_argument_names_and_trl_config_fields():
    trainer = Trainer(model="builtin:tiny", reward_funcs="builtin:repeat_letter", args={"num_generations": 4, "learning_rate": 1e-4},
                      reward_weights=[2.0], config={"run.name": "t"})
    cfg = trainer.config
    assert cfg.model.path == "builtin:tiny" and cfg.rollout.group_size == 4 and cfg.train.lr == 1e-4
    assert cfg.reward.functions == ["builtin:repeat_letter"] and cfg.reward.weights == [2.0]


def test_a_bad_key_is_the_clis_config_error():
    with pytest.raises(ConfigError, match="rollout.grup_size"):
        Trainer(**{"rollout.grup_size": 4})


def test_a_simulator_key_at_its_old_place_names_its_new_one_in_every_form_a_caller_passes():
    for config, overrides in (({"train": {"step_time_s": 2.0}}, None), (None, {"train.step_time_s": 2.0})):
        with pytest.raises(ConfigError, match=r"train\.step_time_s moved to simulate\.step_time_s\. Fix: rename it"):
            build_config(config, overrides=overrides)
    assert build_config(overrides={"simulate.step_time_s": 2.0}).config.simulate.step_time_s == 2.0


def test_a_key_given_by_a_named_argument_and_an_override_is_refused():
    with pytest.raises(ConfigError, match="model.path is given twice"):
        build_config(model="builtin:tiny", overrides={"model.path": "builtin:tiny"})


def test_a_model_object_is_refused_with_how_to_pass_it():
    with pytest.raises(ConfigError, match="save_pretrained"):
        build_config(model=object())


def test_an_importable_function_is_named_by_its_import_path_and_keeps_process_isolation():
    prepared = build_config(reward_funcs=[repeat_letter_reward])
    assert prepared.config.reward.functions == ["asyncgrpo.tasks:repeat_letter_reward"]
    assert prepared.config.reward.isolation == "process" and prepared.objects == {}


def test_a_scripts_function_a_lambda_and_a_partial_are_registered_and_run_in_threads():
    weighted = functools.partial(local_reward)
    prepared = build_config(reward_funcs=[local_reward, lambda prompts, completions, **kw: [0.0] * len(completions), weighted])
    specs = prepared.config.reward.functions
    assert specs == ["python:local_reward", "python:reward_1", "python:local_reward_2"]
    assert prepared.config.reward.isolation == "thread"
    with objects.registered(prepared.objects):
        assert resolve_reward(specs[0], 0) == ("local_reward", local_reward)
        assert resolve_reward(specs[2], 2)[1] is weighted
    assert objects._table == {}  # nothing left registered after the block


def test_process_isolation_with_a_scripts_function_names_the_function_and_the_fix():
    with pytest.raises(ConfigError) as info:
        build_config(reward_funcs=[local_reward], overrides={"reward.isolation": "process"})
    message = str(info.value)
    assert "local_reward" in message and "reward.isolation: thread" in message


def test_an_environment_factory_class_from_a_script_works_in_threads_and_not_in_processes():
    class Env:
        def reset(self, row):
            return "hi"

    prepared = build_config(environment_factory=Env)
    assert prepared.config.env is not None and prepared.config.env.factory == "python:Env"
    with objects.registered(prepared.objects):
        assert load_factory("python:Env") is Env
    with pytest.raises(ConfigError, match="env.isolation: thread"):
        build_config(environment_factory=Env, overrides={"env.isolation": "process"})


def test_a_python_name_outside_its_run_is_a_config_error_with_the_fix():
    with pytest.raises(ConfigError, match="exists only in the process that passed it"):
        resolve_reward("python:local_reward", 0)
    with pytest.raises(ConfigError, match="data.source = 'python:train_dataset@"):
        read_rows("python:train_dataset@0123", builtin_size=1, seed=0)


def test_a_dataset_and_the_same_rows_as_a_list_have_one_fingerprint_and_read_back_as_given():
    from_list = build_config(train_dataset=ROWS).config.data.source
    from_dataset = build_config(train_dataset=datasets.Dataset.from_list(ROWS))
    assert from_list.startswith("python:train_dataset@") and from_dataset.config.data.source == from_list
    assert build_config(train_dataset=ROWS[:1]).config.data.source != from_list
    with objects.registered(from_dataset.objects):
        assert read_rows(from_list, builtin_size=1, seed=0) == ROWS


def test_data_that_is_not_rows_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"train_dataset\[1\] is a str"):
        build_config(train_dataset=[{"prompt": "x"}, "y"])
    with pytest.raises(ConfigError, match=r"ds\['train'\]"):
        build_config(train_dataset=datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}))


def test_a_resume_with_other_rows_is_refused_naming_the_data(tmp_path):
    first = build_config(train_dataset=ROWS, overrides={"run.output_dir": str(tmp_path)}).config
    make_checkpoint(tmp_path, 2, [f"data.source={first.data.source}"])
    assert plan_resume(first).step == 2  # the same rows continue
    other = build_config(train_dataset=ROWS[:1], overrides={"run.output_dir": str(tmp_path)}).config
    with pytest.raises(ConfigError) as info:
        plan_resume(other)
    assert "data.source" in str(info.value) and "rows passed to the Python API differ" in str(info.value)


def test_a_runs_console_handler_is_there_for_the_run_only_and_only_when_logging_is_not_configured(monkeypatch):
    from asyncgrpo.commands.run_training import console_logging

    logger = logging.getLogger("asyncgrpo")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logger, "handlers", [])
    level = logger.level
    with console_logging():
        assert len(logger.handlers) == 1 and logger.level == logging.INFO
    assert logger.handlers == [] and logger.level == level
    configured = logging.StreamHandler()
    monkeypatch.setattr(logging.getLogger(), "handlers", [configured])
    with console_logging():
        assert logger.handlers == []  # the process's own logging configuration is left alone


def test_a_trl_config_object_converts_through_its_to_dict():
    class GRPOConfig:  # the shape of trl.GRPOConfig that the API relies on
        def to_dict(self):
            return {"num_generations": 4, "max_steps": 9, "use_vllm": False}

    cfg = build_config(args=GRPOConfig()).config
    assert cfg.rollout.group_size == 4 and cfg.train.max_steps == 9
    with pytest.raises(ConfigError, match="not TRL's GRPOConfig"):
        build_config(args=42)


def test_trls_names_as_keyword_arguments_get_the_validators_hint():
    with pytest.raises(ConfigError, match="rollout.group_size"):
        Trainer(num_generations=4)


def test_objects_given_as_config_values_are_named_as_by_the_named_arguments():
    prepared = build_config({"reward": {"functions": [local_reward]}}, overrides={"data.source": ROWS})
    assert prepared.config.reward.functions == ["python:local_reward"] and prepared.config.reward.isolation == "thread"
    assert prepared.config.data.source == build_config(train_dataset=ROWS).config.data.source


def test_repeated_stop_requests_cancel_the_pipeline_once():
    """A second cancel would interrupt the wait for the step in progress and cancel it after its update, before its metrics line."""
    from asyncgrpo.commands.train import Stop

    class Pipeline:
        cancels = 0

        def done(self):
            return False

        def cancel(self):
            self.cancels += 1

    stop = Stop(pipeline=Pipeline())  # type: ignore[arg-type]
    stop.request(signal.SIGINT)
    stop.request(signal.SIGINT)
    assert stop.pipeline.cancels == 1 and stop.received == [signal.SIGINT, signal.SIGINT]
