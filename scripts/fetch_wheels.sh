#!/usr/bin/env bash
# On a machine that reaches the package registry: the wheel directory that scripts/gpu_check.sh installs
# offline (WHEELS=DIR) on a GPU machine without network. Binary wheels of packtrain's runtime dependencies and
# of the GPU tests' test dependencies, for the target's Python and platform, with their own dependencies
# resolved by pip, less torch (the target keeps its CUDA build) and less what the target already has.
#
#   scripts/fetch_wheels.sh [DIR]                            # DIR defaults to .whl (in the repo root)
#   PYTHON_VERSION=3.11 scripts/fetch_wheels.sh /tmp/wheels  # for another Python
#   DRY_RUN=1 scripts/fetch_wheels.sh                        # print the commands, run nothing
#
# Environment:
#   PYTHON_VERSION  target Python, X.Y (default 3.12: the H200 machine's)
#   PLATFORMS       target platform tags, space-separated (default: manylinux x86_64, glibc 2.28 and older)
#   IMPLEMENTATION  target implementation (default cp)
#   TARGET_HAS      file of package names the target already has, left out (default scripts/device_packages.txt;
#                   empty: leave nothing out but EXCLUDE)
#   EXCLUDE         project requirements never fetched (default "torch wandb": the target's own torch; W&B is
#                   off in the GPU check and its wheels weigh ~25 MB)
#   TEST_DEPS       requirements taken from the `dev` extra (default "pytest hypothesis": what the GPU tests import)
#   SDIST_ONLY      pure-Python packages published without a wheel, built into wheels here with `pip wheel
#                   --no-deps` (default antlr4-python3-runtime==4.9.3, which hydra-core 1.3 pins)
#   PY              the Python whose pip runs here (default python3; needs Python >= 3.11 for tomllib)
# DIR may hold only .whl files (they are replaced). Prints the wheels and their total size at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-.whl}"
PY="${PY:-python3}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
IMPLEMENTATION="${IMPLEMENTATION:-cp}"
PLATFORMS="${PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64}"
TARGET_HAS="${TARGET_HAS-scripts/device_packages.txt}"
EXCLUDE="${EXCLUDE-torch wandb}"
TEST_DEPS="${TEST_DEPS-pytest hypothesis}"
SDIST_ONLY="${SDIST_ONLY-antlr4-python3-runtime==4.9.3}"
DRY_RUN="${DRY_RUN:-0}"

die() { echo "fetch_wheels.sh: $*" >&2; exit 1; }
run() {  # print a command (shell-quoted), then run it unless DRY_RUN=1
    echo "+ ${*@Q}"
    [ "$DRY_RUN" = 1 ] || "$@"
}

[[ "$PYTHON_VERSION" =~ ^3\.[0-9]+$ ]] || die "PYTHON_VERSION must look like 3.12, got '$PYTHON_VERSION'"
[ -z "$TARGET_HAS" ] || [ -f "$TARGET_HAS" ] || die "TARGET_HAS: no file $TARGET_HAS"

# The names are compared in their canonical form (Hydra_Core == hydra-core), here and when pruning.
helper() {  # helper requirements | helper prune DIR
    "$PY" - "$TARGET_HAS" "$EXCLUDE" "$TEST_DEPS" "$@" <<'PYEOF'
import os
import re
import sys
import tomllib

def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()

def name_of(requirement):
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))

target_has_file, exclude, test_deps, mode, *rest = sys.argv[1:]
skip = {canonical(n) for n in exclude.split()}
if target_has_file:
    for line in open(target_has_file):
        line = line.split("#", 1)[0].strip()
        if line:
            skip.add(canonical(line))
if mode == "requirements":  # pyproject's dependencies and TEST_DEPS from the dev extra, less what is skipped
    project = tomllib.load(open("pyproject.toml", "rb"))["project"]
    wanted_tests = {canonical(n) for n in test_deps.split()}
    requirements = list(project["dependencies"])
    requirements += [r for r in project["optional-dependencies"]["dev"] if name_of(r) in wanted_tests]
    for r in requirements:
        if name_of(r) not in skip:
            print(r.split(";")[0].strip())
elif mode == "prune":  # delete the wheels of skipped packages (dependencies the target already has)
    directory = rest[0]
    for wheel in sorted(os.listdir(directory)):
        if wheel.endswith(".whl") and canonical(wheel.split("-")[0]) in skip:
            os.remove(os.path.join(directory, wheel))
            print(f"  left out {wheel}: the target has it (or EXCLUDE names it)")
PYEOF
}

requirements_text="$(helper requirements)" || die "cannot read the requirements from pyproject.toml"
REQUIREMENTS=()
[ -z "$requirements_text" ] || mapfile -t REQUIREMENTS <<<"$requirements_text"
echo "# target: Python $PYTHON_VERSION ($IMPLEMENTATION), platforms: $PLATFORMS"
echo "# to fetch (with their dependencies): ${REQUIREMENTS[*]:-nothing}"
echo "# left out: ${EXCLUDE:-nothing}, and what ${TARGET_HAS:-the target} already has"

if [ "$DRY_RUN" != 1 ]; then
    mkdir -p "$DIR"
    if find "$DIR" -mindepth 1 ! -name '*.whl' | grep -q .; then die "$DIR holds files other than wheels: use an empty directory"; fi
    find "$DIR" -maxdepth 1 -name '*.whl' -delete
fi
[ "${#REQUIREMENTS[@]}" -gt 0 ] || { echo "nothing to fetch: the target has every requirement"; exit 0; }

# 1. Pure-Python packages that exist only as sdists: built into wheels here (a py3-none-any wheel runs anywhere).
for spec in $SDIST_ONLY; do
    run "$PY" -m pip wheel --quiet --no-deps --no-binary :all: --wheel-dir "$DIR" "$spec"
done

# 2. Everything else as binary wheels for the target, dependencies resolved (the wheels of step 1 satisfy their
#    pins through --find-links).
platform_args=()
for p in $PLATFORMS; do platform_args+=(--platform "$p"); done
run "$PY" -m pip download --quiet --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation "$IMPLEMENTATION" "${platform_args[@]}" --find-links "$DIR" --dest "$DIR" "${REQUIREMENTS[@]}"

# 3. Dependencies the target already has come out (numpy, pyyaml, packaging, ...): it keeps its own builds.
if [ "$DRY_RUN" = 1 ]; then
    echo "+ prune: delete from $DIR the wheels of EXCLUDE and of the packages in ${TARGET_HAS:-(none)}"
    exit 0
fi
helper prune "$DIR"
for whl in "$DIR"/*.whl; do
    case "$(basename "$whl" | tr '[:upper:]' '[:lower:]')" in
        torch-*|torchvision-*|triton-*|nvidia_*) die "$(basename "$whl") would replace the target's torch stack" ;;
    esac
done
echo "# wheels in $DIR:"
ls -1 "$DIR"
echo "# total: $(du -cb "$DIR"/*.whl | tail -1 | cut -f1) bytes ($(du -sh "$DIR" | cut -f1)); on the GPU machine: WHEELS=$DIR scripts/gpu_check.sh"
