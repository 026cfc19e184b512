#!/usr/bin/env bash
# edgevl on aarch64, checked under emulation (docs/arm.md, sections 3 and 4).
#
# Debian's arm64 Python 3.11 (unpacked from its .deb files) and the aarch64 wheels of ncnn,
# numpy, Pillow, tokenizers and jinja2 (the host's versions) run under qemu-aarch64-static with
# this checkout on PYTHONPATH. They run the README's demo command and the cases of
# scripts/aarch64_check.py on two emulated CPUs, and the answers are compared with this
# machine's: fp32 greedy tokens must equal the PyTorch reference and x86 exactly; fp16/bf16/q8
# logits must stay within the test suite's tolerances of x86's. Exit status 1 says what differed.
#
# Nothing is installed on the host and its Python is untouched: qemu, the arm64 Python and the
# wheels are unpacked under .cache/aarch64 (ignored by git, kept between runs; delete it to
# start over). Needs an x86-64 Debian/Ubuntu host (apt-get, dpkg-deb), network access to the
# Debian mirror and PyPI on the first run, and a host Python with torch and transformers
# (the test extra) for the reference side.
#
# Environment: PYTHON (host interpreter, default: python), EDGEVL_ARM_CACHE (download cache),
# EDGEVL_ARM_CPUS (emulated CPUs, default "cortex-a76 cortex-a72"), DEBIAN_MIRROR,
# KEEP_WORK=1 (keep the work folder for inspection).
#
# scripts/check-aarch64.sh --fp16-wide: instead of the check, the fp16 accuracy measurement at
# real layer widths that docs/arm.md section 4 quotes (scripts/aarch64_fp16_wide.py; ~6 min of CPU).
set -euo pipefail
FP16_WIDE=0
case "${1:-}" in
    "") ;;
    --fp16-wide) FP16_WIDE=1 ;;
    *) echo "usage: $0 [--fp16-wide]" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python}"
CACHE="${EDGEVL_ARM_CACHE:-$REPO/.cache/aarch64}"
# ncnn picks its ARM kernels by CPU feature: cortex-a76 stands for ARMv8.2 with fp16 arithmetic and
# dot product (Pi 5, RK3588, and RK3566/RK3568's Cortex-A55), cortex-a72 for ARMv8.0 (Pi 4, A53
# boards). "max" (ARMv8.6+: bf16 and i8mm paths, no board named in docs/arm.md) can be added.
CPUS="${EDGEVL_ARM_CPUS:-cortex-a76 cortex-a72}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm  # its python3.11 matches the cp311 wheels
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
DEBS="libc6 libgcc-s1 libstdc++6 libgomp1 zlib1g libexpat1 libssl3 libffi8 libbz2-1.0 liblzma5
      libcrypt1 libuuid1 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libdb5.3 libnsl2 libtirpc3
      libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
      python3.11-minimal libpython3.11-minimal libpython3.11-stdlib"
WHEELS="ncnn numpy pillow tokenizers jinja2"

T0=$SECONDS
say() { echo "[check-aarch64 $((SECONDS - T0))s] $*" >&2; }
die() { echo "check-aarch64: error: $*" >&2; exit 2; }

[ "$(uname -m)" = x86_64 ] || die "this check emulates aarch64 on an x86-64 host; this host is $(uname -m)"
for tool in apt-get dpkg-deb tar; do
    command -v "$tool" >/dev/null || die "$tool not found: the check unpacks Debian packages (run it on Debian/Ubuntu)"
done
[ -f "$KEYRING" ] || die "$KEYRING is missing: install the debian-archive-keyring package"
"$PY" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('torch', 'transformers', 'edgevl'))))" \
    || die "'$PY' cannot import torch, transformers and edgevl: activate the venv of the README set-up (or set PYTHON)"

# --- Debian packages: a private apt state, so the host's apt and dpkg configuration are untouched
APT="$CACHE/apt"
apt_private() {
    apt-get -q -o Dir::Etc="$APT/etc" -o Dir::State="$APT/state" -o Dir::State::status="$APT/state/status" \
        -o Dir::Cache="$APT/cache" -o APT::Architecture=amd64 -o APT::Architectures::=amd64 \
        -o APT::Architectures::=arm64 -o APT::Sandbox::User=root -o Debug::NoLocking=1 "$@"
}
apt_update() {
    say "fetching Debian $SUITE package lists from $MIRROR"
    apt_private update >"$APT/update.log" 2>&1 && ! grep -q '^\(E:\|Err:\)' "$APT/update.log" || {
        cat "$APT/update.log" >&2
        die "could not download Debian's package lists from $MIRROR (no network, or the mirror is down; set DEBIAN_MIRROR to another mirror)"
    }
}

QEMU="$(command -v qemu-aarch64-static || true)"
WANT_DEBS="$(for p in $DEBS; do echo "$p:arm64"; done; [ -n "$QEMU" ] || echo qemu-user-static:amd64)"
ROOT="$CACHE/root"
if [ "$(cat "$ROOT/.debs" 2>/dev/null)" != "$WANT_DEBS" ]; then
    rm -rf "$APT" "$ROOT" "$CACHE/qemu"
    mkdir -p "$APT"/etc/{apt.conf.d,preferences.d,sources.list.d} "$APT"/state/lists/partial \
             "$APT"/cache/archives/partial "$APT/debs"
    : >"$APT/state/status"
    echo "deb [arch=amd64,arm64 signed-by=$KEYRING] $MIRROR $SUITE main" >"$APT/etc/sources.list"
    apt_update
    say "downloading $(echo "$WANT_DEBS" | wc -l) Debian packages (arm64 Python 3.11 and its libraries$([ -n "$QEMU" ] || echo ", qemu-user-static"))"
    # shellcheck disable=SC2086
    (cd "$APT/debs" && apt_private download $WANT_DEBS) >"$APT/download.log" 2>&1 || {
        cat "$APT/download.log" >&2
        die "could not download the Debian packages listed above from $MIRROR (network, or a package vanished from $SUITE: delete $CACHE and retry)"
    }
    mkdir -p "$ROOT.new"
    for deb in "$APT"/debs/*_arm64.deb; do dpkg-deb -x "$deb" "$ROOT.new"; done
    if [ -z "$QEMU" ]; then
        mkdir -p "$CACHE/qemu"
        dpkg-deb --fsys-tarfile "$APT"/debs/qemu-user-static_*_amd64.deb \
            | tar -x -O ./usr/bin/qemu-aarch64-static >"$CACHE/qemu/qemu-aarch64-static"
        chmod +x "$CACHE/qemu/qemu-aarch64-static"
    fi
    rm -rf "$APT/debs" "$APT/cache"  # unpacked: the .deb files are not needed again
    echo "$WANT_DEBS" >"$ROOT.new/.debs"
    mv "$ROOT.new" "$ROOT"
fi
QEMU="${QEMU:-$CACHE/qemu/qemu-aarch64-static}"
QEMU_CPUS="$("$QEMU" -cpu help || true)"  # it exits 1 after listing
grep -q "Available CPUs" <<<"$QEMU_CPUS" || die "$QEMU does not run"
for cpu in $CPUS cortex-a76; do
    grep -qx " *$cpu" <<<"$QEMU_CPUS" || die "$QEMU does not emulate CPU '$cpu' (qemu 7.1+ is needed for cortex-a76)"
done

# --- aarch64 wheels: the host's versions, so both sides run the same ncnn and numpy
PINS="$("$PY" -c "
import sys
from importlib.metadata import version
print(' '.join(f'{p}=={version(p)}' for p in sys.argv[1:]))" $WHEELS)"
SITE="$CACHE/site"
if [ "$(cat "$SITE/.pins" 2>/dev/null)" != "$PINS" ]; then
    say "downloading the aarch64 wheels: $PINS (and their dependencies)"
    PLATFORMS="--platform manylinux2014_aarch64"
    for v in $(seq 17 36); do PLATFORMS="$PLATFORMS --platform manylinux_2_${v}_aarch64"; done  # bookworm: glibc 2.36
    TAGS="--only-binary=:all: $PLATFORMS --python-version 3.11 --implementation cp --abi cp311"
    quiet_pip() {  # pip's status, its messages without the noise of absent local indexes
        local rc=0
        "$PY" -m pip -q --disable-pip-version-check "$@" >"$CACHE/pip.log" 2>&1 || rc=$?
        grep -v "is ignored: it is neither" "$CACHE/pip.log" >&2 || true
        return $rc
    }
    mkdir -p "$CACHE"
    # shellcheck disable=SC2086
    quiet_pip download -d "$CACHE/wheels" $TAGS $PINS || die "could not download the aarch64 wheels (pip's \
messages are above): PyPI unreachable, or no manylinux aarch64 wheel for CPython 3.11 of the host's versions ($PINS)"
    rm -rf "$SITE.new"
    # shellcheck disable=SC2086
    quiet_pip install --no-index --find-links "$CACHE/wheels" --target "$SITE.new" $TAGS $PINS \
        || die "could not unpack the aarch64 wheels into $SITE.new (pip's messages are above)"
    for p in $WHEELS; do
        grep -iq "^$p-.*\.dist-info$" <<<"$(ls "$SITE.new")" || die "$p is missing from $SITE.new after pip install"
    done
    echo "$PINS" >"$SITE.new/.pins"
    rm -rf "$SITE"
    mv "$SITE.new" "$SITE"
fi

# --- run
WORK="$(mktemp -d "${TMPDIR:-/tmp}/edgevl-aarch64.XXXXXX")"
if [ "${KEEP_WORK:-0}" = 1 ]; then say "work folder: $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
mkdir -p "$WORK/home" "$WORK/demo"

quiet() {  # run a host command without transformers' progress bars; its own exit status (pipefail)
    "$@" 2>&1 | { grep -v "Loading weights\|Writing model shards" || true; } >&2
}
arm_python() {  # CPU THREADS ARGS...: the emulated Python, with a clean environment
    local cpu="$1" threads="$2"
    shift 2
    env -i PATH=/usr/bin:/bin HOME="$WORK/home" LANG=C.UTF-8 "$QEMU" -cpu "$cpu" -L "$ROOT" \
        -E LD_LIBRARY_PATH="$ROOT/lib/aarch64-linux-gnu:$ROOT/usr/lib/aarch64-linux-gnu" \
        -E PYTHONPATH="$SITE:$REPO" -E PYTHONNOUSERSITE=1 -E PYTHONDONTWRITEBYTECODE=1 \
        -E EDGEVL_CACHE="$WORK/aarch64-cache" -E EDGEVL_THREADS="$threads" -E TOKENIZERS_PARALLELISM=false \
        ${ARM_FP16_VARIANT:+-E ARM_FP16_VARIANT="$ARM_FP16_VARIANT"} "$ROOT/usr/bin/python3.11" -X faulthandler "$@"
}
arm_python cortex-a76 1 -c "import platform, ncnn, numpy, PIL, tokenizers, jinja2, edgevl
assert platform.machine() == 'aarch64', platform.machine()" \
    || die "the emulated aarch64 Python cannot import edgevl's dependencies (message above); delete $CACHE and retry"

if [ "$FP16_WIDE" = 1 ]; then
    say "fp16 at Youtu-LLM-2B layer widths: host side"
    TRANSFORMERS_VERBOSITY=error PYTHONPATH="$REPO" quiet "$PY" "$REPO/scripts/aarch64_fp16_wide.py" host "$WORK" \
        || die "the host side failed (above)"
    say "emulated cortex-a76: fp16 arithmetic (the default there) and fp16 storage only, in parallel"
    arm_python cortex-a76 1 "$REPO/scripts/aarch64_fp16_wide.py" target "$WORK" a76-fp16-arithmetic &
    a=$!
    ARM_FP16_VARIANT=storage arm_python cortex-a76 1 "$REPO/scripts/aarch64_fp16_wide.py" target "$WORK" a76-fp16-storage-only &
    b=$!
    wait $a && wait $b || die "an emulated run failed (above)"
    PYTHONPATH="$REPO" "$PY" "$REPO/scripts/aarch64_fp16_wide.py" report "$WORK" a76-fp16-arithmetic a76-fp16-storage-only
    exit 0
fi

say "demo command on emulated aarch64 (cortex-a76), PyTorch reference and x86 side on the host"
# the demo converts the shipped model on aarch64 too (its own cache)
(cd "$WORK/demo" && arm_python cortex-a76 1 -m edgevl run --image demo --seed 37 --prompt "Describe the image." \
    >"$WORK/aarch64-demo.txt" 2>"$WORK/aarch64-demo.err") &
demo_pid=$!
EDGEVL_THREADS=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$REPO" \
    quiet "$PY" "$REPO/scripts/aarch64_check.py" host "$WORK" || die "the host side failed (above)"
wait "$demo_pid" || { echo "--- aarch64 demo command failed:" >&2; cat "$WORK/aarch64-demo.err" >&2; }

say "parity cases on emulated aarch64: $CPUS (emulated timings are not speed figures)"
pids=()
for cpu in $CPUS; do
    arm_python "$cpu" 1 "$REPO/scripts/aarch64_check.py" target "$WORK" "$cpu" >"$WORK/$cpu.log" 2>&1 &
    pids+=($!)
done
i=0
for cpu in $CPUS; do
    wait "${pids[$i]}" || { echo "--- the emulated run on $cpu failed:" >&2; tail -n 40 "$WORK/$cpu.log" >&2; }
    i=$((i + 1))
done

# shellcheck disable=SC2086
if PYTHONPATH="$REPO" "$PY" "$REPO/scripts/aarch64_check.py" compare "$WORK" $CPUS "$WORK/aarch64-demo.txt"; then
    say "done"
else
    say "FAILED"
    exit 1
fi
