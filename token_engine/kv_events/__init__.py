"""KV events for routers: which prefix-cache blocks this engine holds, published as vLLM publishes them.

`config` parses vLLM's ``--kv-events-config``; `wire` holds the msgpack event structs (vLLM's wire format);
`recorder` turns the block manager's cache changes into events with vLLM's block hashes; `publisher` sends
batches over ZMQ (PUB socket, optional ROUTER replay socket).
"""
