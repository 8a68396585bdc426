#!/usr/bin/env bash
# Install what building GMEM needs on a Debian/Ubuntu x86_64 host. Idempotent:
# every step checks first and only installs what is missing.
set -euo pipefail
say() { printf '[deps] %s\n' "$*"; }

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

PKGS=(clang-19 lld-19 llvm-19 libclang-19-dev flex bison bc libelf-dev libssl-dev
      cpio qemu-system-x86 busybox-static kmod xz-utils binutils make python3 gcc
      libc6-dev curl ca-certificates)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    say "Debian packages: all present"
fi

if ! command -v rustup >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/rustup" ] && export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v rustup >/dev/null 2>&1; then
    say "installing rustup (stable toolchain)"
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    export PATH="$HOME/.cargo/bin:$PATH"
fi
rustup component list --installed | grep -q '^rust-src' || { say "rustup component add rust-src"; rustup component add rust-src; }
for c in clippy rustfmt; do
    rustup component list --installed | grep -q "^$c" || { say "rustup component add $c"; rustup component add "$c"; }
done
rustup target list --installed | grep -q x86_64-unknown-linux-musl || { say "rustup target add x86_64-unknown-linux-musl"; rustup target add x86_64-unknown-linux-musl; }

if ! command -v bindgen >/dev/null 2>&1 || ! bindgen --version | grep -Eq 'bindgen 0\.(7[1-9]|[89][0-9])'; then
    say "cargo install bindgen-cli (a few minutes)"
    LIBCLANG_PATH=/usr/lib/llvm-19/lib cargo install bindgen-cli --locked --version 0.73.2 || \
        LIBCLANG_PATH=/usr/lib/llvm-19/lib cargo install bindgen-cli --locked
else
    say "bindgen: $(bindgen --version)"
fi
# The benchmark report draws its plots with matplotlib (scripts/bench.py), for the same
# python3 that make runs (a pyenv or venv python does not see Debian's python3-matplotlib).
if ! python3 -c 'import matplotlib' >/dev/null 2>&1; then
    say "pip install matplotlib (for python3 = $(command -v python3))"
    python3 -m pip install --quiet matplotlib 2>/dev/null || python3 -m pip install --quiet --break-system-packages matplotlib
else
    say "matplotlib: $(python3 -c 'import matplotlib; print(matplotlib.__version__)')"
fi
say "done"
