"""The contracts that cross a process boundary, defined once: block hashing (`hashing`), the
Redis schema and its scripts (`redis_schema`), the messages between gateway and replica
(`messages`). Imported by gateway, router and replica alike; no torch, no Ray."""
