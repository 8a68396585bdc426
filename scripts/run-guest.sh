#!/usr/bin/env bash
# Boot the GMEM guest under QEMU (TCG; KVM on these machines is broken) and tee the
# console to a log file. QEMU's exit status says nothing about the guest: judge the log.
#   usage: run-guest.sh <kernel-build-dir> <initramfs> <mode> <log> [timeout-seconds]
set -uo pipefail
KDIR=$1 INITRD=$2 MODE=$3 LOG=$4 TMO=${5:-600}
EXTRA=${GMEM_GUEST_APPEND:-}
mkdir -p "$(dirname "$LOG")"
echo "[guest] booting ($MODE), console log: $LOG (timeout ${TMO}s)" >&2
timeout --foreground -k 5 "$TMO" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 2G \
    -nographic -no-reboot -kernel "$KDIR/arch/x86/boot/bzImage" -initrd "$INITRD" \
    -append "console=ttyS0 panic=-1 oops=panic panic_on_warn=0 gmemmode=$MODE $EXTRA" \
    </dev/null 2>&1 | tr -d '\r' | tee "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "[guest] TIMEOUT after ${TMO}s" | tee -a "$LOG" >&2
exit 0
