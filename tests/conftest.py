"""Shared pytest options (the size of the chaos sweep, replaying one chaos seed) and the fast tier's guard
(tests/tier_guard.py: a test in tests/unit or tests/sim that starts a process, opens a network socket, imports Ray or
takes an optimizer step fails, naming what it did), and how `pytest -n N` (make test) shares the tests between its
workers (tests/xdist_scheduling.py)."""

from tests.tier_guard import FastTierGuard


def pytest_addoption(parser):
    parser.addoption("--chaos-scenarios", type=int, default=2000, help="number of random chaos scenarios (make chaos runs more)")
    parser.addoption("--chaos-seed", type=int, default=None, help="replay exactly this chaos scenario")


def pytest_configure(config):
    config.pluginmanager.register(FastTierGuard(), "fast-tier-guard")
    _build_matplotlib_font_cache()


def _build_matplotlib_font_cache():
    """On a machine where matplotlib has never run, its font manager starts `fc-list` on first use to build its cache:
    built here, before any test, the fast tier's plot tests start no process whichever test draws first."""
    try:
        import matplotlib.font_manager  # noqa: F401 - imported for its side effect: the cache
    except ImportError:
        pass  # the plot tests skip, naming why


def pytest_xdist_make_scheduler(config, log):
    from tests.xdist_scheduling import FileAndResourceScheduling

    return FileAndResourceScheduling(config, log)
