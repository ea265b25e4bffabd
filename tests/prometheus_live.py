"""`python -m tests.prometheus_live --url ... --metrics-port ...` (docs/metrics.md): the live
Prometheus check by hand; it lives in tests/helpers/prometheus_live.py."""

from tests.helpers.prometheus_live import main

if __name__ == "__main__":
    raise SystemExit(main())
