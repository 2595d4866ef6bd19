"""Regenerates the committed protobuf/gRPC Python code from protos/ (`make protos`).

protoc names generated modules after the proto import path (`policyloop.v1.bus_pb2`); the
library keeps them under `policyloop.contracts.v1`, so imports between generated modules are
rewritten. `--check` regenerates into memory and exits 1 when the committed files are stale.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = PROTO_ROOT / "policyloop" / "v1"
OUTPUT_DIR = Path(__file__).resolve().parent / "v1"
# `from policyloop.v1 import x_pb2` and, for a public import, `from policyloop.v1.x_pb2 import ...`.
_IMPORT_RE = re.compile(r"^from policyloop\.v1(?=[. ])", re.MULTILINE)


def generate() -> dict[str, str]:
    """Runs protoc (from grpcio-tools) and returns {file name: rewritten source}."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_PACKAGE_DIR.glob("*.proto"))
    well_known = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        generated = Path(out) / "policyloop" / "v1"
        return {
            p.name: _IMPORT_RE.sub("from policyloop.contracts.v1", p.read_text())
            for p in sorted(generated.iterdir())
            if p.suffix in {".py", ".pyi"}
        }


def stale_files(files: dict[str, str]) -> list[str]:
    """Names of committed files that differ from `files`, are missing, or are extra."""
    committed = {p.name for p in OUTPUT_DIR.glob("*_pb2*.py*")}
    stale = [n for n, src in files.items() if not (OUTPUT_DIR / n).exists()
             or (OUTPUT_DIR / n).read_text() != src]
    return sorted(stale + sorted(committed - set(files)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args(argv)
    files = generate()
    if args.check:
        stale = stale_files(files)
        if stale:
            print("stale generated contracts (run `make protos`): " + ", ".join(stale))
            return 1
        print("generated contracts are up to date")
        return 0
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    for old in OUTPUT_DIR.glob("*_pb2*.py*"):
        old.unlink()
    for name, src in files.items():
        (OUTPUT_DIR / name).write_text(src)
    init = '"""Generated from protos/policyloop/v1 by `make protos`; do not edit."""\n'
    (OUTPUT_DIR / "__init__.py").write_text(init)
    print(f"wrote {len(files)} files to {OUTPUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
