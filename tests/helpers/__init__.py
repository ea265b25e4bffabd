"""What the test modules share: engine references, the stack's HTTP helpers, the index's fake
replicas, metrics scrapes, the fuzz strategies, the tier rules. Test modules import helpers from
here only, never from one another or from conftest.py (which keeps fixtures and hooks)."""
