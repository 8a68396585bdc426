#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0
"""Checks the documentation of the driver API:

- include/linux/gmem.h: the kernel's scripts/kernel-doc -Wall prints nothing about it,
  and every #define GMEM_*, every struct with a body and every function it declares has
  a kernel-doc comment (appears in kernel-doc's reST output);
- include/rust/gmem.rs (the Rust binding): every `pub` item has a `///` doc comment.

Usage: check-kdoc.py KERNEL_BUILD_DIR  (its `source` link leads to scripts/kernel-doc)
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "include/linux/gmem.h"
BINDING = ROOT / "include/rust/gmem.rs"
PUB_ITEM = re.compile(r"^\s*pub (?:unsafe )?(?:const fn|fn|struct|enum|trait|const|mod|type|static)\b")


def binding_undocumented() -> list:
    """`pub` items of the binding whose preceding lines (attributes skipped) are no `///`."""
    lines = BINDING.read_text().splitlines()
    bad = []
    for n, line in enumerate(lines):
        if not PUB_ITEM.match(line):
            continue
        k = n - 1
        while k >= 0 and lines[k].strip().startswith("#["):
            k -= 1
        if k < 0 or not lines[k].strip().startswith("///"):
            bad.append(f"{BINDING.name}:{n + 1}: {line.strip()}")
    return bad


def main() -> int:
    kdoc = pathlib.Path(sys.argv[1]) / "source/scripts/kernel-doc"
    warn = subprocess.run([sys.executable, kdoc, "-Wall", "-none", HEADER], capture_output=True, text=True)
    if warn.returncode != 0 or warn.stdout.strip() or warn.stderr.strip():
        print(f"kernel-doc -Wall on {HEADER.name}:\n{warn.stdout}{warn.stderr}")
        return 1
    rst = subprocess.run([sys.executable, kdoc, "-rst", HEADER], capture_output=True, text=True, check=True).stdout
    documented = set(re.findall(r"^\.\. c:(?:macro|struct)::\s+(\w+)", rst, re.M))
    documented |= set(re.findall(r"^\.\. c:function::.*?(\w+)\s*\(", rst, re.M))
    text = HEADER.read_text()
    declared = set(re.findall(r"^#define\s+(GMEM_\w+)", text, re.M))
    declared |= set(re.findall(r"^struct\s+(\w+)\s*\{", text, re.M))
    declared |= set(re.findall(r"^[a-z][\w ]*?\**\s*\b(gmem_\w+)\s*\(", text, re.M))
    missing = sorted(declared - documented)
    if missing:
        print(f"{HEADER.name}: no kernel-doc for: {', '.join(missing)}")
        return 1
    bad = binding_undocumented()
    if bad:
        print("undocumented items of the Rust binding:\n" + "\n".join(bad))
        return 1
    print(f"{HEADER.name}: kernel-doc clean, {len(declared)} items documented; {BINDING.name}: every pub item documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
