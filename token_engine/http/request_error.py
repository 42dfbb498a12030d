"""The error a request's validation raises: a message, the parameter it names and the HTTP status."""

from __future__ import annotations


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
