#!/usr/bin/env bash
# Build the guest initramfs with the kernel's own gen_init_cpio (no root, no mknod needed).
#   usage: mkinitramfs.sh <kernel-build-dir> <out.cpio.gz> <modules-dir> <bin-dir>
set -euo pipefail
KDIR=$1 OUT=$2 MODDIR=$3 BINDIR=$4
HERE=$(cd "$(dirname "$0")" && pwd)
BUSYBOX=$(command -v busybox || echo /bin/busybox)
[ -x "$BUSYBOX" ] || { echo "busybox-static missing (scripts/deps.sh installs it)" >&2; exit 1; }
GEN="$KDIR/usr/gen_init_cpio"
[ -x "$GEN" ] || make -s -C "$KDIR" usr/gen_init_cpio >&2 2>/dev/null || true
[ -x "$GEN" ] || { cc -O2 -o "$OUT.gen_init_cpio" "$(readlink -f "$KDIR/source")/usr/gen_init_cpio.c"; GEN="$OUT.gen_init_cpio"; }
LIST=$(mktemp)
trap 'rm -f "$LIST"' EXIT
{
    for d in /bin /sbin /dev /proc /sys /tmp /lib /lib/gmem /etc; do echo "dir $d 755 0 0"; done
    echo "nod /dev/console 600 0 0 c 5 1"
    echo "nod /dev/null 666 0 0 c 1 3"
    echo "file /bin/busybox $BUSYBOX 755 0 0"
    for a in $("$BUSYBOX" --list); do
        [ "$a" = busybox ] || echo "slink /bin/$a busybox 777 0 0"
    done
    echo "file /init $HERE/../tests/guest/init 755 0 0"
    for m in "$MODDIR"/*.ko; do [ -f "$m" ] && echo "file /lib/gmem/$(basename "$m") $m 644 0 0"; done
    for b in "$BINDIR"/*; do [ -f "$b" ] && [ -x "$b" ] && echo "file /bin/$(basename "$b") $b 755 0 0"; done
} > "$LIST"
"$GEN" "$LIST" | gzip -1 > "$OUT"
