"""Hypothesis profiles: "ci" (default: few examples, no deadline) and "thorough", chosen by the
FLASHDL_HYPOTHESIS_PROFILE environment variable; JAX's default device (the CPU); the failure log
of FLASHDL_FAILURE_LOG."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("FLASHDL_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    # On a machine with a GPU, JAX puts new arrays and jit calls on it by default. flashdl's eager
    # calls take JAX arrays on the CPU only, and the JAX tests outside test_cuda_*.py are CPU
    # tests: the CPU is their default device. (The GPU tests put their arrays on the GPU by name.)
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        return
    import jax

    try:
        jax.config.update("jax_default_device", jax.devices("cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS names others): leave JAX's default
        pass


# FLASHDL_FAILURE_LOG=FILE: each failure's report is appended to FILE as it happens, so a run cut
# off by a time limit (the GPU check's pytest steps) still says why its failed tests failed.
_FAILURE_LOG = os.environ.get("FLASHDL_FAILURE_LOG")
if _FAILURE_LOG:

    def pytest_runtest_logreport(report):
        if report.failed:
            with open(_FAILURE_LOG, "a") as f:
                f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
