"""The resources layer: what a worker holds on this machine. GPU inventories and file-locked leases, the wait
for a GPU's memory to come back, port blocks, the plugin's state directories and log retention, and process
ownership (the owner tag, tree teardown, the watchdog and the janitor).

May import only :mod:`pytest_sglworker.errors`; plain Python, no pytest.
"""
