"""Response shapes shared by the routers, for the OpenAPI document."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ErrorOut(BaseModel):
    """Every error: one clear message (validation errors add the parts)."""

    model_config = ConfigDict(extra="allow")

    detail: str


class RejectionOut(BaseModel):
    digest: str
    format: str
    target: str
    code: str
    reason: str


class ResolveMissOut(ErrorOut):
    rejections: list[RejectionOut]


def err(description: str, model: type[BaseModel] = ErrorOut) -> dict[str, Any]:
    return {"model": model, "description": description}


Responses = dict[int | str, dict[str, Any]]

AUTH: Responses = {
    401: err("missing, malformed, unknown or revoked token"),
    403: err("the token's role is below what this needs"),
}
INVALID: Responses = {
    400: err("a body that is not UTF-8 JSON, or a malformed Content-Length"),
    422: err("malformed request: the message says which part and why"),
}
PROTECTED: Responses = {**AUTH, **INVALID}

# Grammars, documented in the OpenAPI document (json_schema_extra) rather than
# enforced by FastAPI: farm.core.specs and farm.core.target check them and say what is
# wrong in words a pattern cannot.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
ALIAS_PATTERN = r"^[A-Za-z][A-Za-z0-9._-]{0,63}$"
# An optional NAME= before (a keyword, batch.x a dict key) and {LO..HI} after the
# dims: the value range of an integer input.
INPUT_PATTERN = (r"^((([A-Za-z_][A-Za-z0-9_]*)|[0-9]+(?=\.))(\.[A-Za-z_][A-Za-z0-9_]*)*=)?"
                 r"[a-z0-9]+\[([0-9]+(\.\.[0-9]*)?(,[0-9]+(\.\.[0-9]*)?)*)?\]"
                 r"(\{-?[0-9]+\.\.-?[0-9]+\})?$")
TARGET_PATTERN = r"^(cpu|cuda)(/(gpu|cc|cuda|triton|python|torch|isa|threads)=[^/]+)+$"
