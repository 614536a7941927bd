"""Shared settings of the parity suite: a fresh seed per run (printed, replayable) and its size."""

import os
import random

import pytest


def pytest_addoption(parser):
    parser.addoption("--parity-count", type=int, default=int(os.environ.get("MHA_PARITY_COUNT", "2000")),
                     help="random configurations per parity test (CI: 2000)")
    parser.addoption("--parity-seed", type=int, default=None,
                     help="replay a run (default: MHA_PARITY_SEED or a fresh seed)")


def pytest_configure(config):
    seed = config.getoption("--parity-seed")
    if seed is None:
        seed = int(os.environ.get("MHA_PARITY_SEED", random.SystemRandom().randrange(2**32)))
    config.parity_seed = seed


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed in the run's summary, which -q keeps: a failure seen in CI's log can be replayed."""
    seed = config.parity_seed
    terminalreporter.write_line(f"parity seed: {seed} (replay with --parity-seed {seed})")


@pytest.fixture(scope="session")
def parity_count(request):
    return request.config.getoption("--parity-count")


@pytest.fixture(scope="session")
def parity_seed(request):
    return request.config.parity_seed
