"""The command-line tools of the package: the ``sglworker`` console script (:mod:`.cli`).

A layer beside the others: it imports only ``engine`` (where the installs go) and ``errors``, and
never pytest. ``gpu_check/`` and ``recipes/`` are programs and data it runs by path, not modules of it.
"""
