"""Reward functions: resolving specs, scoring with weights and None, and every error path."""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import textwrap
import threading
import time

import pytest

from asyncgrpo.errors import ConfigError, RewardError
from asyncgrpo.rewards.resolve import resolve_reward, resolve_rewards
from asyncgrpo.rewards.scoring import RewardScorer, ScoredCompletion, unscored_group_error
from asyncgrpo.rollout.diagnostics import reward_failed
from asyncgrpo.tasks import REWARDS
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.types import Prompt

pytestmark = pytest.mark.timeout(30)

PROMPT = Prompt(id=3, text="say a: ", token_ids=(1, 2), columns={"letter": "a", "answer": "x"})


def run(coro):
    return asyncio.run(coro)


def write_module(tmp_path, name, body):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))


# -- resolving -------------------------------------------------------------------------------


def test_resolve_builtins():
    for name in ("repeat_letter", "addition", "coin"):
        assert resolve_reward(f"builtin:{name}", 0) == (name, REWARDS[name])


def test_unknown_builtin_lists_the_builtins():
    with pytest.raises(ConfigError) as err:
        resolve_reward("builtin:repeat_leter", 2)
    msg = str(err.value)
    assert "reward.functions[2]" in msg and "'builtin:repeat_leter'" in msg
    assert "did you mean builtin:repeat_letter" in msg and "builtin:coin" in msg


@pytest.mark.parametrize("spec", ["repeat_letter", "mod:", ":fn", ""])
def test_malformed_specs(spec):
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]"):
        resolve_reward(spec, 0)


def test_resolve_module_function(tmp_path, monkeypatch):
    write_module(tmp_path, "ag_rewards_ok", "def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name, fn = resolve_reward("ag_rewards_ok:score", 0)
    assert name == "score" and fn(["p"], ["c"]) == [1.0]


def test_resolve_py_file_path(tmp_path, monkeypatch):
    write_module(tmp_path, "file_rewards", "def score(prompts, completions):\n    return [0.5] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    name, fn = resolve_reward("file_rewards.py:score", 0)
    assert name == "score" and fn([], ["c"]) == [0.5]
    with pytest.raises(ConfigError, match=r"reward\.functions\[1\].*does not exist"):
        resolve_reward("missing_file.py:score", 1)


def test_resolve_searches_the_working_directory(tmp_path, monkeypatch):
    write_module(tmp_path, "ag_rewards_cwd", "def score(prompts, completions):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve_reward("ag_rewards_cwd:score", 0)[0] == "score"


def test_missing_module_includes_the_import_error():
    with pytest.raises(ConfigError) as err:
        resolve_reward("no_such_module_xyz.sub:score", 1)
    msg = str(err.value)
    assert "reward.functions[1]" in msg and "'no_such_module_xyz.sub:score'" in msg
    assert "No module named 'no_such_module_xyz'" in msg and "Fix" in msg
    assert isinstance(err.value.__cause__, ImportError)


def test_module_failing_on_import(tmp_path, monkeypatch):
    write_module(tmp_path, "ag_rewards_broken", "raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="raised RuntimeError: boom at import"):
        resolve_reward("ag_rewards_broken:score", 0)


def test_missing_attribute_lists_close_names(tmp_path, monkeypatch):
    write_module(
        tmp_path,
        "ag_rewards_attr",
        """
        def score_answer(prompts, completions, **kw):
            return [1.0] * len(completions)

        def other(prompts, completions, **kw):
            return [0.0] * len(completions)
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        resolve_reward("ag_rewards_attr:score_answr", 0)
    msg = str(err.value)
    assert "reward.functions[0]" in msg and "has no attribute 'score_answr'" in msg and "'score_answer'" in msg
    with pytest.raises(ConfigError, match="its functions are other, score_answer"):
        resolve_reward("ag_rewards_attr:zzz", 0)


def test_not_callable(tmp_path, monkeypatch):
    write_module(tmp_path, "ag_rewards_value", "THRESHOLD = 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        resolve_reward("ag_rewards_value:THRESHOLD", 4)
    msg = str(err.value)
    assert "reward.functions[4]" in msg and "is a float, not a function" in msg and "Fix" in msg


def test_resolve_rewards_names_each_index():
    with pytest.raises(ConfigError, match=r"reward\.functions\[1\]"):
        resolve_rewards(["builtin:coin", "builtin:nope"])


# -- scoring ---------------------------------------------------------------------------------


def test_sync_and_async_functions_with_weights():
    def length(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    async def is_a(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [1.0 if c.startswith("a") else 0.0 for c in completions]

    scorer = RewardScorer([("length", length), ("is_a", is_a)], weights=[0.5, -2.0], timeout_s=5)
    assert scorer.names == ["length", "is_a"]
    out = run(scorer.score(PROMPT, ["aa", "bbbb"]))
    assert out == [
        ScoredCompletion(reward=0.5 * 2 - 2.0, terms={"length": 2.0, "is_a": 1.0}),
        ScoredCompletion(reward=0.5 * 4, terms={"length": 4.0, "is_a": 0.0}),
    ]


def test_builtin_through_the_scorer():
    scorer = RewardScorer([resolve_reward("builtin:repeat_letter", 0)], timeout_s=5)
    out = run(scorer.score(PROMPT, ["aaaaaaaa", "aaaa", "zzzz"]))
    assert [s.reward for s in out] == [1.0, 0.5, 0.0]


def test_columns_are_aligned_lists_and_filtered_by_signature():
    seen = {}

    def with_kwargs(prompts, completions, **columns):
        seen["kwargs"] = (prompts, completions, columns)
        return [0.0] * len(completions)

    def named_only(prompts, completions, answer):
        seen["named"] = answer
        return [0.0] * len(completions)

    run(RewardScorer([("a", with_kwargs), ("b", named_only)], timeout_s=5).score(PROMPT, ["x", "y"]))
    prompts, completions, columns = seen["kwargs"]
    assert {columns.pop(name) is not None for name in ("trainer_state", "log_metric", "log_extra")} == {True}  # TRL's, to **kwargs
    assert (prompts, completions, columns) == (["say a: "] * 2, ["x", "y"], {"letter": ["a", "a"], "answer": ["x", "x"]})
    assert seen["named"] == ["x", "x"]


def test_none_excludes_a_term_and_all_none_gives_none():
    def first(prompts, completions, **kw):
        return [None, 1.0, None]

    def second(prompts, completions, **kw):
        return [0.5, None, None]

    out = run(RewardScorer([("f", first), ("s", second)], weights=[1.0, 4.0], timeout_s=5).score(PROMPT, ["a", "b", "c"]))
    assert [s.reward for s in out] == [2.0, 1.0, None]
    assert out[2].terms == {"f": None, "s": None}


def test_numpy_values_and_tuples_are_accepted():
    np = pytest.importorskip("numpy")

    def f(prompts, completions, **kw):
        return np.array([0.25, 1.0], dtype=np.float32)

    def g(prompts, completions, **kw):
        return (1, True)

    out = run(RewardScorer([("f", f), ("g", g)], timeout_s=5).score(PROMPT, ["a", "b"]))
    assert [s.reward for s in out] == [1.25, 2.0]


def test_duplicate_names_are_made_unique():
    def f(prompts, completions, **kw):
        return [1.0] * len(completions)

    scorer = RewardScorer([("f", f), ("f", f)], timeout_s=5)
    assert scorer.names == ["f", "f_2"]
    assert run(scorer.score(PROMPT, ["a"]))[0].reward == 2.0


def test_no_completions_calls_nothing():
    def f(prompts, completions, **kw):
        raise AssertionError("must not be called")

    assert run(RewardScorer([("f", f)], timeout_s=5).score(PROMPT, [])) == []


def test_sync_inline_runs_on_the_loop_thread():
    threads = []

    def f(prompts, completions, **kw):
        threads.append(threading.get_ident())
        return [0.0] * len(completions)

    run(RewardScorer([("f", f)], timeout_s=5, isolation="inline").score(PROMPT, ["a"]))
    run(RewardScorer([("f", f)], timeout_s=5, isolation="thread").score(PROMPT, ["a"]))
    assert threads[0] == threading.get_ident() and threads[1] != threading.get_ident()


def test_weights_must_match_functions():
    def f(prompts, completions, **kw):
        return [0.0]

    with pytest.raises(ConfigError, match="reward.weights has 2 values"):
        RewardScorer([("f", f)], weights=[1.0, 2.0], timeout_s=5)


# -- errors ----------------------------------------------------------------------------------


def test_exception_becomes_reward_error_with_cause():
    def grader(prompts, completions, **kw):
        raise KeyError("missing_column")

    with pytest.raises(RewardError) as err:
        run(RewardScorer([("grader", grader)], timeout_s=5).score(PROMPT, ["aaaa", "b"]))
    msg = str(err.value)
    assert "'grader'" in msg and "raised KeyError" in msg and "missing_column" in msg
    assert "'say a: '" in msg and "'aaaa'" in msg and msg.count("Fix:") == 1
    diagnostic = reward_failed(err.value, 0, 1).message  # the run's diagnostic adds the way to go on, once
    assert diagnostic.count("Fix") == 1 and diagnostic.count("reward.on_error: drop") == 1 and ". ." not in diagnostic
    assert isinstance(err.value.__cause__, KeyError)
    assert err.value.__cause__.__traceback__ is not None
    assert err.value.function == "grader" and err.value.completion == "aaaa"


def test_async_exception_becomes_reward_error():
    async def judge(prompts, completions, **kw):
        await asyncio.sleep(0)
        raise ConnectionError("judge down")

    with pytest.raises(RewardError) as err:
        run(RewardScorer([("judge", judge)], timeout_s=5).score(PROMPT, ["a"]))
    assert isinstance(err.value.__cause__, ConnectionError) and "judge down" in str(err.value)


def test_long_inputs_are_truncated_in_the_message():
    def f(prompts, completions, **kw):
        raise ValueError("x")

    long_prompt = Prompt(id=0, text="p" * 5000, token_ids=())
    with pytest.raises(RewardError) as err:
        run(RewardScorer([("f", f)], timeout_s=5).score(long_prompt, ["c" * 5000]))
    assert len(str(err.value)) < 1000 and "(5000 chars)" in str(err.value)


def test_async_timeout_becomes_reward_error():
    async def slow(prompts, completions, **kw):
        await asyncio.sleep(60)
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as err:
        run(RewardScorer([("slow", slow)], timeout_s=0.05).score(PROMPT, ["a"]))
    assert "reward.timeout_s = 0.05 s" in str(err.value) and "'slow'" in str(err.value)
    assert isinstance(err.value.__cause__, TimeoutError)


def test_sync_timeout_in_thread_becomes_reward_error():
    release = threading.Event()

    def stuck(prompts, completions, **kw):
        release.wait(10)
        return [0.0] * len(completions)

    async def main():
        try:
            await RewardScorer([("stuck", stuck)], timeout_s=0.05).score(PROMPT, ["a"])
        finally:
            release.set()  # let the abandoned thread end so the loop can close

    with pytest.raises(RewardError, match="did not return within"):
        run(main())


def test_a_function_raising_timeout_error_itself_is_not_a_timeout():
    def f(prompts, completions, **kw):
        raise TimeoutError("upstream judge timed out")

    with pytest.raises(RewardError, match="raised TimeoutError: upstream judge timed out"):
        run(RewardScorer([("f", f)], timeout_s=5).score(PROMPT, ["a"]))


@pytest.mark.parametrize(
    ("result", "fragment"),
    [
        ([1.0], "returned 1 values for 2 completions"),
        ([1.0, 2.0, 3.0], "returned 3 values for 2 completions"),
        (None, "returned a NoneType, not a list of 2 values"),
        ("11", "returned a str"),
        ({"a": 1.0, "b": 2.0}, "returned a dict"),
        ([1.0, "1"], "returned '1' (str) for completion 1, not a number"),
        ([math.nan, 1.0], "returned nan for completion 0, which is not finite"),
        ([1.0, math.inf], "returned inf for completion 1, which is not finite"),
    ],
)
def test_bad_return_values_are_reward_errors(result, fragment):
    def f(prompts, completions, **kw):
        return result

    with pytest.raises(RewardError) as err:
        run(RewardScorer([("f", f)], timeout_s=5).score(PROMPT, ["aa", "bb"]))
    assert fragment in str(err.value) and "'f'" in str(err.value) and "Fix" in str(err.value)


def test_cancellation_is_not_a_reward_error():
    async def main():
        began = threading.Event()  # the function runs on the scorer's reward loop, on its own thread

        async def slow(prompts, completions, **kw):
            began.set()
            await asyncio.sleep(60)
            return [0.0]

        async with RewardScorer([("slow", slow)], timeout_s=30) as scorer:
            task = asyncio.create_task(scorer.score(PROMPT, ["a"]))
            assert await run_in_daemon_thread(lambda: began.wait(30), name="test-wait")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(main())


def _exit_3(prompts, completions, **kw):
    raise SystemExit(3)


def _interrupt(prompts, completions, **kw):
    raise KeyboardInterrupt


async def _async_exit_3(prompts, completions, **kw):
    raise SystemExit(3)


async def _async_interrupt(prompts, completions, **kw):
    raise KeyboardInterrupt


@pytest.mark.parametrize("isolation", ["thread", "inline"])
@pytest.mark.parametrize(
    ("fn", "raised"),
    [(_exit_3, "SystemExit: 3"), (_interrupt, "KeyboardInterrupt"), (_async_exit_3, "SystemExit: 3"), (_async_interrupt, "KeyboardInterrupt")],
)
def test_system_exit_and_keyboard_interrupt_are_reward_errors(fn, raised, isolation):
    with pytest.raises(RewardError) as err:
        run(RewardScorer([("quits", fn)], timeout_s=5, isolation=isolation).score(PROMPT, ["a"]))
    assert f"'quits' raised {raised}" in str(err.value)
    assert isinstance(err.value.__cause__, (SystemExit, KeyboardInterrupt))


def test_unscored_group_error_names_the_functions_that_returned_none():
    def judge(prompts, completions, **kw):
        return [None] * len(completions)

    def partial(prompts, completions, **kw):
        return [1.0, None, None]

    scored = run(RewardScorer([("judge", judge), ("partial", partial)], timeout_s=5).score(PROMPT, ["a", "b", "c"]))
    msg = str(unscored_group_error(PROMPT, scored, needed=2))
    assert "only 1 of 3 completions" in msg and "rollout.min_group_survivors = 2" in msg
    assert "'judge' returned None for all 3 completions" in msg and "'partial' returned None for 2 of 3 completions" in msg
    assert "None means no score (TRL's semantics)" in msg and "Fix" in msg


def test_a_sync_call_that_times_out_does_not_starve_later_calls_of_threads():
    release = threading.Event()
    calls = []

    def sometimes_stuck(prompts, completions, **kw):
        calls.append(threading.get_ident())
        if len(calls) == 1:
            release.wait(60)
        return [1.0] * len(completions)

    async def main():
        # The timeout bounds the second call too: 1 s, not a few ms, so a loaded machine cannot make it time out.
        async with RewardScorer([("f", sometimes_stuck)], timeout_s=1.0, isolation="thread", workers=1) as scorer:
            with pytest.raises(RewardError, match="did not return within"):
                await scorer.score(PROMPT, ["a"])
            scored = await scorer.score(PROMPT, ["a", "b"])  # one worker thread, and it is stuck: a new one runs this
        assert [s.reward for s in scored] == [1.0, 1.0] and calls[0] != calls[1]

    try:
        run(main())
    finally:
        release.set()


_blocking_calls = itertools.count()


async def _blocks_its_loop_once(prompts, completions, **kw):
    if next(_blocking_calls) == 0:
        time.sleep(3)  # a sync call inside async def: it blocks whatever event loop runs the function
    return [1.0] * len(completions)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_an_async_reward_that_blocks_its_loop_meets_reward_timeout_s_and_later_calls_get_a_fresh_loop(isolation):
    global _blocking_calls
    _blocking_calls = itertools.count()

    async def main():
        # 1.5 s: the second call (a fresh loop, in a process for "process") must fit in it on a loaded machine too.
        async with RewardScorer([("blocks", _blocks_its_loop_once)], timeout_s=1.5, isolation=isolation, specs=["x:y"]) as scorer:
            with pytest.raises(RewardError, match=r"'blocks' did not return within reward.timeout_s = 1.5 s"):
                await scorer.score(PROMPT, ["a"])
            # The blocked loop is written off: the next call does not queue behind it (it would time out too).
            return await scorer.score(PROMPT, ["a"])

    assert [s.reward for s in run(main())] == [1.0]


def test_weighted_rewards_whose_sum_is_not_finite_are_a_reward_error_naming_every_function():
    def big(prompts, completions, **kw):
        return [1e308] * len(completions)

    def bigger(prompts, completions, **kw):
        return [1e308] * len(completions)

    cases = [([("big", big), ("bigger", bigger)], [1.0, 1.0], "big 1e+308 x weight 1, bigger 1e+308 x weight 1"),
             ([("big", big)], [10.0], "big 1e+308 x weight 10")]
    for functions, weights, terms in cases:  # a sum that overflows (math.fsum raises), a weight that does (inf)
        with pytest.raises(RewardError) as err:
            run(RewardScorer(functions, weights, timeout_s=5, isolation="inline").score(PROMPT, ["a"]))
        message = str(err.value)
        assert all(f"{name!r}" in message for name, _ in functions) and terms in message
        assert "not a finite number" in message and "Fix" in message


async def _quick(prompts, completions, **kw):
    return [1.0] * len(completions)


def test_the_reward_loop_starts_with_the_first_async_call_and_its_thread_ends_with_the_scorer():
    def loop_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "asyncgrpo-reward-loop" and t.is_alive()]

    async def main():
        before = loop_threads()
        async with RewardScorer([("quick", _quick)], timeout_s=5) as scorer:
            assert loop_threads() == before
            assert [s.reward for s in await scorer.score(PROMPT, ["a", "b"])] == [1.0, 1.0]
            assert len(loop_threads()) == len(before) + 1
        return before

    before = run(main())
    assert loop_threads() == before
