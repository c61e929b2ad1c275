#!/bin/sh
# Makes a Debian 12 base image without a container registry: a minbase root
# from debootstrap, trimmed the way docker.io/library/debian:12-slim is (no
# documentation, manual pages or translations installed; apt keeps no
# package files or language indexes), packed as a tarball for
# `podman import` / `docker import`. Then build with
#
#   podman import --change 'CMD ["bash"]' debian-12.tar localhost/debian:12-base
#   podman build --build-arg BASE_IMAGE=localhost/debian:12-base \
#       -f deploy/container/Containerfile -t tramprof:0.1.0 .
#
# Usage (root, debootstrap installed):
#   debian-base.sh OUTPUT.tar [MIRROR [SECURITY_MIRROR]]
# MIRROR defaults to http://deb.debian.org/debian, SECURITY_MIRROR to
# http://deb.debian.org/debian-security. The image's apt uses the same ones.
set -eu

if [ $# -lt 1 ] || [ $# -gt 3 ]; then
    echo "usage: $0 OUTPUT.tar [MIRROR [SECURITY_MIRROR]]" >&2
    exit 2
fi
output=$1
mirror=${2:-http://deb.debian.org/debian}
security=${3:-http://deb.debian.org/debian-security}
suite=bookworm

if [ "$(id -u)" != 0 ]; then
    echo "$0: must run as root (debootstrap)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "$0: apt-get install debootstrap" >&2; exit 1; }

root=$(mktemp -d "${TMPDIR:-/tmp}/tramprof-base.XXXXXX")
# Whatever debootstrap left mounted in the root (it bind-mounts /dev, /proc
# and /sys while it works) is unmounted before anything there is removed.
unmount_all() {
    awk -v r="$root" 'index($2, r "/") == 1 { print $2 }' /proc/mounts | sort -r |
        while read -r m; do umount -l "$m"; done
}
cleanup() {
    unmount_all
    rm -rf --one-file-system "$root"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# The same dpkg filter as the slim images, in place before any package
# besides the essential ones is unpacked; what debootstrap unpacked before
# it is removed below.
mkdir -p "$root/etc/dpkg/dpkg.cfg.d"
cat >"$root/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
EOF

debootstrap --variant=minbase "$suite" "$root" "$mirror" >&2
unmount_all

cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
EOF
cat >"$root/etc/apt/apt.conf.d/slim" <<'EOF'
Acquire::Languages "none";
APT::Install-Recommends "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$root/usr/share/groff/"* "$root/usr/share/info/"* "$root/usr/share/linda/"* \
    "$root/usr/share/lintian/overrides/"* "$root/usr/share/man/"*
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
rm -rf "$root/var/cache/apt/"*.bin "$root/var/cache/apt/archives/"*.deb \
    "$root/var/lib/apt/lists/"* "$root/var/log/"*.log "$root/var/log/apt/"* \
    "$root/dev/"* "$root/run/"* "$root/tmp/"*
# The runtime provides these at run time.
: >"$root/etc/resolv.conf"
: >"$root/etc/hostname"
printf '' >"$root/etc/machine-id"

mkdir -p "$(dirname "$output")"
tar --numeric-owner --xattrs --sort=name -C "$root" -cf "$output.part" .
mv "$output.part" "$output"
echo "$output: $(du -h "$output" | cut -f1)" >&2
