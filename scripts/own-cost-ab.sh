#!/usr/bin/env bash
# DeviceBuffer's own cost per allocation and free, compared between commits on this machine, with
# no GPU: the memory bench's last line times DeviceBuffer over a resource that makes no driver call
# against that resource's own pair, so the fake driver serves (it only creates the context and the
# stream). Each commit's bench is built as ../shared/tools/gpu-bundle builds it; the binaries run
# alternately, ROUNDS processes each, and the medians of their "+N ns" figures are printed.
#
#   bash scripts/own-cost-ab.sh [-n ROUNDS] REV...     # e.g. HEAD~1 HEAD (default ROUNDS: 12)
#   bash scripts/own-cost-ab.sh --stage DIR REV...      # build only: the benches and a runner into
#                                                      # DIR (e.g. .gpu/ab), for a device run:
#                                                      # `bash DIR/run.sh [ROUNDS]` alternates their
#                                                      # `--wraps` tables on the GPU (run 76)
#
# Timings on a shared or busy machine vary by a few ns between processes; only medians over the
# same alternating run compare. See BENCHMARKS.md, run 71.
set -euo pipefail
rounds=12
stage=
if [[ ${1:-} == -n ]]; then
    rounds=$2
    shift 2
elif [[ ${1:-} == --stage ]]; then
    stage=$2
    shift 2
fi
(($# >= 1)) || { echo "usage: $0 [-n ROUNDS | --stage DIR] REV..." >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'for w in "$work"/wt-*; do [[ -d $w ]] && git -C "$root" worktree remove --force "$w"; done; rm -rf "$work"' EXIT
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols

# The bench executable of the workspace at $1 (a checkout), built into target dir $2.
build() {
    (cd "$1" && CARGO_TARGET_DIR=$2 cargo build --workspace --features gpu --release --benches \
        --message-format=json-render-diagnostics 2>/dev/null) |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "memory":
        print(m["executable"])'
}

names=()
for rev in "$@"; do
    sha=$(git -C "$root" rev-parse --short "$rev")
    git -C "$root" worktree add -q --detach "$work/wt-$sha" "$sha"
    exe=$(build "$work/wt-$sha" "${CARGO_AB_TARGET:-$work/target}")
    [[ -n $exe ]] || { echo "own-cost-ab: no memory bench built for $rev" >&2; exit 1; }
    cp "$exe" "$work/memory-$sha"
    names+=("$sha")
done
if [[ -n $stage ]]; then
    mkdir -p "$stage"
    for sha in "${names[@]}"; do cp "$work/memory-$sha" "$stage/memory-$sha"; done
    cat >"$stage/run.sh" <<RUN
# Staged by scripts/own-cost-ab.sh --stage: the builds' --wraps tables, alternating, ROUNDS each.
here=\$(cd "\$(dirname "\$0")" && pwd)
for ((i = 1; i <= \${1:-4}; i++)); do
  for sha in ${names[*]}; do
    echo "== \$sha round \$i"
    "\$here/memory-\$sha" --wraps 2>&1 | grep -E '^\| DriverPool \| raw|^\| StreamOrdered|own cost'
  done
done
RUN
    echo "own-cost-ab: staged ${names[*]} in $stage; on the device: bash $stage/run.sh [ROUNDS]"
    exit 0
fi

# The fake driver, from the first commit's build (its API is the driver's, the same for all).
fake=$(find "${CARGO_AB_TARGET:-$work/target}/release/build" -path '*cudrv-test-support-*/out/libcuda.so' | head -1)
[[ -n $fake ]] || { echo "own-cost-ab: the fake driver was not built" >&2; exit 1; }

for ((i = 0; i < rounds; i++)); do
    for sha in "${names[@]}"; do
        CUDRV_BENCH_QUICK=1 CUDRV_DRIVER_PATH=$fake "$work/memory-$sha" --wraps 2>&1 |
            sed -nE "s/^DeviceBuffer's own cost.*\(\+([0-9.]+) ns.*/$sha \1/p"
    done
done | python3 -c '
import statistics, sys
runs = {}
for line in sys.stdin:
    sha, ns = line.split()
    runs.setdefault(sha, []).append(float(ns))
for sha in sys.argv[1:]:
    v = sorted(runs.get(sha, []))
    if v:
        print(f"{sha}: own cost +{statistics.median(v):.1f} ns median of {len(v)} ({v[0]:.1f} .. {v[-1]:.1f})")
    else:
        print(f"{sha}: no figure")' "${names[@]}"
