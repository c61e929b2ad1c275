#!/bin/sh
# Installs what tramprof needs from the distribution, and nothing that is
# already there: bcc's Python bindings, the BPF toolchain pieces, kernel
# headers for bcc's compiler, and Python's headers for the daemon's compiled
# part (tramprof._speedups).
#
# Headers: the exact linux-headers-$(uname -r) when the distribution has it;
# otherwise the generic headers package, linked where bcc looks for them
# (/lib/modules/$(uname -r)/build and .../source). bcc only needs them to
# compile perf-event programs; kernel struct layouts are never taken from
# them (the daemon reads field offsets from the running kernel's BTF).
#
# Usage: install-deps.sh [extra-debian-package ...]
set -eu

kernel=$(uname -r)
packages="python3-bpfcc python3-venv python3-pip python3-dev libbpf1 bpftool gcc make $*"

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-deps: apt-get not found; install by hand: $packages and kernel headers" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-deps: must run as root to install packages" >&2
    exit 1
fi

missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done

build="/lib/modules/$kernel/build"
headers=""
if [ ! -e "$build/include" ] && [ ! -e "$build/Makefile" ]; then
    headers=need
fi

updated=""
apt_update() {
    if [ -z "$updated" ]; then
        apt-get update -qq
        updated=1
    fi
}

if [ -n "$missing" ]; then
    echo "install-deps: installing$missing"
    apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

if [ -n "$headers" ]; then
    apt_update
    exact="linux-headers-$kernel"
    if apt-cache show "$exact" >/dev/null 2>&1; then
        echo "install-deps: installing $exact"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$exact" >/dev/null
    else
        arch=$(dpkg --print-architecture)
        generic="linux-headers-$arch"
        echo "install-deps: WARNING: no $exact in the distribution; using the generic $generic" >&2
        echo "install-deps: WARNING: bcc compiles against it; kernel struct offsets come from BTF" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$generic" >/dev/null
        flavour=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n 1)
        if [ -z "$flavour" ]; then
            echo "install-deps: $generic installed no /usr/src/linux-headers-*-$arch" >&2
            exit 1
        fi
        common=$(printf '%s\n' "$flavour" | sed "s/-$arch\$/-common/")
        [ -d "$common" ] || common="$flavour"
        mkdir -p "/lib/modules/$kernel"
        ln -sfn "$flavour" "/lib/modules/$kernel/build"
        ln -sfn "$common" "/lib/modules/$kernel/source"
        echo "install-deps: linked $flavour at /lib/modules/$kernel/build" >&2
    fi
fi
