#!/usr/bin/env bash
# Build the Debian package: target/debian/vublk_VERSION-1_ARCH.deb with the binary (built
# with --features rbd where librbd-dev is installed), the systemd units, the man page, shell
# completions and QEMU's vhost-user backend descriptor (/usr/share/qemu/vhost-user/
# 50-vublk.json). Needs cargo-deb (`cargo install cargo-deb --locked`: installed here when
# missing). Install with `dpkg -i target/debian/vublk_*.deb` (or `apt install ./...`).
set -euo pipefail
cd "$(dirname "$0")/.."

features=()
if [ -e /usr/include/rbd/librbd.h ]; then
	features=(--features rbd)
fi
command -v cargo-deb >/dev/null 2>&1 || cargo install cargo-deb --locked
cargo build --release --locked -p vublk "${features[@]}"
rm -rf target/assets
target/release/vublk generate-assets target/assets >/dev/null
cargo deb --no-build -p vublk --output target/debian/
ls target/debian/*.deb
