"""OpenAI-shaped errors: every failure the gateway returns has {"error": {...}} and a 4xx/5xx."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)



_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def http_error(status: int, detail, headers: dict[str, str] | None = None, where: str = "") -> APIError:
    """A routing-level failure (unknown path, wrong method) as an OpenAI error body;
    `where` is "METHOD /path" as OpenAI names it ("Invalid URL (GET /v1/x)")."""
    allow = next((v for k, v in (headers or {}).items() if k.lower() == "allow"), None)
    if status == 404:
        message = f"Invalid URL ({where}): no such route" if where else "no such route"
    elif status == 405:
        message = f"method not allowed ({where})" + (f"; allowed: {allow}" if allow else "")
    else:
        message = detail if isinstance(detail, str) and detail else "request failed"
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return APIError(status, message, type_, code=_HTTP_CODES.get(status), headers=headers)
