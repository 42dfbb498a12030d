"""The gateway: one OpenAI endpoint driving render -> prefill -> decode -> derender (see docs/gateway.md).

pools.py chooses replicas, engine_client.py speaks to engines, flow.py runs the collocated and
disaggregated flows with retries, responses.py derenders engine events in-process (stop strings
included), routes.py is the HTTP surface.
"""
