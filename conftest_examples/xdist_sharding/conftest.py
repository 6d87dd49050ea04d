"""Nothing to configure: pytest-sglworker adds an ``xdist_group`` mark per worker configuration by itself.

Run (GPU runner, one GPU per xdist worker):

    pytest conftest_examples/xdist_sharding -n 4 --dist loadgroup --sgl-model qwen3-0.6b

Run on a CPU (the simulated engine and a declared inventory of 4 GPUs):

    pytest conftest_examples/xdist_sharding -n 4 --dist loadgroup \
        --sgl-engine sim --sgl-gpus sim:4 --sgl-model qwen3-0.6b
"""
