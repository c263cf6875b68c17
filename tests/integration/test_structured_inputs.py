"""Keyword and structured inputs through the farm: ``transformers``'
``LlamaForCausalLM`` called as ``model(input_ids=..., attention_mask=...)``
and a model whose forward takes a dict of tensors, each input with its own
spec. Submitted over HTTP, traced, compiled (eager backend: no C++ build on
this 2-core machine), verified, resolved by name, and loaded by a node in a
fresh process that calls them with keywords and compares with eager."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from farm.core.target import detect_local_target
from tests.fixtures.farm import ROOT, Farm
from tests.fixtures.node import node_python
from tests.integration.test_pipeline import farm_cli
from tests.slowdown import scaled

# Found, not imported: importing transformers takes 9 CPU-s on the CI machine
# (it indexes its 560 model folders), which every xdist worker would pay at
# collection; the tests' own children import it.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("programs"),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed")]

NODE = Path(__file__).with_name("structured_node.py")
CPU = str(detect_local_target("cpu"))
# Typed in the order a user calls them; the farm keeps them in canonical order.
LLAMA_INPUTS = ["input_ids=int64[1,16]", "attention_mask=int64[1,16]{0..1}"]
DICT_INPUTS = ["batch.x=float32[2..8,8]", "batch.mask=float32[2..8,8]", "batch.bias=float32[1]"]


def job(name: str, entry: str, inputs: list[str]) -> dict[str, Any]:
    return {"name": name, "version": "1",
            "model": {"entrypoint": f"tests.models.structured:{entry}"},
            "inputs": inputs, "options": {"backend": "eager"}, "targets": ["cpu"]}


def node(farm: Farm, model: str, entry: str, inputs: list[str], *extra: str) -> dict[str, Any]:
    args = [*node_python(), str(NODE), "--model", model,
            "--entrypoint", f"tests.models.structured:{entry}"]
    for spec in inputs:
        args += ["--input", spec]
    out = subprocess.run([*args, *extra], env={**farm.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_keyword_and_dict_inputs_through_the_farm(farm: Farm) -> None:
    llama_id = farm.submit(job("kw-llama", "hf_llama", LLAMA_INPUTS))
    dict_id = farm.submit(job("kw-dict", "dict_model", DICT_INPUTS))
    llama, batch = farm.wait_job(llama_id, timeout=900), farm.wait_job(dict_id, timeout=900)
    for j in (llama, batch):
        assert j["state"] == "succeeded", json.dumps(j, indent=1)[:6000]
    # One canonical order: keywords by name, a dict's keys sorted.
    assert llama["spec"]["inputs"] == ["attention_mask=int64[1,16]{0..1}",
                                       "input_ids=int64[1,16]"]
    assert batch["spec"]["inputs"] == sorted(DICT_INPUTS)
    (art,) = llama["builds"][0]["artifacts"]
    # The verifier called it with keywords: the ids below the embedding size,
    # the mask in its declared range, and compared the ModelOutput by value.
    rep = art["meta"]["verify"]
    assert rep["input_values"] == [
        "attention_mask=int64[1,16]{0..1}: uniform in 0..1 (declared)",
        "input_ids=int64[1,16]: uniform in 0..127 (nn.Embedding model.embed_tokens: 128 "
        "entries)"]
    assert [o["output"] for o in rep["outputs"]] == ["output.leaf0"] and rep["outputs"][0]["ok"]
    # transformers' ModelOutput is rebuilt from the collections module, which
    # the artifact now imports by name (torch saves Dynamo's by-id global of it).
    assert art["meta"]["module_imports"] == ["collections"]
    assert "backend 'eager'" in llama["builds"][0]["formats_skipped"]["aoti"]
    # The trace found the two decoder layers: `farm status` says what
    # --per-block would give (the per-block job below gets no such hint).
    assert llama["repeated_blocks"] == 2
    hint = "2 calls of repeated blocks: --per-block compiles each distinct block once"
    status = farm_cli(farm, "status", llama_id)
    assert status.returncode == 0, status.stderr
    assert f"hint: {hint}" in status.stdout, status.stdout
    page = httpx.get(f"{farm.url}/ui/jobs/{llama_id}", headers=farm.headers, timeout=30)
    assert page.status_code == 200 and hint in page.text, page.text[:3000]
    (dart,) = batch["builds"][0]["artifacts"]
    assert [o["output"] for o in dart["meta"]["verify"]["outputs"]] == [
        "output['hidden']", "output['score']"]

    with httpx.Client(base_url=farm.url, headers=farm.headers) as c:
        # Resolved by name, whatever order the node lists them in.
        r = c.get("/v1/resolve", params={"model": "kw-llama", "target": CPU,
                                         "input": list(reversed(LLAMA_INPUTS))})
        assert r.status_code == 200, r.text
        # The same tensors given positionally are another call: refused, with why.
        r = c.get("/v1/resolve", params={"model": "kw-llama", "target": CPU,
                                         "input": ["int64[1,16]", "int64[1,16]"]})
        assert r.status_code == 404, r.text
        assert r.json()["rejections"][0]["code"] == "inputs", r.text
        # A dynamic dim inside a dict input covers a smaller batch.
        r = c.get("/v1/resolve", params={"model": "kw-dict", "target": CPU, "input": [
            "batch.x=float32[3,8]", "batch.mask=float32[3,8]", "batch.bias=float32[1]"]})
        assert r.status_code == 200, r.text

    # A fresh node: left padding in the mask, keywords in, a ModelOutput out.
    got = node(farm, "kw-llama", "hf_llama", LLAMA_INPUTS, "--pad", "3")
    assert got["type"] == got["eager_type"] == (
        "transformers.modeling_outputs.CausalLMOutputWithPast"), got
    assert got["keys"] == ["logits"] and got["max_abs_err"] == 0.0, got
    got = node(farm, "kw-dict", "dict_model",
               ["batch.x=float32[5,8]", "batch.mask=float32[5,8]", "batch.bias=float32[1]"])
    assert got["type"] == "builtins.dict" and got["keys"] == ["hidden", "score"], got
    assert got["max_abs_err"] == 0.0, got

    # The CLI takes the names too.
    cli = subprocess.run([sys.executable, "-m", "farm.app.cli", "resolve", "kw-llama", "--json",
                          "--target", CPU, *[a for s in LLAMA_INPUTS for a in ("--input", s)]],
                         env=farm.env, cwd=ROOT, capture_output=True, text=True,
                         timeout=scaled(120))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert json.loads(cli.stdout)["artifact"]["inputs"] == llama["spec"]["inputs"]


def test_regional_compilation_through_the_farm(farm: Farm) -> None:
    spec = job("kw-llama-regional", "hf_llama", LLAMA_INPUTS)
    spec["options"] = {"backend": "aot_eager", "regional": True}
    no_blocks = job("kw-dict-regional", "dict_model", DICT_INPUTS)
    no_blocks["options"] = {"backend": "aot_eager", "regional": True}
    regional_id, no_blocks_id = farm.submit(spec), farm.submit(no_blocks)
    regional, refused = farm.wait_job(regional_id, timeout=900), farm.wait_job(no_blocks_id)
    assert regional["state"] == "succeeded", json.dumps(regional, indent=1)[:6000]
    (art,) = regional["builds"][0]["artifacts"]
    # Recorded on the artifact (and so in its build key), with what was stamped.
    assert art["options"]["regional"] is True
    assert art["meta"]["regional"] == {
        "blocks": {"transformers.models.llama.modeling_llama.LlamaDecoderLayer": 2}}
    # The guards on the region decorator's closure are dropped (the node's
    # class has no decorator), and listed as dropped.
    dropped = [d["name"] for d in art["meta"]["guards"]["dropped"]]
    assert any("_modules['layers']._modules['0']).__dict__)['forward'].__closure__" in n
               for n in dropped), dropped[:20]
    assert art["meta"]["verify"]["outputs"][0]["ok"]
    # A model without repeated blocks is refused, saying so.
    assert refused["state"] == "failed"
    assert "needs a block class repeated" in json.dumps(refused), json.dumps(refused)[:3000]

    with httpx.Client(base_url=farm.url, headers=farm.headers) as c:
        asked = json.dumps({"backend": "aot_eager", "regional": True})
        r = c.get("/v1/resolve", params={"model": "kw-llama-regional", "target": CPU,
                                         "input": LLAMA_INPUTS, "options": asked})
        assert r.status_code == 200, r.text
        assert r.json()["artifact"]["options"]["regional"] is True
        r = c.get("/v1/resolve", params={"model": "kw-llama-regional", "target": CPU,
                                         "input": LLAMA_INPUTS,
                                         "options": json.dumps({"backend": "aot_eager"})})
        assert r.status_code == 404 and r.json()["rejections"][0]["code"] == "options", r.text
    # A fresh node with the plain (undecorated) transformers class loads it.
    got = node(farm, "kw-llama-regional", "hf_llama", LLAMA_INPUTS, "--pad", "2")
    assert got["type"] == "transformers.modeling_outputs.CausalLMOutputWithPast", got
    assert got["max_abs_err"] < 1e-4, got


def test_per_block_compilation_through_the_farm(farm: Farm) -> None:
    """transformers' decoder layers take keywords and a tuple of tensors,
    and each keeps its own ``layer_idx``: one function serves both layers,
    and the node runs the rest of the model eagerly. (What a per-block
    build refuses, and why, is checked in tests/unit/test_blocks.py.)"""
    spec = job("kw-llama-blocks", "hf_llama", LLAMA_INPUTS)
    spec["options"] = {"backend": "aot_eager", "per_block": True}
    built = farm.wait_job(farm.submit(spec), timeout=900)
    assert built["state"] == "succeeded", json.dumps(built, indent=1)[:6000]
    (art,) = built["builds"][0]["artifacts"]
    assert art["options"]["per_block"] is True
    assert {k: art["meta"]["per_block"][k] for k in ("blocks", "functions", "shared")} == {
        "blocks": 2, "functions": 1, "shared": 1}, art["meta"]
    assert art["meta"]["verify"]["outputs"][0]["ok"]
    assert built["repeated_blocks"] == 2 and built["hints"] == []
    got = node(farm, "kw-llama-blocks", "hf_llama", LLAMA_INPUTS, "--pad", "2")
    assert got["type"] == "transformers.modeling_outputs.CausalLMOutputWithPast", got
    assert got["max_abs_err"] < 1e-4, got
