"""OpenAI-style errors: every failure the server reports is one `APIError`, answered as

    HTTP <status>   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

4xx: the request was wrong (`message` says what, and what is allowed); 503: the server is
overloaded or draining (with `Retry-After`); 500: our bug, reported without a traceback.
"""
from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def overloaded(message: str, code: str, retry_after_s: int) -> APIError:
    return APIError(503, message, "service_unavailable_error", None, code,
                    {"Retry-After": str(retry_after_s)})


def internal_error() -> APIError:
    return APIError(500, "the server hit an internal error; it was logged", "server_error",
                    None, "internal_error")
