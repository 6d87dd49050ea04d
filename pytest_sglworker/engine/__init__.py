"""The engine layer: what the plugin knows about sglang. The parser's flag table and the engine's facts, model
specs and the mandatory budget, sglang's own argument check, the memory ledger, the log diagnosis and its
rules, and the recipe for the real engine on a CPU.

May import only :mod:`pytest_sglworker.errors`; plain Python, no pytest.
"""
