"""Operations shared by every server (render tier, gateway, engine): structured logs with request ids,
draining on SIGTERM, the OpenAPI document. Light on imports: the engine imports it too."""
