"""Extract the v1 `openAPIV3Schema` of a KubeRay CRD into a compact JSON file for the manifest tests.

    python tests/schemas/extract_kuberay_schema.py path/to/ray.io_rayclusters.yaml path/to/ray.io_rayservices.yaml

writes tests/schemas/kuberay/<kind>.v1.json (gzipped as .json.gz when over 300 KB) next to this script,
so that the tests validate manifests without the multi-MB CRD YAML (or the network). The schema is
copied as it is: the API-server behaviour (defaults, dropping nulls, rejecting unknown keys) is applied
by the tests when they load it.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import yaml

OUT_DIR = Path(__file__).resolve().parent / "kuberay"
GZIP_OVER_BYTES = 300 * 1024


def v1_schema(crd: dict) -> tuple[str, dict]:
    """(kind, the v1 openAPIV3Schema) of one CustomResourceDefinition."""
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"not a CustomResourceDefinition: kind={crd.get('kind')!r}")
    kind = crd["spec"]["names"]["kind"]
    for version in crd["spec"]["versions"]:
        if version["name"] == "v1":
            return kind, version["schema"]["openAPIV3Schema"]
    raise ValueError(f"{kind}: the CRD serves no v1 version")


def write_schema(kind: str, schema: dict, out_dir: Path = OUT_DIR) -> Path:
    """Compact, key-sorted JSON (stable diffs on regeneration); gzipped when large."""
    text = json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{kind.lower()}.v1.json"
    for stale in (stem, stem.with_suffix(".json.gz")):
        stale.unlink(missing_ok=True)
    if len(text.encode()) > GZIP_OVER_BYTES:
        path = stem.with_suffix(".json.gz")
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path = stem
        path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", nargs="+", type=Path, help="a KubeRay CRD YAML file (ray.io_<plural>.yaml)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader parses these files in ~1 s
    for crd_path in args.crd:
        kind, schema = v1_schema(yaml.load(crd_path.read_text(), Loader=loader))
        print(f"{crd_path} -> {write_schema(kind, schema, args.out_dir)}")


if __name__ == "__main__":
    main()
