"""What every server (render tier, gateway, engine) shares: structured logs with request ids, draining on
SIGTERM, request bounds, CLI argument types and the OpenAPI builder. Imports neither tier, so each deploys alone."""
