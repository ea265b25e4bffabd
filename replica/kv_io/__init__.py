"""prefixgate: replica.kv_io."""
