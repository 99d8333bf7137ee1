"""Errors as the OpenAI API returns them: an HTTP status and
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

#: Seconds a client is told to wait (``Retry-After``) when the queue is full or the engine is
#: restarting.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request that ends in an error response. ``param`` names the request field at fault
    (dotted, e.g. ``messages.0.content``), ``code`` is a short machine-readable reason."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body (also the ``data:`` of a stream's error event)."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    """A 400 naming the field at fault."""
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> ApiError:
    """A 503 with ``Retry-After``: the queue is full, or the engine is (re)starting."""
    return ApiError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"
