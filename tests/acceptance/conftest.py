"""Fixtures the acceptance tests share."""

from warm_helpers import warm  # noqa: F401  (the ``warm`` fixture: the inner warm-worker suite)
