"""prefixgate: replica.kvcache."""
