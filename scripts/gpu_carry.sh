#!/usr/bin/env bash
# Build build/gpu-carry/: what scripts/gpu_does_it_pay.sh needs on a GPU machine that has
# Python 3.12 with torch and transformers but no internet, no lmcache and no redis-server.
#
#   scripts/gpu_carry.sh            # here, where PyPI and Debian's archive answer
#
# - wheels/: this package's own dependencies that the GPU image lacks (CPython 3.12,
#   manylinux x86_64, no dependencies pulled: each is named here);
# - redis/: Debian's redis-server 7.0 (the redis-tools package's binary, run under the
#   name redis-server) and the libraries it links that such an image may lack
#   (libjemalloc2, liblzf1), unpacked from Debian's packages.
# It checks that the whole carry stays under the device's 64 MiB with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=build/gpu-carry
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/redis/debs" "$OUT/redis/root"

PY=${PY:-.venv/bin/python}
# The server extra's modules the GPU image does not have (numpy, uvloop, urllib3,
# prometheus-client and sortedcontainers it has), and blake3 (the client's digests).
WHEELS=(blake3 lmdb blosc2 ndindex httptools PyJWT redis hiredis)
for w in "${WHEELS[@]}"; do
  v=$("$PY" -c "import importlib.metadata as m; print(m.version('$w'))")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 -d "$OUT/wheels" "$w==$v" 2>&1 | grep -v '^WARNING' || true
  ls "$OUT/wheels" | grep -qi "^${w//-/_}-$v" || ls "$OUT/wheels" | grep -qi "^$w-$v" \
    || { echo "no CPython 3.12 wheel of $w==$v"; exit 1; }
done

(cd "$OUT/redis/debs" && apt-get download redis-tools libjemalloc2 liblzf1 >/dev/null)
for deb in "$OUT"/redis/debs/*.deb; do dpkg -x "$deb" "$OUT/redis/root"; done
mkdir -p "$OUT/redis/bin" "$OUT/redis/lib"
cp "$OUT/redis/root/usr/bin/redis-check-rdb" "$OUT/redis/bin/redis-server"
cp -L "$OUT"/redis/root/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
      "$OUT"/redis/root/usr/lib/x86_64-linux-gnu/liblzf.so.1 "$OUT/redis/lib/"
rm -rf "$OUT/redis/debs" "$OUT/redis/root"
"$OUT/redis/bin/redis-server" --version

carry=$(du -sb "$OUT" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((carry + tree + ${untracked:-0}))
echo "carry $((carry / 1048576)) MiB + tree $((tree / 1048576)) MiB + untracked $((${untracked:-0} / 1048576)) MiB = $((total / 1048576)) MiB (limit 64)"
[ "$total" -lt $((64 * 1048576)) ] || { echo "too big for the device's 64 MiB"; exit 1; }
