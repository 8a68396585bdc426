#!/usr/bin/env bash
# Build (or reuse) the GMEM guest kernel for one flavour.
#   usage: build-kernel.sh <std|debug> [--print-dir]
# The build tree lives in $GMEM_CACHE/build/<flavour>-<key>, where key hashes the kernel
# source version, the config fragments, the kernel patches and this script. A second run with
# the same key does nothing; a changed fragment or patch builds a new tree.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
FLAVOUR=${1:?flavour (std|debug)}
MODE=${2:-build}
CACHE=${GMEM_CACHE:-$HOME/.cache/gmem}
say() { printf '[kernel:%s] %s\n' "$FLAVOUR" "$*" >&2; }
export PATH="$HOME/.cargo/bin:$PATH"
export LIBCLANG_PATH=${LIBCLANG_PATH:-/usr/lib/llvm-19/lib}

case "$FLAVOUR" in
    std) FRAGS=("$HERE/kconfig/std.config") ;;
    debug) FRAGS=("$HERE/kconfig/std.config" "$HERE/kconfig/debug.config") ;;
    *) say "unknown flavour"; exit 2 ;;
esac

SRC=$("$HERE/fetch-kernel.sh" "$CACHE")
PATCHES=()
for p in "$HERE"/kernel-patches/*.patch; do
    if [ -f "$p" ]; then PATCHES+=("$p"); fi
done

KEY=$( { basename "$SRC"; cat "${FRAGS[@]}"; if [ ${#PATCHES[@]} -gt 0 ]; then cat "${PATCHES[@]}"; fi; } \
       | sha256sum | cut -c1-12)
OUT="$CACHE/build/$FLAVOUR-$KEY"
if [ "$MODE" = "--print-dir" ]; then echo "$OUT"; exit 0; fi
if [ -f "$OUT/.gmem-built" ]; then
    say "cached kernel $(basename "$SRC") at $OUT"
    echo "$OUT"; exit 0
fi

# Patched source: a hard-linked copy of the pristine tree (patch(1) replaces files rather
# than writing through links, so the pristine tree stays intact).
if [ ${#PATCHES[@]} -gt 0 ]; then
    PKEY=$(cat "${PATCHES[@]}" | sha256sum | cut -c1-12)
    PSRC="$SRC-gmem-$PKEY"
    if [ ! -f "$PSRC/.patched" ]; then
        say "applying ${#PATCHES[@]} kernel patch(es) -> $PSRC"
        rm -rf "$PSRC"; cp -al "$SRC" "$PSRC"
        for p in "${PATCHES[@]}"; do patch -d "$PSRC" -p1 --no-backup-if-mismatch < "$p" >&2; done
        touch "$PSRC/.patched"
    fi
    SRC=$PSRC
fi

mkdir -p "$OUT"
MK=(make -C "$SRC" O="$OUT" LLVM=-19 -j"$(nproc)")
say "configuring (tinyconfig + ${FRAGS[*]##*/})"
"${MK[@]}" -s tinyconfig >&2
"$SRC/scripts/kconfig/merge_config.sh" -m -O "$OUT" "$OUT/.config" "${FRAGS[@]}" >/dev/null
"${MK[@]}" -s olddefconfig >&2
"${MK[@]}" -s rustavailable >&2 || { say "Rust toolchain not usable for this kernel"; exit 1; }

# Every option a fragment asks for must have survived olddefconfig.
bad=0
for f in "${FRAGS[@]}"; do
    while IFS= read -r line; do
        case "$line" in
            CONFIG_*=n) opt=${line%%=*}; grep -q "^$opt=" "$OUT/.config" && { say "config: $opt should be off"; bad=1; } ;;
            CONFIG_*=*) grep -qx "$line" "$OUT/.config" || { say "config: wanted $line, got: $(grep "^${line%%=*}=" "$OUT/.config" || echo unset)"; bad=1; } ;;
            "# CONFIG_"*" is not set") opt=${line#\# }; opt=${opt%% *}; grep -q "^$opt=y" "$OUT/.config" && { say "config: $opt should be off"; bad=1; } ;;
        esac
    done < "$f"
done
[ $bad = 0 ] || { say "kernel config does not match the fragments"; exit 1; }

say "building bzImage + modules with LLVM=-19, -j$(nproc) (std ~5 min, debug ~10 min)"
start=$(date +%s)
set +e
"${MK[@]}" bzImage modules 2>&1 | {
    n=0
    while IFS= read -r l; do
        case "$l" in
            "  CC"*|"  RUSTC"*|"  LD"*|"  AR"*|"  BINDGEN"*|"  AS"*|"  HOSTCC"*)
                n=$((n+1)); [ $((n % 500)) = 0 ] && say "$n objects, $(( $(date +%s) - start ))s" ;;
            *) printf '%s\n' "$l" >&2 ;;
        esac
    done
}
rc=${PIPESTATUS[0]}
set -e
[ "$rc" = 0 ] || { say "kernel build failed"; exit 1; }
touch "$OUT/.gmem-built"
say "built in $(( $(date +%s) - start ))s: $OUT"
echo "$OUT"
