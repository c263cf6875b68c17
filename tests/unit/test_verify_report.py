"""The verifier child's report as a hostile model's code would write it: the
worker takes ``{"ok": true}`` alone, a report of another shape, format,
device or sizes, or a pass its own numbers contradict, as a failed
verification that says so; a report verify_step writes passes unchanged."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from farm.build.verify import REPORT_FIELDS, VerifyReport, check_sizes, checked_report
from farm.core.inputs import parse_inputs
from farm.core.specs import JobSpec, ModelRef

SPEC = JobSpec(name="m", version="1", model=ModelRef("farm.zoo.basic:mlp", {}),
               inputs=parse_inputs(["float32[2..8,16]"]))


def passed(**changes: Any) -> dict[str, Any]:
    """A pass as verify_step writes it for SPEC."""
    r = VerifyReport(ok=True, max_abs_err=1e-6, tol=1e-4, load_s=0.2, first_call_s=0.01,
                     format="aot_compile", device="cpu", sizes_checked=check_sizes(SPEC.inputs),
                     outputs=[{"output": "output", "dtype": "float32", "shape": [2, 16],
                               "max_abs_err": 1e-6, "tol": 1e-4, "ok": True}])
    return {**r.to_json(), **changes}


def check(value: Any) -> VerifyReport:
    return checked_report(value, spec=SPEC, format="aot_compile", device="cpu")


def test_the_fields_checked_are_the_reports_own() -> None:
    assert set(REPORT_FIELDS) == {f.name for f in fields(VerifyReport)} | {"compiles_on_node"}


def test_a_real_pass_is_taken() -> None:
    r = check(passed())
    assert r.ok and r.max_abs_err == 1e-6 and r.error is None


def test_a_real_failure_is_taken_with_its_error() -> None:
    r = check(passed(ok=False, error="output: max abs error 3 > tolerance 0.1"))
    assert not r.ok and r.error == "output: max abs error 3 > tolerance 0.1"


@pytest.mark.parametrize(("value", "why"), [
    ({"ok": True}, "missing"),
    (None, "not an object"),
    ([passed()], "not an object"),
    (passed(extra=1), "unknown extra"),
    (passed(ok="yes"), "ok is str"),
    (passed(ok=1), "ok is int"),
    (passed(max_abs_err=True), "max_abs_err is bool"),
    (passed(max_abs_err="0"), "max_abs_err is str"),
    (passed(outputs={}), "outputs is dict"),
    (passed(format="aoti"), "the worker asked for aot_compile on cpu"),
    (passed(device="cuda"), "the worker asked for aot_compile on cpu"),
    (passed(sizes_checked=[[[2, 16]]]), "it checked sizes"),
    (passed(max_abs_err=1.0), "not within"),
    (passed(max_abs_err=float("nan")), "not within"),
    (passed(tol=None), "not within"),
    (passed(grad_max_abs_err=1.0, grad_tol=0.1), "gradients"),
    (passed(outputs=[{"output": "output", "max_abs_err": 5.0, "tol": 1e-4, "ok": True}]),
     "failed"),
    (passed(outputs=[{"output": "output", "max_abs_err": 0.0, "tol": 1e-4, "ok": False}]),
     "failed"),
    (passed(outputs=["fine"]), "output entry is str"),
    (passed(error="boom"), "a pass with an error"),
    (passed(load_s=None), "load_s"),
    (passed(first_call_compiled=True), "compiles_on_node contradicts"),
    (passed(ok=False, error=None), "without an error"),
])
def test_forged_or_inconsistent_reports_fail_verification(value: Any, why: str) -> None:
    r = check(value)
    assert not r.ok
    assert r.error is not None and r.error.startswith("the verifier's report is not one"), r.error
    assert why in r.error, r.error
    assert r.format == "aot_compile" and r.device == "cpu"
