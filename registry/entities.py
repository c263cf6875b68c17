"""Plain values that leave the database session.

ORM rows are converted to these before a session closes, so nothing outside
``registry.db`` ever touches a detached row or lazy-loads by accident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from farm.core.inputs import TensorSpec
from farm.core.specs import CompileOptions, GradMode
from farm.core.target import Target

# Artifact formats. "aot_compile": torch.compile(...).aot_compile bytes, loaded
# with torch.compiler.load_compiled_function. "aoti": an AOTInductor package
# (.pt2) with compiled kernels, loaded with torch._inductor.aoti_load_package;
# on CPU it needs no C++ compiler on the node.
FORMATS = ("aot_compile", "aoti")


# Slots: the API's read model holds one per artifact row (a million, at fleet scale).
@dataclass(frozen=True, slots=True)
class ArtifactRecord:
    id: int
    digest: str  # sha256 hex of the blob's bytes
    size: int
    format: str
    fingerprint: str
    build_key: str
    inputs: tuple[TensorSpec, ...]
    grad_mode: GradMode
    options: CompileOptions
    target: Target
    verified: bool = True
    # True when the verifier saw the first call after loading still compile
    # (an artifact that is not finished on the fleet).
    first_call_compiles: bool = False
    max_abs_err: float | None = None
    first_call_s: float | None = None
    load_s: float | None = None
    # The build statement (DSSE envelope JSON) the compile worker signed.
    attestation: str | None = None
    # The compiler that built it, and the libstdc++ symbol versions (GLIBCXX_*,
    # CXXABI_*) its shared library needs from the node (AOTI packages only).
    cxx: str | None = None
    libstdcxx_needs: tuple[str, ...] = ()
    created_at: datetime | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "digest": self.digest,
            "size": self.size,
            "format": self.format,
            "fingerprint": self.fingerprint,
            "build_key": self.build_key,
            "inputs": [str(s) for s in self.inputs],
            "grad_mode": self.grad_mode.value,
            "options": self.options.to_json(),
            "target": str(self.target),
            "target_fields": self.target.to_json(),
            "verified": self.verified,
            "first_call_compiles": self.first_call_compiles,
            "max_abs_err": self.max_abs_err,
            "first_call_s": self.first_call_s,
            "load_s": self.load_s,
            "cxx": self.cxx,
            "libstdcxx_needs": list(self.libstdcxx_needs),
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "meta": self.meta,
        }
