"""Worker sources: where a test's workers come from (the protocol is :mod:`.base`; one module per source:
:mod:`.local`, :mod:`.ray`, :mod:`.attached`)."""
