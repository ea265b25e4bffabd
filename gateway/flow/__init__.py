"""Flow control in the gateway: who is served first when the replicas are saturated.

One concern per module:
  tiers.py       service tiers (OpenAI's `service_tier`, vLLM's integer `priority`) as ranks
  keys.py        the API-key file: key -> tenant, with optional weight, default tier and limits
  fair_queue.py  the queue discipline, pure logic: priority bands, weighted fair queuing on
                 tokens between tenants, earliest deadline within one (else FIFO), bounded
                 with shedding, maximum waits
  saturation.py  whether a model's replicas have room: their heartbeats and this gateway's own
                 account of what it sent and has not seen start
  admission.py   the asyncio side: requests wait on the queue and are released as room frees
  rate_limit.py  requests and tokens per minute per tenant, one Redis script per admission
                 (a local share of each limit while Redis is away)
  slo.py         latency objectives (x-slo-ttft-ms, x-slo-tpot-ms; key and tier defaults):
                 parsed and resolved here, measured by gateway/slo_watch.py
  slo_admission.py  admission by objective: the replicas' TTFT floor from the heartbeats, and
                 the shed (429) of a request that cannot meet its TTFT objective anywhere

docs/flow-control.md describes the whole and lists its settings.
"""
