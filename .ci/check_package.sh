#!/usr/bin/env bash
# The release as users get it: build the sdist and the wheel (the wheel from the sdist), check what
# they hold, install the wheel into a fresh venv with no extras, then with each user extra, and use
# it there (.ci/package_smoke.py). A file missing from the wheel or a dependency missing from its
# metadata fails here. Run by `make package-check` and .ci/run.
#   PYTHON: an interpreter with build and setuptools (the dev extra), default .venv/bin/python
#   SHARED: the shared/ folder with tatblimp/test.jsonl, default ../shared
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
BENCHMARK=$(cd "${SHARED:-$REPO/../shared}" && pwd)/tatblimp/test.jsonl
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS
step() { echo "== $1 ($((SECONDS - start)) s)"; }

step "build (no isolation: setuptools from $PYTHON, nothing downloaded)"
"$PYTHON" -m build --no-isolation --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/*.whl)
SDIST=$(ls "$WORK"/dist/*.tar.gz)
echo "$(basename "$SDIST") $(basename "$WHEEL")"

step "contents"
"$PYTHON" - "$REPO" "$WHEEL" "$SDIST" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path

repo, wheel, sdist = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
modules = {p.relative_to(repo).as_posix() for p in (repo / "tatblimp_callback").rglob("*.py")}
in_wheel = set(zipfile.ZipFile(wheel).namelist())
dist_info = next(n.split("/")[0] for n in in_wheel if n.endswith(".dist-info/METADATA"))
wanted = modules | {"tatblimp_callback/py.typed", f"{dist_info}/licenses/LICENSE", f"{dist_info}/entry_points.txt"}
missing = sorted(wanted - in_wheel)
with tarfile.open(sdist) as archive:
    root = archive.getnames()[0].split("/")[0]
    in_sdist = {n.removeprefix(root + "/") for n in archive.getnames()}
missing += [f"sdist: {n}" for n in sorted({"LICENSE", "README.md", "pyproject.toml", "tatblimp_callback/py.typed"} | modules) if n not in in_sdist]
metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
for line in ("License-Expression: Apache-2.0", "License-File: LICENSE", "Provides-Extra: endpoint", "Provides-Extra: plot"):
    if line not in metadata.splitlines():
        missing.append(f"METADATA line {line!r}")
if missing:
    sys.exit(f"missing from the release: {missing}")
print(f"wheel: {len(modules)} modules, py.typed, LICENSE; sdist: LICENSE, README.md, pyproject.toml")
EOF

step "fresh venv, no extras"
"$PYTHON" -m venv "$WORK/venv"  # from a venv's interpreter too: nothing of that venv is inherited
PIP="$WORK/venv/bin/pip"
# The CPU wheel of torch first, so the project's torch range installs nothing more.
"$PIP" install -q torch==2.13.0
"$PIP" install -q "$WHEEL"
"$PIP" check
# From $WORK, not the checkout: the installed package is the one imported.
cd "$WORK"
SMOKE="$WORK/venv/bin/python $REPO/.ci/package_smoke.py"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
$SMOKE base "$WORK" "$BENCHMARK"

for extra in plot endpoint; do
    step "with [$extra]"
    "$PIP" install -q "$WHEEL[$extra]"
    "$PIP" check
    $SMOKE "$extra" "$WORK" "$BENCHMARK"
done
echo "package check passed in $((SECONDS - start)) s"
