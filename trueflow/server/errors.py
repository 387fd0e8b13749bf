"""A refused request and its answer's body (docs/server.md, "Errors")."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses: answered with `status` and the error body of its route (docs/server.md,
    "Errors"); `param` names the request field at fault, `code` is a short machine-readable reason. The server
    keeps serving."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


OPENAI_PARAM = {"n_per_prompt": "n", "width": "size", "height": "size", "prompts": "prompt"}


def error_body(path: str, message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": message}`, or on the OpenAI routes (/v1/...) OpenAI's error object, which its SDKs show."""
    if not path.startswith("/v1/"):
        return {"error": message}
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": OPENAI_PARAM.get(param, param) if param is not None else None, "code": code}}
