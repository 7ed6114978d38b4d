"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can see goes through here, including FastAPI's own (malformed JSON, a
body of the wrong shape, an unknown route), so clients written for OpenAI parse all of them.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# Parts of a pydantic error location that name a member of a union type rather than a field
# ("str", "list[int]", "TextPart"): they mean nothing to a client.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|.*\[.*\]|[A-Z]\w*)$")
# A field check's ValueError starts with the field's name (etinfer.validation).
_LEADING_NAME = re.compile(r"^([a-z_][a-z0-9_]*) ")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_value(error: ValueError, fields: dict[str, str]) -> APIError:
    """A 400 for a field check's ValueError; ``fields`` maps internal field names to the
    request's (``logprobs`` is ``top_logprobs`` in a chat request)."""
    message = str(error)
    match = _LEADING_NAME.match(message)
    name = match.group(1) if match else None
    param = fields.get(name) if name else None
    if param is not None and param != name:
        message = param + message[len(name) :]
    return APIError(400, message, param=param, code="invalid_value")


def _param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _UNION_TAG.match(part):
            path += f".{part}" if path else part
    return path or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # For a union (a string or a list of parts) each member reports; the deepest is the most
    # telling ("messages[0].content[0].type" rather than "messages[0].content").
    first = max(errors, key=lambda e: len(e["loc"]), default=None) or {
        "type": "",
        "loc": (),
        "msg": "invalid request",
    }
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    param = _param(tuple(first["loc"]))
    if first["type"] == "extra_forbidden":
        return APIError(
            400,
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    where = f"'{param}'" if param else "the request body"
    return APIError(400, f"Invalid value for {where}: {first['msg']}", param=param)


def install_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own: unknown route (404), wrong method (405), an unparsable body (400).
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        response = APIError(exc.status_code, message).response()
        response.headers.update(exc.headers or {})
        return response

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the exception itself after sending this.
        return APIError(500, "internal server error", code="internal_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
