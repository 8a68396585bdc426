#!/usr/bin/env bash
# Boot the GMEM guest under QEMU (TCG; KVM on these machines is broken) and tee the
# console to a log file. QEMU's exit status says nothing about the guest: judge the log.
#   usage: run-guest.sh <kernel-build-dir> <initramfs> <mode> <log> [timeout-seconds]
set -uo pipefail
KDIR=$1 INITRD=$2 MODE=$3 LOG=$4 TMO=${5:-600}
EXTRA=${GMEM_GUEST_APPEND:-}
mkdir -p "$(dirname "$LOG")"
# The kernel under TCG rarely trips over itself while booting, before any GMEM code runs
# (seen: a KASAN report in an interrupt during CPU identification; a hang before the
# clocksource switch). Such a boot is retried once, saying so: a splat or a hang before
# /init printed GMEM-INIT cannot come from gmem (no module is loaded yet). Anything after
# that line is judged as it is.
BOOT_TMO=${GMEM_BOOT_TIMEOUT:-300}
boot() {
    echo "[guest] booting ($MODE), console log: $LOG (timeout ${TMO}s)" >&2
    : > "$LOG"
    ( timeout --foreground -k 5 "$TMO" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 2G \
        -nographic -no-reboot -kernel "$KDIR/arch/x86/boot/bzImage" -initrd "$INITRD" \
        -append "console=ttyS0 panic=-1 oops=panic panic_on_warn=0 printk.devkmsg=on gmemmode=$MODE $EXTRA" \
        </dev/null 2>&1; echo "rc=$?" > "$LOG.rc" ) | tr -d '\r' | tee -a "$LOG" &
    local pipe=$! waited=0
    # Boot watchdog: no GMEM-INIT within BOOT_TMO seconds is a boot hang.
    while kill -0 "$pipe" 2>/dev/null; do
        if ! grep -q "^GMEM-INIT" "$LOG" && [ "$waited" -ge "$BOOT_TMO" ]; then
            pkill -f -- "-initrd $INITRD" 2>/dev/null
            printf "\n[guest] BOOT HANG: no GMEM-INIT after %ss\n" "$BOOT_TMO" | tee -a "$LOG" >&2
            break
        fi
        sleep 1
        waited=$((waited + 1))
    done
    wait "$pipe" 2>/dev/null
    [ "$(cat "$LOG.rc" 2>/dev/null)" = "rc=124" ] && echo "[guest] TIMEOUT after ${TMO}s" | tee -a "$LOG" >&2
    rm -f "$LOG.rc"
}
# What went wrong before GMEM-INIT, if anything (empty: the boot reached /init cleanly).
boot_trouble() {
    awk '/^GMEM-INIT/ { exit } /BUG:|WARNING:|Oops|Kernel panic|BOOT HANG/ { print; exit }' "$LOG"
}
boot
trouble=$(boot_trouble)
if [ -n "$trouble" ]; then
    mv "$LOG" "$LOG.boot-failure"
    echo "[guest] the kernel failed before any GMEM code ran ($trouble); log kept in $LOG.boot-failure; booting once more" >&2
    boot
fi
exit 0
