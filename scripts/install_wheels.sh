#!/usr/bin/env bash
# Offline install of packtrain and its dependencies from a wheel directory (scripts/fetch_wheels.sh), keeping
# the torch this machine has: nothing here installs, upgrades or shadows torch.
#
#   scripts/install_wheels.sh WHEELS_DIR SITE_DIR     # then: export PYTHONPATH=SITE_DIR
#
# Every wheel of WHEELS_DIR goes into SITE_DIR (`pip install --no-index --no-deps --target`: fetch_wheels.sh
# resolved the dependencies already, and with --no-deps pip never looks at torch), then the project from this
# working tree, --no-deps too. Afterwards it checks, from outside the working tree, that torch is the same one
# (version and path) as before, that `import trainer` loads the installed copy with everything the GPU check
# imports, and lists the project requirements this machine does not meet (a warning, not an error).
# PY chooses the Python (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/install_wheels.sh WHEELS_DIR SITE_DIR"
WHEELS="${1:?$usage}"
SITE="${2:?$usage}"
PY="${PY:-python3}"
die() { echo "install_wheels.sh: $*" >&2; exit 1; }

TORCH_PROBE='import torch; print(torch.__version__, torch.__file__)'
before="$(cd / && "$PY" -c "$TORCH_PROBE")" || die "$PY cannot import torch: this script keeps the machine's torch, it does not install one"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
[ "${#wheels[@]}" -gt 0 ] || die "no wheels in $WHEELS (make them with scripts/fetch_wheels.sh)"
for whl in "${wheels[@]}"; do
    case "$(basename "$whl" | tr '[:upper:]' '[:lower:]')" in
        torch-*|torchvision-*|triton-*|nvidia_*) die "refusing $(basename "$whl"): it would shadow this machine's torch" ;;
    esac
done

mkdir -p "$SITE"
SITE="$(cd "$SITE" && pwd)"
pip_install=("$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile
             --no-cache-dir --upgrade --target "$SITE")
"${pip_install[@]}" "${wheels[@]}"
# The project itself, from this working tree (the machine's setuptools builds it); should that fail, a plain copy
# of the package does the same job (without packtrain's metadata).
had_build="$([ -e build ] && echo 1 || echo 0)"
if ! "${pip_install[@]}" --no-build-isolation .; then
    echo "install_wheels.sh: warning: pip could not build packtrain here; copying trainer/ into $SITE instead" >&2
    rm -rf "$SITE/trainer" && cp -r trainer "$SITE/"
fi
[ "$had_build" = 1 ] || rm -rf build  # setuptools' scratch directory, if it made one

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
after="$(cd / && "$PY" -c "$TORCH_PROBE")"
[ "$before" = "$after" ] || die "torch changed: before '$before', after '$after'"
for entry in "$SITE"/*; do
    case "$(basename "$entry" | tr '[:upper:]' '[:lower:]')" in
        torch*|nvidia*|triton*) die "a torch package landed in $SITE: $(basename "$entry")" ;;
    esac
done

(cd / && "$PY" - "$SITE" <<'PYEOF'
import importlib
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement

site = sys.argv[1]
# What the GPU tests and the benchmark import: the trainer (hydra, webdataset, tokenizers, ...) and the test tools.
for module in ("trainer", "trainer.train", "trainer.run.loop", "trainer.prepare", "trainer.model", "pytest", "hypothesis"):
    importlib.import_module(module)
trainer = sys.modules["trainer"]
if not trainer.__file__.startswith(site):
    sys.exit(f"install_wheels.sh: trainer imports from {trainer.__file__}, not from {site}")
try:
    requirements, version = metadata.requires("packtrain") or [], metadata.version("packtrain")
except metadata.PackageNotFoundError:  # copied, not installed: nothing to compare
    requirements, version = [], "(copied from the working tree)"
unmet = []
for text in requirements:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra (flash, deepspeed, dev)
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        unmet.append(f"{req} (not installed)")
        continue
    if not req.specifier.contains(have, prereleases=True):
        unmet.append(f"{req} (this machine has {have})")
print(f"installed into {site}: packtrain {version} and its wheels; trainer imports")
for line in unmet:
    print(f"  note: requirement not met here: {line}")
PYEOF
) || die "the installed packages do not import (see above)"
echo "torch untouched: $after"
