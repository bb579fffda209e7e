#!/bin/sh
# A user-local HAProxy for the load-balancer lane (tests/test_haproxy.py): Debian's package and the
# libraries a bare machine lacks, unpacked with `dpkg -x` into a cache directory outside the
# checkout (no root, nothing installed system-wide). Best effort: it prints the path of a haproxy
# that runs, or nothing, and always exits 0 (the lane then skips saying why).
#
#   sh deploy/get-haproxy.sh            -> /root/.cache/imp/haproxy/bin/haproxy
#   IMP_HAPROXY=$(sh deploy/get-haproxy.sh) pytest tests/test_haproxy.py
set -u
DEST="${IMP_HAPROXY_DIR:-${IMP_CACHE:-$HOME/.cache/imp}/haproxy}"
BIN="$DEST/bin/haproxy"

if command -v haproxy >/dev/null 2>&1 && haproxy -v >/dev/null 2>&1; then command -v haproxy; exit 0; fi
if [ -x "$BIN" ] && "$BIN" -v >/dev/null 2>&1; then echo "$BIN"; exit 0; fi
command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 || exit 0

tmp=$(mktemp -d) || exit 0
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 0
# haproxy's shared libraries that a minimal Debian lacks; each is fetched on its own (a name this
# release does not have is skipped) and all are unpacked beside haproxy, found by LD_LIBRARY_PATH
apt-get download haproxy >/dev/null 2>&1 || exit 0
for pkg in liblua5.3-0 libopentracing-c-wrapper0 libopentracing1; do
    apt-get download "$pkg" >/dev/null 2>&1 || true
done
mkdir -p "$DEST/bin" || exit 0
for deb in ./*.deb; do dpkg -x "$deb" "$DEST/root" || exit 0; done
cat > "$BIN" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$DEST/root/usr/lib/$(uname -m)-linux-gnu:$DEST/root/usr/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$DEST/root/usr/sbin/haproxy" "\$@"
WRAP
chmod +x "$BIN"
if "$BIN" -v >/dev/null 2>&1; then echo "$BIN"; fi
exit 0
