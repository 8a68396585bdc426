#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0
"""Checks gmem.ko's module layering (see gmem/gmem_main.rs):

- a file in gmem/<layer>/ names only modules of its own layer or of layers below it
  (entry > mech > exec > obj; `policy` and `abi` are below all of them);
- within entry/ and mech/, the files' references form no cycle;
- only the block executor (exec/) calls a driver's copy/map/unmap/tlb_invalidate.

Prints every violation and exits 1 if there is one.
"""
import pathlib
import re
import sys

RANK = {"obj": 0, "exec": 1, "mech": 2, "entry": 3}
root = pathlib.Path(__file__).resolve().parent.parent / "gmem"
refs = {}
bad = []
for layer in RANK:
    for p in sorted((root / layer).glob("*.rs")):
        text = p.read_text()
        me = (layer, p.stem)
        names = set()
        for m in re.finditer(r"crate::(\w+)::\{([^}]*)\}", text):
            names |= {(m.group(1), n.strip().split("::")[0]) for n in m.group(2).split(",") if n.strip()}
        names |= set(re.findall(r"crate::(\w+)::(\w+)", text))
        refs[me] = {(l, n) for l, n in names if l in RANK and (l, n) != me}
        for l, n in sorted(refs[me]):
            if RANK[l] > RANK[layer]:
                bad.append(f"{layer}/{p.name}: uses {l}::{n}, a higher layer")
        if layer != "exec":
            for m in re.finditer(r"\bops\.(copy|map|unmap|tlb_invalidate)\(", text):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{layer}/{p.name}:{line}: calls the driver's {m.group(1)} (only exec/ may)")


def cycle(layer):
    nodes = [k for k in refs if k[0] == layer]
    state = {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(refs[n]):
            if m[0] != layer or m not in refs:
                continue
            if state.get(m) == 1:
                return path + [m]
            if m not in state:
                c = visit(m, path + [m])
                if c:
                    return c
        state[n] = 2
        return None

    for n in nodes:
        if n not in state:
            c = visit(n, [n])
            if c:
                return c
    return None


for layer in ("entry", "mech"):
    c = cycle(layer)
    if c:
        bad.append(f"{layer}/: import cycle " + " -> ".join(n for _, n in c))

for b in bad:
    print("check-layers:", b)
print(f"check-layers: {len(refs)} files, {len(bad)} violations")
sys.exit(1 if bad else 0)
