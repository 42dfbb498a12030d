"""The HTTP surface: the Starlette handlers (`server.py`) over what every handler uses of a request
(`request_io.py`), the render endpoints answered from uvicorn's protocol (`direct_http.py`), the admission queue
(`render_queue.py`), error envelopes, `/metrics`, the OpenAPI operations."""
