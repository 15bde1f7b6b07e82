#!/usr/bin/env python3
"""Counts pgwarden's public surface as issue 11 defines it: the items on
rustdoc's all-items page plus the public functions and methods (`pub fn`,
`pub async fn`, `pub const fn`, `pub unsafe fn`) in src/.

Usage: python3 .ci/api-surface.py [--max N] [--list] [--no-build]   (builds
the docs with every feature first, unless --no-build). Exits 1 when the count is above --max.
"""
import os
import re
import subprocess
import sys

def main():
    args = sys.argv[1:]
    limit = None
    if "--max" in args:
        limit = int(args[args.index("--max") + 1])
    # --no-build: the caller built them (`cargo doc --no-deps --all-features`).
    if "--no-build" not in args:
        subprocess.run(["cargo", "doc", "--no-deps", "--all-features", "-p", "pgwarden", "--quiet"], check=True)
    # Where cargo wrote them: CARGO_TARGET_DIR when set (`.ci/run` builds
    # rustdoc beside clippy, in target/lint), else target/.
    target = os.environ.get("CARGO_TARGET_DIR") or "target"
    html = open(os.path.join(target, "doc", "pgwarden", "all.html")).read()
    items = re.findall(r'<li><a href="([^"]+)">([^<]+)</a></li>', html)
    fns = []
    for root, _, names in os.walk("src"):
        for n in names:
            if not n.endswith(".rs"):
                continue
            path = os.path.join(root, n)
            for i, line in enumerate(open(path), 1):
                if re.match(r"\s*pub\s+(const\s+|async\s+|unsafe\s+)*fn\s", line):
                    fns.append(f"{path}:{i}: {line.strip()}")
    if "--list" in args:
        for href, name in items:
            print("item", name, href)
        for f in fns:
            print("fn", f)
    total = len(items) + len(fns)
    print(f"public surface: {len(items)} items + {len(fns)} functions = {total}")
    if limit is not None and total > limit:
        print(f"above the limit of {limit}")
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
