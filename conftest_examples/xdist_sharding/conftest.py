"""Nothing to configure: under plain ``-n`` pytest-sglworker schedules tests by worker configuration itself,
and it adds an ``xdist_group`` mark per configuration for ``--dist loadgroup``.

Run (GPU runner, one GPU per xdist worker):

    pytest conftest_examples/xdist_sharding -n 4 --sgl-model qwen3-0.6b

Run on a CPU (the simulated engine and a declared inventory of 4 GPUs):

    pytest conftest_examples/xdist_sharding -n 4 --sgl-engine sim --sgl-gpus sim:4 --sgl-model qwen3-0.6b
"""
