"""The error object of `flint serve`: every failure, from a bad field to a full queue or a shutdown,
is answered as an OpenAI error object ({"error": {"message", "type", "param", "code"}}) with its
HTTP status.

Tests: ``pytest tests/test_server.py tests/test_server_guard.py``.
"""
from ..errors import FlintError


class APIError(FlintError):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="server_shutdown")


def client_closed() -> APIError:
    return APIError(499, "the client closed the request", code="client_closed")
