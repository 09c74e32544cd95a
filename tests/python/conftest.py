"""Hypothesis profiles: "ci" (default: few examples, no deadline) and "thorough", chosen by the
FLASHDL_HYPOTHESIS_PROFILE environment variable."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("FLASHDL_HYPOTHESIS_PROFILE", "ci"))
