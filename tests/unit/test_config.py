"""Config errors name the dotted key, the value, the limit and the fix; overrides parse as YAML."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import MOVED, Config, at_new_places, load_config, parse_overrides, tolerance_warnings
from asyncgrpo.errors import ConfigError

RECIPES = sorted(Path(__file__).resolve().parents[2].joinpath("recipes").glob("*.yaml"))


def error_of(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_defaults_are_valid():
    cfg = load_config(None)
    assert cfg.rollout.group_size == 8 and cfg.rollout.max_staleness == 1


def test_overrides_are_parsed_as_yaml_and_nest():
    assert parse_overrides(["train.max_steps=5", "a.b.c=true", "x=[1, 2]", "s=hello"]) == {
        "train": {"max_steps": 5},
        "a": {"b": {"c": True}},
        "x": [1, 2],
        "s": "hello",
    }
    cfg = load_config(None, ["train.max_steps=5", "train.loss.clip_high=0.3"])
    assert cfg.train.max_steps == 5 and cfg.train.loss.clip_high == 0.3


def test_a_misspelled_key_suggests_the_right_one():
    message = error_of("rollout.grup_size=4")
    assert "rollout.grup_size: unknown key" in message and "did you mean rollout.group_size?" in message


def test_an_out_of_range_value_names_key_value_and_limit():
    message = error_of("rollout.groups_per_step=0")
    assert "rollout.groups_per_step = 0" in message and "greater than or equal to 1" in message and "Fix:" in message


def algorithm_error_of(*overrides: str) -> str:
    """The error of building the recipe's algorithm, which checks the recipe against the algorithm's own rules."""
    with pytest.raises(ConfigError) as info:
        algorithm_for(load_config(None, list(overrides)))
    return str(info.value)


def test_group_size_one_is_for_distillation_only():
    message = algorithm_error_of("rollout.group_size=1", "rollout.min_group_survivors=1")
    assert "rollout.group_size = 1: GRPO compares the completions of a group" in message
    assert "rollout.min_group_survivors = 1" in message and "algorithm: distill" in message
    cfg = load_config(None, ["algorithm=distill", "rollout.group_size=1", "rollout.min_group_survivors=1"])
    assert cfg.algorithm == "distill" and cfg.stall_timeout_s > cfg.distill.timeout_s
    message = algorithm_error_of("algorithm=distill")
    assert "algorithm = 'distill' makes each sample its own unit, but rollout.group_size = 8, rollout.min_group_survivors = 2" in message
    assert "Fix: set rollout.group_size: 1 and rollout.min_group_survivors: 1" in message


def test_a_wrong_type_names_key_and_value():
    message = error_of("generation.temperature=hot")
    assert "generation.temperature = 'hot'" in message and "valid number" in message


def test_survivors_above_group_size_is_inconsistent():
    message = error_of("rollout.group_size=4", "rollout.min_group_survivors=5")
    assert "rollout.min_group_survivors = 5 exceeds rollout.group_size = 4" in message
    assert "at most 4" in message


def test_weight_sync_slower_than_the_staleness_bound_is_rejected():
    message = error_of("rollout.max_staleness=1", "generation.weight_sync_every=3")
    assert "generation.weight_sync_every = 3" in message and "<= 2" in message


def test_every_problem_is_reported_at_once():
    message = error_of("rollout.groups_per_step=0", "train.lr=-1", "bogus=1")
    assert "3 config problems" in message


def test_bad_override_syntax_and_missing_recipe():
    assert "dotted.key=value" in error_of("train.max_steps")
    message = error_of(path="does/not/exist.yaml")
    assert "does/not/exist.yaml does not exist" in message


def test_a_recipe_that_is_not_a_mapping(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("- a\n- b\n")
    assert "must be a mapping" in error_of(path=recipe)


def test_the_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["train.max_steps=7"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


@pytest.mark.parametrize("text", ["", "# only a comment\n\n# and another\n", "{}\n"])
def test_an_empty_recipe_warns_that_every_key_is_at_its_default(tmp_path, caplog, text):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text(text)
    with caplog.at_level("WARNING", logger="asyncgrpo"):
        assert load_config(recipe) == load_config(None)
    (record,) = caplog.records
    assert str(recipe) in record.getMessage() and "every key is at its default" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncgrpo"):
        load_config(recipe, ["train.max_steps=3"])
    assert "every key not given as an override is at its default" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncgrpo"):
        recipe.write_text("train: {max_steps: 3}\n")
        load_config(recipe)
    assert caplog.records == []


def test_the_ray_runtime_wraps_local_engines_and_its_actors_must_fit_the_local_cluster():
    cfg = load_config(None, ["runtime=ray", "ray.generators=2", "ray.num_cpus=2"])
    assert cfg.ray.address is None and cfg.ray.generator.num_cpus == 1.0
    message = error_of("runtime=ray", "generation.backend=http", "generation.http.base_urls=[http://x:1]")
    assert "runtime = 'ray'" in message and "generation.backend: local" in message
    message = error_of("runtime=ray", "ray.generators=3", "ray.num_cpus=2")
    assert "ray.generators = 3" in message and "ray.num_cpus = 2" in message and "Fix:" in message
    load_config(None, ["runtime=ray", "ray.generators=3", "ray.num_cpus=2", "ray.address=auto"])  # a joined cluster is not checked


def test_a_data_parallel_trainer_needs_the_ray_runtime_and_its_ranks_count_in_the_local_cluster():
    message = error_of("train.world_size=2")
    assert "train.world_size = 2" in message and "runtime: ray" in message
    message = error_of("runtime=ray", "ray.generators=1", "ray.num_cpus=2", "train.world_size=2")
    assert "train.world_size = 2 ranks x ray.trainer.num_cpus = 1" in message and "need 3 CPUs" in message
    load_config(None, ["runtime=ray", "ray.generators=1", "ray.num_cpus=2", "train.world_size=2", "ray.generator.num_cpus=0.5",
                       "ray.trainer.num_cpus=0.5"])


def test_sharding_needs_ranks_naming_the_fix_and_takes_lora_and_float16():
    ray = ("runtime=ray", "train.world_size=2", "ray.num_cpus=4")
    assert load_config(None, list(ray)).train.sharding == "ddp"
    assert load_config(None, [*ray, "train.sharding=fsdp", "train.precision=bfloat16"]).train.sharding == "fsdp"
    message = error_of("train.sharding=fsdp")
    assert "train.sharding = fsdp" in message and "train.world_size = 1" in message and "Fix: set train.world_size >= 2" in message
    assert load_config(None, [*ray, "train.sharding=fsdp", "train.precision=float16"]).train.precision == "float16"
    assert load_config(None, [*ray, "train.sharding=fsdp", "train.lora.r=8"]).train.lora.r == 8  # adapters shard too
    assert "zero" in error_of(*ray, "train.sharding=zero")  # not a choice: the choices are named


def test_a_placement_group_needs_resources_to_reserve():
    message = error_of("ray.trainer.placement=SPREAD", "ray.trainer.num_cpus=0")
    assert "placement = SPREAD" in message and "num_cpus and num_gpus are both 0" in message and "Fix:" in message
    assert load_config(None, ["ray.generator.placement=PACK"]).ray.generator.placement == "PACK"


def test_a_warm_up_as_long_as_the_run_is_warned_with_the_rate_it_reaches():
    (warning,) = tolerance_warnings(load_config("recipes/demo.yaml", ["train.max_steps=2", "train.lr_schedule=cosine"]))
    assert "train.warmup_steps = 5 is not below train.max_steps = 2" in warning
    assert "rising to 40% of train.lr = 0.0015 at the last step, and train.lr_schedule = 'cosine' never starts" in warning
    assert "Fix: lower train.warmup_steps" in warning
    assert tolerance_warnings(load_config("recipes/demo.yaml", ["train.max_steps=6"])) == []


def test_a_builtin_size_that_cannot_fit_in_memory_is_a_config_error_naming_the_bound():
    """3e8 prompts built in memory ended in "unexpected MemoryError: ." (issue 20)."""
    with pytest.raises(ConfigError, match=r"data\.builtin_size = 300000000: Input should be less than or equal to 1000000"):
        load_config(None, ["data.builtin_size=300000000"])
    assert load_config(None, ["data.builtin_size=1000000"]).data.builtin_size == 1_000_000


def _models(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Every section model under `model` with its dotted key, list items (simulate.faults) included."""
    found = [(prefix, model)]
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation)
        for sub in {a for a in (field.annotation, *args, *(x for a in args for x in typing.get_args(a))) if isinstance(a, type)}:
            if issubclass(sub, BaseModel):
                found += _models(sub, f"{prefix}{name}.")
    return found


def test_every_key_has_a_description_and_every_section_says_what_it_is_for():
    models = _models(Config)
    undescribed = [f"{prefix}{name}" for prefix, model in models for name, field in model.model_fields.items()
                   if not field.description and not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))]
    assert undescribed == []
    assert [prefix for prefix, model in models if prefix and not (model.__doc__ or "").strip()] == []


def test_no_production_section_holds_a_simulator_key():
    """The scripted backend, the stub trainer and the simulated teacher read the simulate: section alone."""
    for prefix, model in _models(Config):
        if not prefix.startswith("simulate."):
            for name, field in model.model_fields.items():
                if f"{prefix}{name}" == "simulate":
                    continue
                assert "simulat" not in name and "scripted" not in name, f"{prefix}{name}"
                assert "simulate only" not in (field.description or "").lower(), f"{prefix}{name}"
    for recipe in RECIPES:
        sections = yaml.safe_load(recipe.read_text(encoding="utf-8"))
        assert ("simulate" in sections) == (sections.get("generation", {}).get("backend") == "scripted"), recipe


@pytest.mark.parametrize(("old", "new"), [
    ("generation.scripted.latency_s={dist: const, value: 2}", "generation.scripted.latency_s moved to simulate.latency_s"),
    ("generation.scripted.env.done_prob=0.5", "generation.scripted.env moved to simulate.env"),
    ("train.step_time_s=2", "train.step_time_s moved to simulate.step_time_s"),
    ("train.token_time_s=0.01", "train.token_time_s moved to simulate.token_time_s"),
    ("distill.simulated_latency_s={dist: const, value: 2}", "distill.simulated_latency_s moved to simulate.teacher_latency_s"),
    ("distill.simulated_error_rate=0.5", "distill.simulated_error_rate moved to simulate.teacher_error_rate"),
])
def test_a_key_that_moved_is_an_error_naming_its_new_place(old, new):
    message = error_of(old)
    assert new in message and "Fix: rename" in message and "unknown key" not in message


def test_an_old_simulate_recipe_names_each_moved_key_and_its_recipe(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("generation: {backend: scripted, scripted: {faults: [], tokens: {dist: const, value: 4}}}\n"
                      "train: {backend: stub, step_time_s: 4.0}\n")
    message = error_of(path=recipe)
    assert message.startswith(f"{recipe}: 2 config problems")
    assert "generation.scripted.faults moved to simulate.faults, generation.scripted.tokens moved to simulate.tokens" in message
    assert "train.step_time_s moved to simulate.step_time_s" in message


def test_every_moved_key_has_a_new_place_and_an_old_config_reads_at_the_new_places():
    for old, new in MOVED.items():
        section, _, key = old.partition(".")
        assert key not in Config.model_fields[section].annotation.model_fields, old  # the old place is gone
        target, _, new_key = new.partition(".")
        assert new_key in Config.model_fields[target].annotation.model_fields or not new_key, new
    saved = load_config(None, ["simulate.step_time_s=3", "simulate.faults=[{error: hang}]", "simulate.teacher_error_rate=0.5"])
    old = saved.model_dump(mode="json")  # as a checkpoint saved it before the move
    scripted = old.pop("simulate")
    old["train"].update(step_time_s=scripted.pop("step_time_s"), token_time_s=scripted.pop("token_time_s"))
    old["distill"].update(simulated_latency_s=scripted.pop("teacher_latency_s"), simulated_error_rate=scripted.pop("teacher_error_rate"))
    old["generation"]["scripted"] = scripted
    assert at_new_places(old) == saved.model_dump(mode="json")


@pytest.mark.parametrize(("value", "message"), [
    ("[]", r"simulate\.env\.done_probs = \[\]: List should have at least 1 item"),
    ("[0.5, 1.5, -1]", r"simulate\.env\.done_probs: .*each entry is a probability, in \[0, 1\]: entry 1 is 1\.5, entry 2 is -1\.0"),
])
def test_the_simulated_environments_done_probabilities_per_step_are_a_non_empty_list_of_probabilities(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config("recipes/calculator.yaml", [f"simulate.env.done_probs={value}"])
    assert load_config("recipes/calculator.yaml", ["simulate.env.done_probs=[0.75, 0.6]"]).simulate.env.done_probs == [0.75, 0.6]
