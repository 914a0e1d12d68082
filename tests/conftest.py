"""Shared pytest options: the size of the chaos sweep, and replaying one chaos seed."""


def pytest_addoption(parser):
    parser.addoption("--chaos-scenarios", type=int, default=2000, help="number of random chaos scenarios (make chaos runs more)")
    parser.addoption("--chaos-seed", type=int, default=None, help="replay exactly this chaos scenario")
