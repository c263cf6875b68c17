"""Resolve answer size against the model's parameter count.

    .venv/bin/python bench/resolve_answer_size.py [--out FILE]

Makes a scratch farm (SQLite, migrated to head, in a temporary directory) and
stores, the way a compile worker does (``service.finish_compile``), one
version of each of three models shaped like Llama-2 7B, 13B and 70B: each
with two artifacts (aoti and aot_compile) whose meta holds the weights
manifest a real build records (one entry per parameter and buffer: 291, 363
and 723 of them) and the verification report, and whose build statement is
a real one (``farm.build.provenance.build_statement``) signed by a builder
key, manifest included. Then resolves each through the API (FastAPI's
TestClient: the app as ``farm serve`` runs it) and prints the answer's size,
and the size of the build statement a node fetches once by digest where the
API serves it (``/v1/attestations/<digest>``).

Run from an older checkout, the same script measures the answer before
(bench/results/resolve_answer_size-2026-12-05.txt holds both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2"
INPUTS = ["int64[1,128]"]
# (name, layers, hidden, intermediate, kv width, vocab): Llama-2's shapes.
SHAPES = (
    ("llama-7b", 32, 4096, 11008, 4096, 32000),
    ("llama-13b", 40, 5120, 13824, 5120, 32000),
    ("llama-70b", 80, 8192, 28672, 1024, 32000),
)


def manifest(layers: int, hidden: int, inter: int, kv: int, vocab: int) -> list[dict[str, Any]]:
    """``farm.node.weight_check.weights_manifest`` of a Llama of these sizes."""

    def entry(name: str, shape: list[int]) -> dict[str, Any]:
        return {
            "name": name,
            "kind": "parameter",
            "shape": shape,
            "dtype": "bfloat16",
            "device": "cpu",
            "requires_grad": False,
            "tensor": name,
        }

    out = [entry("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            entry(p + "self_attn.q_proj.weight", [hidden, hidden]),
            entry(p + "self_attn.k_proj.weight", [kv, hidden]),
            entry(p + "self_attn.v_proj.weight", [kv, hidden]),
            entry(p + "self_attn.o_proj.weight", [hidden, hidden]),
            entry(p + "mlp.gate_proj.weight", [inter, hidden]),
            entry(p + "mlp.up_proj.weight", [inter, hidden]),
            entry(p + "mlp.down_proj.weight", [hidden, inter]),
            entry(p + "input_layernorm.weight", [hidden]),
            entry(p + "post_attention_layernorm.weight", [hidden]),
        ]
    out += [entry("model.norm.weight", [hidden]), entry("lm_head.weight", [vocab, hidden])]
    return out


def verify_report(n_outputs: int) -> dict[str, Any]:
    return {
        "ok": True,
        "max_abs_err": 0.002,
        "tol": 0.01,
        "load_s": 0.4,
        "first_call_s": 0.05,
        "format": "aoti",
        "device": "cpu",
        "sizes_checked": [[[1, 128]]],
        "outputs": [
            {
                "output": f"out[{i}]",
                "dtype": "bfloat16",
                "shape": [1, 128, 32000],
                "max_abs_err": 0.002,
                "tol": 0.01,
            }
            for i in range(n_outputs)
        ],
        "input_values": ["int64 in [0, 32000)"],
        "model_init": "fake weights",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--label", default="", help="what this checkout is (before/after)")
    args = p.parse_args(argv)

    from fastapi.testclient import TestClient

    from farm.build.provenance import build_statement
    from farm.core import attest
    from farm.core.inputs import parse_inputs
    from farm.core.keys import generate_keypair
    from farm.core.settings import Settings
    from farm.core.specs import JobSpec
    from farm.core.target import Target
    from registry import auth, service
    from registry.api import create_app
    from registry.db import Database, upgrade

    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="farm-answer-size-") as work:
        url = f"sqlite:///{work}/farm.db"
        upgrade(url)
        db = Database(url)
        target = Target.parse(TARGET)
        builder_key, builder_pub = generate_keypair()
        keyid = attest.keyid(builder_pub)
        for name, layers, hidden, inter, kv, vocab in SHAPES:
            spec = JobSpec.from_json(
                {
                    "name": name,
                    "version": "1",
                    "inputs": INPUTS,
                    "grad_mode": "inference",
                    "options": {},
                    "targets": [TARGET],
                    "model": {"entrypoint": "farm.zoo.llama:tiny", "kwargs": {}, "kind": "factory"},
                }
            )
            job = service.submit_job(db, spec, targets=[target])
            service.start_trace(db, job)
            fp = hashlib.sha256(name.encode()).hexdigest()
            [d] = service.record_trace(db, job, {"fingerprint": fp, "param_count": 1})
            assert (
                service.begin_compile(
                    db, d.build_key, worker_id="bench:1", heartbeat_max_age_s=30
                ).action
                == "run"
            )
            man = manifest(layers, hidden, inter, kv, vocab)
            arts = []
            for fmt in ("aoti", "aot_compile"):
                digest = hashlib.sha256(f"{name}/{fmt}".encode()).hexdigest()
                meta = {
                    "weights_manifest": man,
                    "verify": verify_report(1),
                    "model_class": "transformers.LlamaForCausalLM",
                }
                stmt = build_statement(
                    digest=digest,
                    size=1 << 30,
                    fmt=fmt,
                    build_key=d.build_key,
                    fingerprint=fp,
                    spec=spec,
                    target=target,
                    builder_id="bench",
                    builder_keyid=keyid,
                    built_at=attest.now_iso(),
                    meta=meta,
                    verification=verify_report(1),
                )
                envelope = json.dumps(attest.sign_statement(builder_key, stmt))
                arts.append(
                    service.NewArtifact(
                        digest=digest,
                        size=1 << 30,
                        format=fmt,
                        verified=True,
                        first_call_compiles=False,
                        max_abs_err=0.002,
                        first_call_s=0.05,
                        load_s=0.4,
                        meta=meta,
                        attestation=envelope,
                    )
                )
            service.finish_compile(
                db,
                d.build_key,
                target=target,
                spec=spec,
                fingerprint=fp,
                artifacts=arts,
                compile_s=60.0,
            )
            assert parse_inputs(INPUTS)
        token = auth.create_token(db, "bench", "read")
        settings = Settings(
            database_url=url,
            farm_home=Path(work) / "home",
            blob_store_url=Path(work, "blobs").as_uri(),
            farm_auth=True,
            broker_url="memory://",
            redis_url="",
            farm_resolve_cache_s=0,
        )
        h = {"Authorization": f"Bearer {token}"}
        lines.append(
            f"resolve answer size by model shape ({args.label or 'this checkout'}; "
            f"git {_git()}); two artifacts per version (aoti, aot_compile)"
        )
        lines.append(
            f"{'model':<10} | {'manifest':>8} | {'answer bytes':>12} | "
            f"{'statement fetched by digest':>27}"
        )
        with TestClient(create_app(settings, enqueue=lambda _: None)) as c:
            for name, layers, hidden, inter, kv, vocab in SHAPES:
                r = c.get(
                    "/v1/resolve",
                    headers=h,
                    params=[
                        ("model", name),
                        ("ref", "1"),
                        ("target", TARGET),
                        *(("input", i) for i in INPUTS),
                    ],
                )
                assert r.status_code == 200, r.text
                named = r.json()["artifact"]["attestation"].get("build_statement")
                fetched = "(in the answer)"
                if named:
                    s = c.get(named["url"], headers=h)
                    assert s.status_code == 200, s.text
                    fetched = f"{len(s.content):,} bytes, once per node"
                n = len(manifest(layers, hidden, inter, kv, vocab))
                lines.append(f"{name:<10} | {n:>8} | {len(r.content):>12,} | {fetched:>27}")
        db.dispose()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    return 0


def _git() -> str:
    import subprocess

    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=ROOT,
                text=True,
                capture_output=True,
                check=True,
            ).stdout.strip()
            or "?"
        )
    except (OSError, subprocess.CalledProcessError):
        return "? (not a git checkout)"


if __name__ == "__main__":
    os.environ.setdefault("FARM_REPORTS", "0")
    sys.exit(main())
