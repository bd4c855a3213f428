#!/usr/bin/env bash
# Installs QEMU and builds the guest kit of the `microvm` backend, as root, idempotently:
#   Debian packages qemu-system-x86 (the VMM), qemu-utils, erofs-utils (mkfs.erofs: the
#   read-only image disks), e2fsprogs (mkfs.ext4: the per-sandbox scratch disks), kmod
#   (modinfo), lz4/xz-utils/zstd (to unpack the kernel image), binutils (objcopy), and the kit (shared by `microvm` and `vm`) in $SANDLOT_GUEST_KIT_DIR (default: guest-kit/ beside the images
#   directory, /var/lib/sandlot/guest-kit):
#     vmlinuz            the Debian cloud kernel (linux-image-*-cloud-amd64), direct-booted
#                        by the `vm` backend (and by `microvm` when there is no vmlinux)
#     vmlinux            the same kernel uncompressed (an ELF with a PVH entry note), cut out
#                        of vmlinuz once here; `microvm` boots it directly, which skips the
#                        bzImage's self-decompression (~0.2 s of CPU under TCG). Absent when the
#                        kernel lacks CONFIG_PVH or its payload cannot be unpacked.
#     modules/*.ko       the modules the guest needs (virtio-mmio, virtio-pci, virtio-blk, virtio-net,
#                        virtio-console, virtio-rng, erofs, overlay) with their dependencies,
#                        without their `.BTF` section (type information for BPF; the guest
#                        kernel parses all of vmlinux's BTF, ~50-65 ms under TCG, the first
#                        time a module carrying BTF loads) and so without their signatures
#                        (objcopy drops the appended signature; the kernel does not enforce
#                        module signatures and the node strips them anyway)
#     modules/order      their file names in load order (dependencies first)
#     kernel-version     the kernel's release string (the kit is rebuilt when it changes)
#     modules/wanted     the module list asked for (the kit is rebuilt when it changes)
#     kit-format         the layout version of this script (the kit is rebuilt when it changes)
# The kernel package is only unpacked (dpkg -x), never installed as a host kernel; its .deb
# is cached in $SANDLOT_CACHE_DIR. The node builds the initramfs itself from this kit and
# its static sandlot-guest (so a rebuilt agent is picked up without re-running this).
set -euo pipefail

: "${SANDLOT_IMAGES_DIR:=/var/lib/sandlot/images}"
: "${SANDLOT_CACHE_DIR:=/var/cache/sandlot}"
: "${SANDLOT_GUEST_KIT_DIR:=$(dirname "$SANDLOT_IMAGES_DIR")/guest-kit}"

pkgs=(qemu-system-x86 qemu-utils erofs-utils e2fsprogs kmod lz4 xz-utils zstd binutils)
missing_pkgs() {
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
}
# Two passes: an install may remove a listed package it conflicts with (seen on a machine
# image with qemu-utils 10.0 from bookworm-backports: installing Debian 12's
# qemu-system-x86 7.2 removed it, and the vm backend then lacked qemu-img); the second pass
# installs it again at the version that matches.
for pass in 1 2; do
  missing_pkgs
  [ ${#missing[@]} -eq 0 ] && break
  [ "$pass" = 1 ] && apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
done
missing_pkgs
if [ ${#missing[@]} -gt 0 ]; then
  echo "guest-kit.sh: still not installed after apt-get install: ${missing[*]}" >&2
  exit 1
fi

# The concrete kernel package behind the cloud meta-package (e.g. linux-image-6.1.0-57-cloud-amd64).
pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$pkg" ]; then
  echo "guest-kit.sh: cannot resolve linux-image-cloud-amd64 (apt-get update?)" >&2
  exit 1
fi
release=${pkg#linux-image-}
kit=$SANDLOT_GUEST_KIT_DIR
# virtio_mmio: microvm's bus; virtio_pci: q35's (the vm backend); virtio_rng: the vm's entropy.
# virtio_net: the network of sandboxes with an allow policy (the guest loads it only then).
wanted="virtio_mmio virtio_pci virtio_blk virtio_console virtio_rng virtio_net erofs overlay"
# 2: vmlinux added. 3: modules without .BTF.
format=3
if [ -f "$kit/kernel-version" ] && [ "$(cat "$kit/kernel-version")" = "$release" ] \
   && [ -f "$kit/vmlinuz" ] && [ -f "$kit/modules/order" ] \
   && [ "$(cat "$kit/modules/wanted" 2>/dev/null)" = "$wanted" ] \
   && [ "$(cat "$kit/kit-format" 2>/dev/null)" = "$format" ]; then
  echo "guest kit up to date in $kit ($release)"
  exit 0
fi

mkdir -p "$SANDLOT_CACHE_DIR/debs"
deb=$(ls "$SANDLOT_CACHE_DIR/debs/${pkg}_"*.deb 2>/dev/null | head -1 || true)
if [ -z "$deb" ]; then
  (cd "$SANDLOT_CACHE_DIR/debs" && apt-get download "$pkg" 2>&1 | grep -v "unsandboxed" || true)
  deb=$(ls "$SANDLOT_CACHE_DIR/debs/${pkg}_"*.deb | head -1)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dpkg -x "$deb" "$tmp/x"
moddir="$tmp/x/lib/modules/$release"

declare -A seen=()
order=()
# Depth-first: a module's `depends=` (from modinfo) first, then the module itself.
add() {
  local name=$1 file dep
  [ -n "${seen[$name]:-}" ] && return 0
  seen[$name]=1
  file=$(find "$moddir" -name "$name.ko" -o -name "${name//_/-}.ko" | head -1)
  if [ -z "$file" ]; then
    # Built in (=y): nothing to load.
    grep -q "/$name.ko$" "$moddir/modules.builtin" 2>/dev/null && return 0
    echo "guest-kit.sh: module $name not found in $pkg" >&2
    exit 1
  fi
  for dep in $(modinfo -F depends "$file" | tr ',' ' '); do add "$dep"; done
  order+=("$file")
}
for m in $wanted; do add "$m"; done

# Writes the ELF kernel inside bzImage $1 to $2 (what the kernel tree's
# scripts/extract-vmlinux does): the payload starts at a compressor's magic number; try
# each occurrence with each compressor until one unpacks to an ELF file. Fails (status 1,
# no $2) when none does.
extract_vmlinux() {
  local img=$1 out=$2 spec magic tool pos
  for spec in 'lz4:\x02\x21\x4c\x18' 'xz:\xfd\x37\x7a\x58\x5a' 'zstd:\x28\xb5\x2f\xfd' 'gzip:\x1f\x8b\x08'; do
    tool=${spec%%:*} magic=${spec#*:}
    command -v "$tool" >/dev/null || continue
    for pos in $(LC_ALL=C grep -obUaP "$magic" "$img" | cut -d: -f1); do
      # The payload is followed by other data, so the tools exit non-zero: judge by output.
      tail -c +$((pos + 1)) "$img" | "$tool" -dc > "$out" 2>/dev/null || true
      if [ "$(head -c 4 "$out" | od -An -tx1 | tr -d ' ')" = "7f454c46" ]; then
        return 0
      fi
    done
  done
  rm -f "$out"
  return 1
}

new="$kit.new"
rm -rf "$new"
mkdir -p "$new/modules"
cp "$tmp/x/boot/vmlinuz-$release" "$new/vmlinuz"
if grep -q '^CONFIG_PVH=y' "$tmp/x/boot/config-$release" 2>/dev/null; then
  extract_vmlinux "$new/vmlinuz" "$new/vmlinux" \
    || echo "guest-kit.sh: could not unpack vmlinux from $pkg; microvm boots vmlinuz (slower)" >&2
fi
: > "$new/modules/order"
for f in "${order[@]}"; do
  objcopy --remove-section=.BTF "$f" "$new/modules/$(basename "$f")"
  basename "$f" >> "$new/modules/order"
done
echo "$release" > "$new/kernel-version"
echo "$wanted" > "$new/modules/wanted"
echo "$format" > "$new/kit-format"
# QEMU runs as an unprivileged uid per sandbox (docs/backends.md, "Limits and jailing"): it
# must read the kernel and the modules whatever umask this script ran under.
chmod -R u=rwX,go=rX "$new"
rm -rf "$kit"
mv "$new" "$kit"
echo "guest kit built in $kit ($release): $(tr '\n' ' ' < "$kit/modules/order")"
