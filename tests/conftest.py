import os

from hypothesis import HealthCheck, settings

# CI: no per-example deadline, and fixed examples so a run can be reproduced exactly.
settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
