"""Input specs, compile options and build keys: parse/str round trips and clear errors."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from farm.core.inputs import (
    DTYPES,
    MAX_DIMS,
    Dim,
    TensorSpec,
    format_inputs,
    inputs_cover,
    parse_input_list,
    parse_inputs,
)
from farm.core.specs import (
    CompileOptions,
    GradMode,
    JobSpec,
    ModelRef,
    SpecError,
    build_key,
    sha256_text,
)

# --------------------------------------------------------------------------- #
# Round trips
# --------------------------------------------------------------------------- #


@st.composite
def dims(draw: st.DrawFn) -> Dim:
    if draw(st.booleans()):
        size = draw(st.integers(0, 10**6))
        return Dim(size, size)
    lo = draw(st.integers(2, 10**6))
    hi = draw(st.one_of(st.none(), st.integers(lo + 1, 10**7)))
    return Dim(lo, hi)


@st.composite
def value_specs(draw: st.DrawFn) -> TensorSpec:
    """Integer specs with a declared value range inside their dtype."""
    dtype, lo_min, hi_max = draw(st.sampled_from(
        [("int64", -(2**63), 2**63 - 1), ("int32", -(2**31), 2**31 - 1),
         ("int8", -128, 127), ("uint8", 0, 255)]))
    lo = draw(st.integers(lo_min, hi_max))
    hi = draw(st.integers(lo, hi_max))
    return TensorSpec(dtype, tuple(draw(st.lists(dims(), max_size=MAX_DIMS))), (lo, hi))


tensor_specs = st.one_of(
    st.builds(
        TensorSpec,
        dtype=st.sampled_from(DTYPES),
        dims=st.lists(dims(), max_size=MAX_DIMS).map(tuple),
    ),
    value_specs(),
)


@given(dims())
def test_dim_round_trip(dim: Dim) -> None:
    assert Dim.parse(str(dim)) == dim


@given(tensor_specs)
def test_tensor_spec_round_trip(spec: TensorSpec) -> None:
    text = str(spec)
    assert TensorSpec.parse(text) == spec
    assert str(TensorSpec.parse(text)) == text


@given(st.lists(tensor_specs, max_size=5))
def test_input_list_round_trip(specs: list[TensorSpec]) -> None:
    assert parse_input_list(format_inputs(specs)) == tuple(specs)


@given(tensor_specs)
def test_a_spec_covers_itself(spec: TensorSpec) -> None:
    assert spec.covers(spec)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("float32[8,64]", "float32[8,64]"),
        ("  bf16 [ 8 , 512 ]  ", "bfloat16[8,512]"),
        ("fp16[2..64, 128]", "float16[2..64,128]"),
        ("float[2 .. 64]", "float32[2..64]"),
        ("long[3..]", "int64[3..]"),
        ("int[4..4]", "int32[4]"),  # an empty range is a static dim
        ("bool[]", "bool[]"),
        ("double[0]", "float64[0]"),
    ],
)
def test_canonical_text(text: str, canonical: str) -> None:
    assert str(TensorSpec.parse(text)) == canonical


def test_shape_and_dynamic_dims() -> None:
    spec = TensorSpec.parse("float32[2..64,128,3..]")
    assert spec.shape == (2, 128, 3)
    assert spec.dynamic_dims == (0, 2)


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("float32", "bad input spec 'float32': expected DTYPE[D0,D1,...], e.g. float32[8,64]"),
        ("float32[8,64", "bad input spec 'float32[8,64': expected DTYPE[D0,D1,...]"),
        ("complex64[8]", "unknown dtype 'complex64' in 'complex64[8]'; known: float32, "),
        ("float32[8,]", "bad dim '': expected an integer or LO..HI"),
        ("float32[x]", "bad dim 'x': expected an integer or LO..HI"),
        ("float32[+8]", "bad dim '+8': expected an integer or LO..HI"),
        ("float32[1_0]", "bad dim '1_0': expected an integer or LO..HI"),
        ("float32[\u0668]", "bad dim '\u0668': expected an integer or LO..HI"),  # Arabic 8
        ("float32[-1]", "negative dim '-1'"),
        ("float32[1..64]", "dynamic dim '1..64' starts below 2: torch specialises sizes 0 and 1"),
        ("float32[0..]", "dynamic dim '0..' starts below 2"),
        ("float32[64..2]", "dynamic dim '64..2' has its upper bound below its lower bound"),
        ("float32[..64]", "bad dynamic dim '..64': expected LO..HI or LO.."),
        ("float32[2..x]", "bad dynamic dim '2..x': expected LO..HI or LO.."),
        ("float32[1,2,3,4,5,6,7,8,9]", "input spec 'float32[1,2,3,4,5,6,7,8,9]' has more than 8"),
    ],
)
def test_bad_spec_messages(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        TensorSpec.parse(text)


def test_spec_must_be_text() -> None:
    with pytest.raises(SpecError, match="input spec must be a string like 'float32\\[8,64\\]'"):
        TensorSpec.parse(8)  # type: ignore[arg-type]


def test_inputs_must_be_a_list() -> None:
    with pytest.raises(SpecError, match="inputs must be a list of specs"):
        parse_inputs("float32[8]")


@pytest.mark.parametrize(
    ("lo", "hi", "message"),
    [
        (-1, -1, "negative dim -1"),
        (5, 3, "dim 5..3 has its upper bound below its lower bound"),
        (1, 8, "dynamic dim 1..8 starts below 2"),
        (0, None, "dynamic dim 0.. starts below 2"),
        (2.0, 2.0, "dim lo must be an int, got 2.0"),
        (True, True, "dim lo must be an int, got True"),
    ],
)
def test_dim_built_in_code_is_checked(lo: object, hi: object, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        Dim(lo, hi)  # type: ignore[arg-type]


def test_tensor_spec_built_in_code_is_checked() -> None:
    with pytest.raises(SpecError, match="unknown dtype 'bf16'"):
        TensorSpec("bf16", (Dim(8, 8),))  # aliases are for text only
    with pytest.raises(SpecError, match="dims must be a tuple of Dim"):
        TensorSpec("float32", [Dim(8, 8)])  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="has more than 8 dims"):
        TensorSpec("float32", (Dim(1, 1),) * 9)


# --------------------------------------------------------------------------- #
# Cover
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("artifact", "request_", "covered"),
    [
        ("float32[8,64]", "float32[8,64]", True),
        ("float32[8,64]", "float32[8,65]", False),
        ("float32[8,64]", "bfloat16[8,64]", False),
        ("float32[2..64,64]", "float32[2,64]", True),
        ("float32[2..64,64]", "float32[64,64]", True),
        ("float32[2..64,64]", "float32[65,64]", False),
        ("float32[2..64,64]", "float32[1,64]", False),
        ("float32[2..64,64]", "float32[4..8,64]", True),
        ("float32[2..64,64]", "float32[4..,64]", False),
        ("float32[2..,64]", "float32[4..,64]", True),
        ("float32[3..,64]", "float32[2..,64]", False),
        ("float32[8,64]", "float32[2..8,64]", False),
        ("float32[8]", "float32[8,1]", False),
    ],
)
def test_covers(artifact: str, request_: str, covered: bool) -> None:
    assert TensorSpec.parse(artifact).covers(TensorSpec.parse(request_)) is covered


def test_inputs_cover_needs_same_count_and_order() -> None:
    a = parse_inputs(["float32[8]", "int64[8]"])
    assert inputs_cover(a, parse_inputs(["float32[8]", "int64[8]"]))
    assert not inputs_cover(a, parse_inputs(["int64[8]", "float32[8]"]))
    assert not inputs_cover(a, parse_inputs(["float32[8]"]))


# --------------------------------------------------------------------------- #
# Options, grad mode, job specs
# --------------------------------------------------------------------------- #


@given(
    st.builds(
        CompileOptions,
        mode=st.sampled_from(["default", "max-autotune", "max-autotune-no-cudagraphs"]),
        guard_filter=st.sampled_from(["drop-unserializable", "keep-all"]),
        disable_guard_check=st.booleans(),
    ) | st.builds(
        CompileOptions,
        backend=st.sampled_from(["eager", "aot_eager"]),
        guard_filter=st.sampled_from(["drop-unserializable", "keep-all"]),
        disable_guard_check=st.booleans(),
    )
)
def test_options_round_trip(options: CompileOptions) -> None:
    assert CompileOptions.from_json(options.to_json()) == options
    assert CompileOptions.from_json(json.loads(options.canonical())) == options


def test_options_without_disable_guard_check_keep_their_stored_text() -> None:
    # Rows and build keys stored before the option existed must still match.
    assert CompileOptions().canonical() == (
        '{"backend":"inductor","guard_filter":"drop-unserializable","mode":"default"}')
    on = CompileOptions(disable_guard_check=True)
    assert on.to_json()["disable_guard_check"] is True
    assert on != CompileOptions() and on.canonical() != CompileOptions().canonical()
    assert CompileOptions.from_json({"disable_guard_check": "true"}) == on


def test_backends() -> None:
    for backend in ("inductor", "eager", "aot_eager"):
        assert CompileOptions(backend=backend).backend == backend
    with pytest.raises(SpecError, match="mode 'max-autotune' is an inductor mode; "
                                        "backend 'eager' has none"):
        CompileOptions(mode="max-autotune", backend="eager")
    keys = {build_key(fingerprint="f", inputs=parse_inputs(["float32[2]"]),
                      grad_mode=GradMode.INFERENCE, options=o, target="cpu")
            for o in (CompileOptions(), CompileOptions(backend="eager"),
                      CompileOptions(backend="aot_eager"),
                      CompileOptions(disable_guard_check=True))}
    assert len(keys) == 4


def test_options_errors() -> None:
    with pytest.raises(SpecError, match="unknown mode 'fast'; known: default, max-autotune"):
        CompileOptions(mode="fast")
    with pytest.raises(SpecError, match="unknown backend 'tvm'; known: inductor, eager, "
                                        "aot_eager"):
        CompileOptions(backend="tvm")
    with pytest.raises(SpecError, match="disable_guard_check must be true or false"):
        CompileOptions.from_json({"disable_guard_check": "yes"})
    with pytest.raises(SpecError, match="unknown guard filter 'none'"):
        CompileOptions(guard_filter="none")
    with pytest.raises(SpecError, match="unknown compile options: dynamic"):
        CompileOptions.from_json({"dynamic": True})


def test_grad_mode_text() -> None:
    assert str(GradMode.INFERENCE) == "inference"
    assert GradMode("training") is GradMode.TRAINING


JOB = {
    "name": "mlp",
    "version": "1",
    "model": {"entrypoint": "farm.zoo.mlp:build", "kwargs": {"d": 64}},
    "inputs": ["float32[2..64,64]"],
    "grad_mode": "inference",
    "options": {"mode": "default"},
    "targets": ["cpu"],
}


def test_job_spec_round_trip() -> None:
    job = JobSpec.from_json(JOB)
    assert JobSpec.from_json(job.to_json()) == job
    assert job.inputs == parse_inputs(["float32[2..64,64]"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "bad name"}, "bad model name 'bad name'"),
        ({"version": ""}, "bad version ''"),
        ({"inputs": []}, "a job needs at least one input spec"),
        ({"inputs": "float32[8]"}, "inputs must be a list of specs"),
        ({"grad_mode": "eval"}, "unknown grad_mode 'eval'; known: inference, training"),
        ({"model": {"entrypoint": "no_colon"}}, "bad entrypoint 'no_colon'"),
        ({"model": None}, "malformed job spec"),
    ],
)
def test_job_spec_errors(change: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        JobSpec.from_json({**JOB, **change})


def test_job_spec_missing_field() -> None:
    data = dict(JOB)
    del data["inputs"]
    with pytest.raises(SpecError, match="job spec is missing 'inputs'"):
        JobSpec.from_json(data)


# --------------------------------------------------------------------------- #
# Build keys
# --------------------------------------------------------------------------- #

KEY_ARGS = {
    "fingerprint": "f" * 64,
    "inputs": parse_inputs(["float32[2..64,128]", "int64[1,16]"]),
    "grad_mode": GradMode.INFERENCE,
    "options": CompileOptions(),
    "target": "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2",
}


def test_build_key_is_stable() -> None:
    # Pinned: a change here re-keys every stored build, so it must be deliberate.
    assert build_key(**KEY_ARGS) == (  # type: ignore[arg-type]
        "4d1b347fde1786d374da33b5ab0d5d67f120bfccc7c3e73fb65f643426abd573"
    )


def test_build_key_ignores_spelling() -> None:
    spelled = {**KEY_ARGS, "inputs": parse_inputs(["float [ 2..64 , 128 ]", "long[1,16]"])}
    assert build_key(**spelled) == build_key(**KEY_ARGS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"fingerprint": "e" * 64},
        {"inputs": parse_inputs(["float32[2..63,128]", "int64[1,16]"])},
        {"inputs": parse_inputs(["float32[2..64,128]"])},
        {"grad_mode": GradMode.TRAINING},
        {"options": CompileOptions(mode="max-autotune")},
        {"options": CompileOptions(guard_filter="keep-all")},
        {"target": "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2"},
    ],
)
def test_build_key_changes_with_every_part(change: dict[str, object]) -> None:
    assert build_key(**{**KEY_ARGS, **change}) != build_key(**KEY_ARGS)  # type: ignore[arg-type]


def test_key_parts_cannot_run_together() -> None:
    # The separator keeps ("ab", "c") and ("a", "bc") apart.
    assert sha256_text("ab", "c") != sha256_text("a", "bc")


def test_integer_value_ranges_parse_format_and_say_what_is_wrong() -> None:
    spec = TensorSpec.parse("int64[1,16]{0..50256}")
    assert spec.values == (0, 50256) and spec.shape == (1, 16)
    assert str(spec) == "int64[1,16]{0..50256}"
    assert TensorSpec.parse(" int32[2..8] { -5 .. 5 } ").values == (-5, 5)
    assert parse_input_list("int64[1,16]{0..96};float32[4]") == (
        TensorSpec.parse("int64[1,16]{0..96}"), TensorSpec.parse("float32[4]"))
    # The range is what verification draws, not what the artifact accepts.
    assert spec.covers(TensorSpec.parse("int64[1,16]"))
    assert TensorSpec.parse("int64[1,16]").covers(spec)
    assert spec != TensorSpec.parse("int64[1,16]")
    for bad, words in [
        ("float32[2]{0..3}", "is for integer inputs, not float32"),
        ("int8[2]{0..300}", "does not fit int8"),
        ("int64[2]{5..1}", "upper bound below its lower"),
        ("int64[2]{a..b}", "expected {LO..HI}"),
        ("int64[2]{7}", "expected {LO..HI}"),
        ("int64[2]{+1..3}", "expected {LO..HI}"),
    ]:
        with pytest.raises(SpecError, match=re.escape(words)):
            TensorSpec.parse(bad)


def test_the_api_pattern_takes_what_the_parser_takes() -> None:
    from registry.api.schemas import INPUT_PATTERN

    for text in ["int64[1,16]{0..50256}", "int32[2..8]{-5..5}", "float32[2..64,128]",
                 "bool[]"]:
        assert re.match(INPUT_PATTERN, text), text
        assert str(TensorSpec.parse(text)) == text
    for text in ["int64[1]{7}", "int64[1]{..3}"]:
        assert not re.match(INPUT_PATTERN, text), text


def test_external_data_names_a_functions_globals() -> None:
    job = JobSpec.from_json({**JOB, "model": {"entrypoint": "progs:use_net", "kind": "function",
                                              "external_data": ["net"]}})
    assert job.model.external_data == ("net",)
    assert JobSpec.from_json(job.to_json()) == job
    # Left out when empty: specs stored before it keep their JSON.
    assert "external_data" not in JobSpec.from_json(JOB).to_json()["model"]
    for model, words in [
        ({"entrypoint": "m:f", "external_data": ["net"]}, "is for a free function"),
        ({"entrypoint": "m:f", "kind": "function", "external_data": ["a-b"]}, "identifiers"),
        ({"entrypoint": "m:f", "kind": "function", "external_data": ["a", "a"]}, "twice"),
        ({"entrypoint": "m:f", "kind": "function", "external_data": "net"}, "a list of names"),
    ]:
        with pytest.raises(SpecError, match=words):
            JobSpec.from_json({**JOB, "model": model})


# --- keyword and structured inputs --------------------------------------------------


def test_named_inputs_round_trip_in_one_canonical_order() -> None:
    typed = ["input_ids=int64[1,16]{0..31999}", "attention_mask=int64[1,16]{0..1}"]
    specs = parse_inputs(typed)
    text = format_inputs(specs)
    # Keywords by name, whatever order they were typed in: one call, one text.
    assert text == "attention_mask=int64[1,16]{0..1};input_ids=int64[1,16]{0..31999}"
    assert parse_input_list(text) == specs == parse_inputs(reversed(typed))
    assert [s.name for s in specs] == ["attention_mask", "input_ids"]


def test_positional_inputs_keep_their_text_and_order() -> None:
    # Stored specs have no names: their text, order and build keys are unchanged.
    typed = ["int64[1,16]", "float32[2..64,128]"]
    assert format_inputs(parse_inputs(typed)) == "int64[1,16];float32[2..64,128]"


def test_call_args_builds_the_call_and_call_leaves_inverts_it() -> None:
    from farm.core.inputs import call_args, call_leaves

    specs = parse_inputs(["float32[4]", "1.b=float32[2]", "1.a=int64[3]", "float32[5]",
                          "k.z.y=float32[1]", "k.a=float32[1]", "mask=bool[4]"])
    assert format_inputs(specs) == ("float32[4];1.a=int64[3];1.b=float32[2];float32[5];"
                                    "k.a=float32[1];k.z.y=float32[1];mask=bool[4]")
    args, kwargs = call_args(specs, list("ABCDEFG"))
    assert args == ("A", {"a": "B", "b": "C"}, "D")
    assert kwargs == {"k": {"a": "E", "z": {"y": "F"}}, "mask": "G"}
    # A node's call with its keys in another order maps back to the same leaves.
    assert call_leaves(specs, args, {"mask": "G", "k": {"z": {"y": "F"}, "a": "E"}}) == list(
        "ABCDEFG")
    with pytest.raises(SpecError, match="no keyword 'mask'"):
        call_leaves(specs, args, {"k": kwargs["k"]})
    with pytest.raises(SpecError, match="keyword 'extra', which no input spec describes"):
        call_leaves(specs, args, {**kwargs, "extra": 1})


@pytest.mark.parametrize(
    ("inputs", "words"),
    [
        (["x=float32[1]", "x=float32[2]"], "name the same argument"),
        (["b=float32[1]", "b.x=float32[1]"], "one is a tensor, the other a key inside it"),
        (["1.x=float32[1]"], "positional argument 0 has no input spec"),
        (["0=float32[1]"], "bad input name '0'"),
        (["a.0=float32[1]"], "bad input name 'a.0'"),
        (["a-b=float32[1]"], "bad input name 'a-b'"),
    ],
)
def test_named_input_errors(inputs: list[str], words: str) -> None:
    with pytest.raises(SpecError, match=re.escape(words)):
        parse_inputs(inputs)


def test_named_inputs_cover_by_name_not_order() -> None:
    built = parse_inputs(["a=float32[2..8]", "b=float32[3]"])
    assert inputs_cover(built, [TensorSpec.parse("b=float32[3]"),
                                TensorSpec.parse("a=float32[4]")])
    assert not inputs_cover(built, parse_inputs(["float32[4]", "float32[3]"]))
    assert not inputs_cover(built, parse_inputs(["a=float32[4]", "c=float32[3]"]))


def test_job_spec_puts_named_inputs_in_canonical_order() -> None:
    spec = JobSpec(name="m", version="1", model=ModelRef("pkg.mod:make"),
                   inputs=(TensorSpec.parse("z=float32[1]"), TensorSpec.parse("a=float32[1]")))
    assert [s.name for s in spec.inputs] == ["a", "z"]
    assert JobSpec.from_json(spec.to_json()) == spec


def test_the_api_pattern_takes_named_inputs() -> None:
    from registry.api.schemas import INPUT_PATTERN

    for text in ["input_ids=int64[1,16]{0..31999}", "batch.x=float32[4,8]", "0.x=float32[4]"]:
        assert re.match(INPUT_PATTERN, text), text
        assert str(TensorSpec.parse(text)) == text
    for text in ["0=float32[4]", "a-b=float32[4]"]:
        assert not re.match(INPUT_PATTERN, text), text
