"""``GET /v1/resolve`` as plain ASGI, for the common request: a fleet node with a
token seen lately asking for a model the read model holds, and getting an
artifact.

Routing, dependency injection and parameter validation cost more than the
resolve itself (the profile of ``bench/registry_load.py --distinct``). This
answers a request only when everything about it is ordinary and otherwise
hands it, untouched, to the FastAPI route, which then answers exactly as it
always did: a token not seen lately or confined to its projects, a
parameter out of bounds or that does not parse, a model not held yet, an
unknown ref, a miss (it is recorded). What the route would accept, and
answer with a 200, this answers with the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from farm.core.inputs import TensorSpec, parse_inputs
from farm.core.specs import CompileOptions, GradMode, MeshLayout, SpecError
from farm.core.target import Target, TargetError
from registry.service.read_model_load import ModelView

from .middleware import auth_and_host, send_json_bytes
from .read_model import ReadModel
from .resolve import (
    MAX_FORMATS,
    MAX_INPUTS,
    MAX_LENGTH,
    MAX_RANK,
    answer_resolve,
    parse_formats,
    parse_grad_mode,
    parse_layout,
    parse_libstdcxx,
    parse_options,
)

# The route's bounds; rank is read as text first (at most 16 characters).
_SINGLE = {**MAX_LENGTH, "rank": 16}
_PARSED_MAX = 4096


class _NotOrdinary(Exception):
    """Anything the FastAPI route should answer."""


class _Parsed:
    """Parsed query values by their text: a fleet sends a few targets and
    shapes over and over. Bounded: cleared when full."""

    def __init__(self) -> None:
        self.targets: dict[str, Target] = {}
        self.inputs: dict[tuple[str, ...], tuple[TensorSpec, ...]] = {}
        self.other: dict[tuple[str, str], Any] = {}

    def target(self, text: str) -> Target:
        t = self.targets.get(text)
        if t is None:
            if len(self.targets) >= _PARSED_MAX:
                self.targets.clear()
            t = self.targets[text] = Target.parse(text)
        return t

    def input_specs(self, texts: tuple[str, ...]) -> tuple[TensorSpec, ...]:
        v = self.inputs.get(texts)
        if v is None:
            if len(self.inputs) >= _PARSED_MAX:
                self.inputs.clear()
            v = self.inputs[texts] = parse_inputs(list(texts))
        return v

    def value(self, kind: str, text: str, parse: Callable[[str], Any]) -> Any:
        key = (kind, text)
        if key in self.other:
            return self.other[key]
        if len(self.other) >= _PARSED_MAX:
            self.other.clear()
        v = self.other[key] = parse(text)
        return v


class FastResolve:
    """``fallback`` is the whole FastAPI app; ``admit(authorization header)``
    says from memory whether the token may be answered here (True), or
    not/unknown (False/None: the route decides)."""

    def __init__(
        self,
        fallback: ASGIApp,
        *,
        read_model: ReadModel,
        admit: Callable[[bytes], bool | None],
        on_answer: Callable[[float], None],
    ) -> None:
        self.fallback = fallback
        self.read_model = read_model
        self.admit = admit
        self.on_answer = on_answer
        self.parsed = _Parsed()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        body = None
        if scope["type"] == "http" and scope["method"] == "GET":
            try:
                body = self._answer(scope)
            except _NotOrdinary:
                body = None
            except (SpecError, TargetError, ValueError):
                body = None  # the route words the 422
        if body is None:
            await self.fallback(scope, receive, send)
            return
        scope["farm.route"] = "/v1/resolve"
        await send_json_bytes(send, 200, body)
        self.on_answer(time.perf_counter() - t0)

    def _answer(self, scope: Scope) -> bytes | None:
        auth, host, has_body = auth_and_host(scope)
        if has_body or self.admit(auth) is not True:
            raise _NotOrdinary
        single: dict[str, str] = {}
        inputs: list[str] = []
        formats: list[str] = []
        for key, value in parse_qsl(
            scope["query_string"].decode("latin-1"), keep_blank_values=True
        ):
            if key == "input":
                inputs.append(value)
            elif key == "format":
                formats.append(value)
            elif key in _SINGLE:
                if key in single or len(value) > _SINGLE[key]:
                    raise _NotOrdinary
                single[key] = value
        model, target = single.get("model"), single.get("target")
        if (
            model is None
            or target is None
            or not inputs
            or len(inputs) > MAX_INPUTS
            or len(formats) > MAX_FORMATS
        ):
            raise _NotOrdinary
        view = self.read_model.peek(model)
        if not isinstance(view, ModelView):
            raise _NotOrdinary
        ref = single.get("ref")
        version = view.version_for(ref)
        if version is None:
            raise _NotOrdinary
        p = self.parsed
        rank_text = single.get("rank")
        rank = None
        if rank_text is not None:
            if not rank_text.isdigit() or int(rank_text) > MAX_RANK:
                raise _NotOrdinary
            rank = int(rank_text)
        mode: GradMode = p.value("grad_mode", single.get("grad_mode", "inference"), parse_grad_mode)
        opts: CompileOptions | None = (
            None
            if "options" not in single
            else p.value("options", single["options"], parse_options)
        )
        layout: MeshLayout | None = (
            None if "layout" not in single else p.value("layout", single["layout"], parse_layout)
        )
        provides = (
            None
            if "libstdcxx" not in single
            else p.value("libstdcxx", single["libstdcxx"], parse_libstdcxx)
        )
        answer = answer_resolve(
            view,
            version,
            ref=ref,
            node=p.target(target),
            specs=p.input_specs(tuple(inputs)),
            mode=mode,
            opts=opts,
            wanted=parse_formats(formats),
            provides=provides,
            node_layout=layout,
            rank=rank,
            base_url=_base_url(scope, host),
        )
        if not isinstance(answer, bytes):
            raise _NotOrdinary  # a miss: the route answers and records it
        return answer


def _base_url(scope: Scope, host: bytes) -> str:
    """Starlette's ``request.base_url``, from the scope."""
    scheme = scope.get("scheme", "http")
    if host:
        where = host.decode("latin-1")
    else:
        server = scope.get("server")
        if server is None:
            where = ""
        else:
            name, port = server
            default = {"http": 80, "https": 443}.get(scheme)
            where = name if port == default else f"{name}:{port}"
    return f"{scheme}://{where}{scope.get('root_path', '')}/"
