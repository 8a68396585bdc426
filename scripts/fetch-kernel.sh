#!/usr/bin/env bash
# Fetch Debian's linux-source-<major> package without touching the system's apt
# configuration: a temporary sources list + state dir, `apt-get download`, `dpkg -x`.
# The archive URI is read from the system's own apt sources; only the suite changes.
# Prints the path of the unpacked source tree on stdout (progress goes to stderr).
#   usage: fetch-kernel.sh <cache-dir>
set -euo pipefail
say() { printf '[fetch] %s\n' "$*" >&2; }
CACHE=${1:?cache dir}
mkdir -p "$CACHE/debs" "$CACHE/src"

# Preferred major first, then the documented fallbacks.
MAJORS=(${GMEM_KERNEL_MAJORS:-7.3 7.2})
SUITES=(trixie-backports sid)

archive_uri() {
    local f u
    # deb822 sources: first URIs line of a stanza whose Suites has no "-security".
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        u=$(awk 'BEGIN{RS=""} /Suites:/ && !/-security/ && /debian-archive-keyring|URIs: *[^ ]*debian/ {
                 for (i=1;i<=NF;i++) if ($i=="URIs:") { print $(i+1); exit } }' "$f")
        [ -n "$u" ] && { echo "$u"; return; }
    done
    # one-line format
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        u=$(awk '$1=="deb" && $0 !~ /security/ && $0 ~ /debian/ {for(i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' "$f")
        [ -n "$u" ] && { echo "$u"; return; }
    done
    return 1
}

keyring() {
    for k in /usr/share/keyrings/debian-archive-keyring.gpg /etc/apt/trusted.gpg.d/debian-archive-keyring.gpg; do
        [ -f "$k" ] && { echo "$k"; return; }
    done
    echo ""
}

find_cached() {
    local m=$1
    ls -1 "$CACHE"/debs/linux-source-"$m"_*.deb 2>/dev/null | sort -V | tail -n 1
}

unpack() {
    local deb=$1 ver dir
    ver=$(basename "$deb" | sed -E 's/^linux-source-[0-9.]+_([^_]+)_.*/\1/')
    dir="$CACHE/src/linux-${ver//[~:+]/_}"
    echo "$dir" > "$CACHE/src/.resolved.tmp"
    if [ ! -f "$dir/.unpacked" ]; then
        say "unpacking $(basename "$deb") -> $dir"
        rm -rf "$dir" "$dir.tmp"; mkdir -p "$dir.tmp"
        dpkg-deb -x "$deb" "$dir.tmp/deb"
        local tarball
        tarball=$(ls "$dir.tmp"/deb/usr/src/linux-source-*.tar.xz | head -n 1)
        mkdir -p "$dir"
        tar -xf "$tarball" -C "$dir" --strip-components=1
        rm -rf "$dir.tmp"
        touch "$dir/.unpacked"
    fi
    mv "$CACHE/src/.resolved.tmp" "$CACHE/src/.resolved"
    echo "$dir"
}

# The archive is asked at most once a day (GMEM_REFRESH=1 forces it); in between, the
# tree resolved last time is reused.
STAMP="$CACHE/src/.resolved"
if [ -z "${GMEM_REFRESH:-}" ] && [ -f "$STAMP" ] && [ -n "$(find "$STAMP" -mmin -1440)" ]; then
    dir=$(cat "$STAMP")
    if [ -f "$dir/.unpacked" ]; then echo "$dir"; exit 0; fi
fi

URI=$(archive_uri) || { say "no Debian archive URI in /etc/apt"; exit 1; }
KEY=$(keyring)
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/lists/partial" "$TMP/archives/partial"
: > "$TMP/sources.list"
for s in "${SUITES[@]}"; do
    if [ -n "$KEY" ]; then
        echo "deb [signed-by=$KEY] $URI $s main" >> "$TMP/sources.list"
    else
        echo "deb $URI $s main" >> "$TMP/sources.list"
    fi
done
APT=(apt-get -q -o Dir::Etc::sourcelist="$TMP/sources.list" -o Dir::Etc::sourceparts=/nonexistent
     -o Dir::State::Lists="$TMP/lists" -o Dir::Cache::archives="$TMP/archives"
     -o Dir::State::status=/var/lib/dpkg/status -o APT::Get::List-Cleanup=0)

online=0
if [ -z "${GMEM_OFFLINE:-}" ]; then
    say "apt index of ${SUITES[*]} from $URI (temporary list, system untouched)"
    if "${APT[@]}" update >"$TMP/update.log" 2>&1; then online=1; else
        say "apt update failed (using cache if any):"; tail -n 3 "$TMP/update.log" >&2; fi
fi

for m in "${MAJORS[@]}"; do
    if [ "$online" = 1 ]; then
        ver=$(apt-cache -o Dir::Etc::sourcelist="$TMP/sources.list" -o Dir::Etc::sourceparts=/nonexistent \
              -o Dir::State::Lists="$TMP/lists" -o Dir::Cache="$TMP" madison "linux-source-$m" 2>/dev/null \
              | awk -F'|' '{gsub(/ /,"",$2); print $2}' | sort -V | tail -n 1)
        if [ -n "$ver" ]; then
            deb=$(ls "$CACHE"/debs/linux-source-"$m"_"${ver//:/%3a}"_*.deb 2>/dev/null | head -n 1 || true)
            if [ -z "$deb" ]; then
                say "downloading linux-source-$m=$ver (~170 MB)"
                (cd "$CACHE/debs" && "${APT[@]}" download "linux-source-$m=$ver" >&2)
                deb=$(find_cached "$m")
            else
                say "linux-source-$m $ver already cached"
            fi
            [ -n "$deb" ] && { unpack "$deb"; exit 0; }
        fi
    fi
    deb=$(find_cached "$m")
    if [ -n "$deb" ]; then say "using cached $(basename "$deb")"; unpack "$deb"; exit 0; fi
    say "linux-source-$m not available, trying next"
done
say "no kernel source package found"; exit 1
