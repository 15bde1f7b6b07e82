#!/usr/bin/env bash
# Builds the library with each direct dependency pinned to the minimum
# version Cargo.toml declares (`name = "=X.Y.Z"`), every feature on: the
# declared versions are a promise to adopters whose lockfiles are older.
# (Stable cargo has no -Z minimal-versions; exact requirements in a copy of
# the manifest do the same for the direct dependencies.)
set -euo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The library alone: no dev-dependencies, tests, examples or benches, whose
# own requirements would pull the shared crates up.
cp -r "$src/src" "$src/sql" "$src/README.md" "$work/"
python3 - "$src/Cargo.toml" "$work/Cargo.toml" <<'PY'
import re, sys
out, section = [], None
for line in open(sys.argv[1]).read().splitlines():
    m = re.match(r'^\s*\[\[?([^\]]+)\]\]?\s*$', line)
    if m:
        section = m.group(1).strip()
        if line.lstrip().startswith('[['):
            section = '[[' + section
    if section in ('dev-dependencies', 'workspace') or (section or '').startswith(('[[', 'workspace')):
        continue
    # sqlx left out (see below): its dependencies and its features.
    if re.match(r'^\s*sqlx0[89][A-Za-z0-9_-]*\s*=', line):
        continue
    m = re.match(r'^(\s*sqlx-0_[89])\s*=', line)
    if m:
        out.append(m.group(1) + ' = []')
        continue
    if section == 'dependencies':
        def exact(v):
            # the lower bound: `0.14`, `^0.14.1`, `>=0.12.3, <0.14`
            v = re.search(r'[0-9]+(?:\.[0-9]+)*', v).group(0)
            return '=' + '.'.join((v.split('.') + ['0', '0'])[:3])
        line = re.sub(r'^(\s*[A-Za-z0-9_-]+\s*=\s*")([^"]+)(")', lambda m: m.group(1) + exact(m.group(2)) + m.group(3), line)
        line = re.sub(r'(version\s*=\s*")([^"]+)(")', lambda m: m.group(1) + exact(m.group(2)) + m.group(3), line)
        if '=' in line and not line.strip().startswith('#'):
            print('minimal:', line.strip())
    out.append(line)
open(sys.argv[2], 'w').write('\n'.join(out) + '\n')
PY
cd "$work"
export CARGO_TARGET_DIR="${MINVER_TARGET_DIR:-$src/target/minimal-versions}"
# Every feature but sqlx's (their dependencies and features are left out
# of the copy above: cargo resolves optional dependencies whether or not a
# feature is on). sqlx 0.8.6 and 0.9.1 themselves require newer versions of
# crates pgwarden shares with them (rand 0.8.4, futures-util 0.3.32, where
# pgwarden's own floors are 0.8.0 and 0.3.31): with a sqlx feature on, those
# floors are sqlx's, and exact pins cannot all hold at once. The sqlx floors
# (0.8.6, 0.9.1) are built from lockfiles at those versions by
# `.ci/adopter-sqlx.sh`.
# `cargo check`: the promise is that the library compiles against each
# minimum (names, signatures, trait bounds), which type-checking proves;
# code generation for those versions proved nothing more and was about half
# of this step (170 s beside the tests).
cargo check --lib --features prometheus,http
echo "minimal versions: the library compiles with every direct dependency at its declared minimum (every feature but sqlx, whose own floors are higher)"
