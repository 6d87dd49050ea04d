"""The workers layer: what a test gets and how it gets it. Worker kinds and configurations, the launcher and
the process objects it returns, the readiness wait, the router, the pool of worker groups, and the worker
sources (this machine's leases, a Ray cluster, attached URLs).

May import the resources and engine layers, :mod:`pytest_sglworker.errors` and the simulated engine's package
surface (:mod:`pytest_sglworker.sim`); never the pytest-facing layer (:mod:`pytest_sglworker.plugin`) and
never pytest.
"""
