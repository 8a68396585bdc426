# GMEM top-level Makefile. See README.md.
#   make              kernel (cached) + modules + userspace + initramfs, std flavour
#   make run          boot the guest, load gmem + gmem_sim, run the demo
#   make check        host cargo tests + guest KUnit + guest integration tests (std flavour)
#   make check-debug  the same on the debug flavour (KASAN, lockdep, kmemleak, DEBUG_VM)
#   make bench        benchmarks (std flavour), results under bench/results/
#   make kernel       only the kernel (FLAVOUR=std|debug)
#   make clean        remove build/ and target/ (the kernel cache in ~/.cache/gmem stays)
SHELL := /bin/bash
FLAVOUR ?= std
B ?= build/$(FLAVOUR)
MUSL := x86_64-unknown-linux-musl
CARGO_HOME ?= $(HOME)/.cargo
export PATH := $(CARGO_HOME)/bin:$(PATH)
export LIBCLANG_PATH ?= /usr/lib/llvm-19/lib
GUEST_TIMEOUT_std := 600
GUEST_TIMEOUT_debug := 1800
# make bench: the suite takes 2-3 min of guest time (2-core TCG); BENCH_ARGS is handed to
# gmem-bench through the kernel command line (gmembench=, comma-separated: quick, reps=N,
# only=P1+P4, smoke).
GUEST_TIMEOUT_bench := 1200
BENCH_ARGS ?=
SUITES := gmem_layout gmem_devices gmem_driver_abi gmem_fault gmem_mirror gmem_region gmem_page_state gmem_sim_pt
USER_BINS := gmem-tests gmem-demo gmem-bench gmemctl
# Static glibc links of libgmem.a warn that Rust std's getaddrinfo/getpwuid_r would need
# glibc's shared libraries at run time; libgmem never calls them. Only those lines are hidden.
GLIBC_STATIC_NOISE := in statically linked applications requires at runtime|: in function .std::sys::
# The C example is built with gcc unless CC is given (make's built-in default "cc" is not).
ifeq ($(origin CC),default)
CC := gcc
endif

.PHONY: all deps kernel modules user initramfs run check check-debug host-test bench clean FORCE

all: initramfs

deps:
	@bash scripts/deps.sh

kernel: deps
	@mkdir -p $(B)
	@bash scripts/build-kernel.sh $(FLAVOUR) > $(B)/kdir.tmp && mv $(B)/kdir.tmp $(B)/kdir

modules: kernel
	@echo "[modules] gmem.ko + gmem_sim.ko + gmem_csample.ko ($(FLAVOUR)) against $$(cat $(B)/kdir)"
	@mkdir -p $(B)/modules $(B)/ko
	@set -o pipefail; $(MAKE) -s -C "$$(cat $(B)/kdir)" M=$(CURDIR) MO=$(CURDIR)/$(B)/modules LLVM=-19 CLIPPY=1 modules 2>&1 \
		| tee $(B)/modules.log
	@# Rust compiler, clippy (CLIPPY=1) and C compiler warnings all fail the build.
	@if grep -qE '^warning|: warning:' $(B)/modules.log; then \
		echo "[modules] warnings above (see $(B)/modules.log): fix them"; exit 1; fi
	@cp $(B)/modules/gmem/gmem.ko $(B)/modules/drivers/gmem_sim.ko $(B)/modules/drivers/gmem_csample.ko $(B)/ko/
	@if [ -f "$$(cat $(B)/kdir)/lib/test_hmm.ko" ]; then cp "$$(cat $(B)/kdir)/lib/test_hmm.ko" $(B)/ko/; fi

user: deps
	@echo "[user] static musl test programs"
	@cargo build -q --release --target $(MUSL) $(addprefix -p ,$(USER_BINS))
	@mkdir -p $(B)/bin && cp $(addprefix target/$(MUSL)/release/,$(USER_BINS)) $(B)/bin/
	@echo "[user] libgmem for C: libgmem.so, libgmem.a, gmem.h, libgmem.pc (in $(B)/lib, $(B)/include)"
	@cargo build -q --release -p libgmem-c
	@mkdir -p $(B)/lib/pkgconfig $(B)/include/linux
	@cp target/release/libgmem.so target/release/libgmem.a $(B)/lib/
	@cp tools/libgmem-c/include/gmem.h $(B)/include/ && cp include/uapi/linux/gmem.h $(B)/include/linux/
	@sed 's|@PREFIX@|$(CURDIR)/$(B)|' tools/libgmem-c/libgmem.pc.in > $(B)/lib/pkgconfig/libgmem.pc
	@echo "[user] C example and C library test (static, through pkg-config libgmem)"
	@set -o pipefail; for p in example:gmem_example lib-test:gmem_lib_test; do \
		$(CC) -static -O2 -s -Wl,--gc-sections -Wall -Wextra -Werror -I include/uapi $$(PKG_CONFIG_PATH=$(B)/lib/pkgconfig pkg-config --cflags libgmem) \
			-o $(B)/bin/gmem-$${p%%:*} tools/examples/$${p#*:}.c $$(PKG_CONFIG_PATH=$(B)/lib/pkgconfig pkg-config --static --libs libgmem) \
			2>&1 | { grep -vE "$(GLIBC_STATIC_NOISE)" || true; }; done

initramfs: modules user
	@bash scripts/mkinitramfs.sh "$$(cat $(B)/kdir)" $(B)/initramfs.cpio.gz $(B)/ko $(B)/bin
	@echo "[initramfs] $(B)/initramfs.cpio.gz"

host-test: deps
	@mkdir -p $(B)
	@echo "[host] judge self-test (scripts/test_judge.py)"
	@python3 scripts/test_judge.py 2> $(B)/test-judge.log || { cat $(B)/test-judge.log; exit 1; }
	@echo "[host] module layering (scripts/check-layers.py)"
	@python3 scripts/check-layers.py
	@echo "[host] rustfmt --check (rustfmt.toml): workspace, gmem.ko, gmem_sim.ko"
	@cargo fmt --all -- --check > $(B)/rustfmt.log 2>&1 && \
		rustfmt --check --config-path rustfmt.toml gmem/gmem_main.rs drivers/gmem_sim.rs >> $(B)/rustfmt.log 2>&1 || \
		{ head -60 $(B)/rustfmt.log; echo "rustfmt: not formatted (run: cargo fmt --all; rustfmt --config-path rustfmt.toml gmem/gmem_main.rs drivers/gmem_sim.rs)"; exit 1; }
	@echo "[host] cargo clippy -D warnings: workspace"
	@cargo clippy -q --workspace --all-targets -- -D warnings
	@echo "[host] cargo test (pure policy code, libgmem)"
	@set -o pipefail; cargo test --workspace 2>&1 | tee $(B)/cargo-test.log | grep -E '^test result|FAILED|panicked|error' || true

run: initramfs
	@bash scripts/run-guest.sh "$$(cat $(B)/kdir)" $(B)/initramfs.cpio.gz run $(B)/console-run.log $(GUEST_TIMEOUT_$(FLAVOUR))
	@python3 scripts/judge.py --console $(B)/console-run.log > $(B)/judge-run.txt || { cat $(B)/judge-run.txt; exit 1; }

check: host-test initramfs
	@echo "[check] kernel-doc of include/linux/gmem.h (scripts/check-kdoc.py)"
	@python3 scripts/check-kdoc.py "$$(cat $(B)/kdir)"
	@bash scripts/run-guest.sh "$$(cat $(B)/kdir)" $(B)/initramfs.cpio.gz check $(B)/console-check.log $(GUEST_TIMEOUT_$(FLAVOUR)) > /dev/null
	@echo "[check] $(FLAVOUR) results (console log: $(B)/console-check.log)"
	@python3 scripts/judge.py --console $(B)/console-check.log --cargo $(B)/cargo-test.log \
		$(addprefix --expect-suite ,$(SUITES)) --summary-out $(B)/summary

bench: initramfs
	@python3 scripts/bench.py --fingerprint > $(B)/bench-source.json
	@echo "[bench] $(FLAVOUR) guest, progress below; full console log: $(B)/console-bench.log"
	@set -o pipefail; GMEM_GUEST_APPEND="$(if $(BENCH_ARGS),gmembench=$(BENCH_ARGS)) $(if $(BENCH_TRACE),gmemtrace=1) $(if $(BENCH_CONTROL),gmemcontrol=$(BENCH_CONTROL))" \
		bash scripts/run-guest.sh "$$(cat $(B)/kdir)" $(B)/initramfs.cpio.gz bench $(B)/console-bench.log $(GUEST_TIMEOUT_bench) \
		| grep --line-buffered -E '^GMEM-BENCH (progress|error)|^GMEM-UTEST|^GMEM-INIT|^\[guest\]' || true
	@python3 scripts/judge.py --console $(B)/console-bench.log > $(B)/judge-bench.txt; j=$$?; \
		python3 scripts/bench.py --console $(B)/console-bench.log --source $(B)/bench-source.json --out bench/results; b=$$?; \
		if [ $$j != 0 ]; then cat $(B)/judge-bench.txt; echo "[bench] FAILED: the guest console has failures (above)"; exit 1; fi; \
		if [ $$b != 0 ]; then echo "[bench] FAILED: no valid results (console log: $(B)/console-bench.log)"; exit 1; fi; \
		echo "[bench] guest clean ($$(tail -1 $(B)/judge-bench.txt)); results in bench/results/"

check-debug:
	@$(MAKE) --no-print-directory FLAVOUR=debug check

clean:
	rm -rf build target
