#!/usr/bin/env bash
# Unpacks Debian's current linux-image-amd64 kernel (vmlinuz and modules,
# nbd.ko among them) into a cache dir for the VM tests (internal/vmtest),
# without installing it: apt-get download + dpkg -x, which skips the
# initramfs triggers that make a real install take minutes.
#
#   internal/vmtest/install-kernel.sh [DIR]
#
# DIR defaults to what vmtest.CacheDir uses: $STOR_VM_CACHE, else
# /var/cache/stor-vm for root, else ${XDG_CACHE_HOME:-~/.cache}/stor-vm.
# The kernel lands in DIR/kernel/{boot,lib/modules}. Run again: it does
# nothing when the current version is there already.
set -euo pipefail

dir=${1:-${STOR_VM_CACHE:-}}
if [[ -z $dir ]]; then
	if ((EUID == 0)); then
		dir=/var/cache/stor-vm
	else
		dir=${XDG_CACHE_HOME:-$HOME/.cache}/stor-vm
	fi
fi
sudo=()
if ((EUID != 0)); then
	sudo=(sudo)
fi

resolve() {
	apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}
pkg=$(resolve)
if [[ -z $pkg ]]; then
	"${sudo[@]}" apt-get update
	pkg=$(resolve)
fi
if [[ -z $pkg ]]; then
	echo "install-kernel: apt knows no linux-image-amd64 (is this Debian?)" >&2
	exit 1
fi
ver=${pkg#linux-image-}
if [[ -e $dir/kernel/boot/vmlinuz-$ver && -e $dir/kernel/lib/modules/$ver/kernel/drivers/block/nbd.ko ]]; then
	echo "install-kernel: $pkg is in $dir/kernel already"
	exit 0
fi

mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.download.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download "$pkg" 2>&1 | grep -v 'unsandboxed as root' || true)
debs=("$tmp"/*.deb)
if [[ ! -e ${debs[0]} ]]; then
	echo "install-kernel: apt-get download $pkg fetched nothing" >&2
	exit 1
fi
dpkg -x "${debs[0]}" "$tmp/kernel"
rm -rf "$dir/kernel"
mv "$tmp/kernel" "$dir/kernel"
echo "install-kernel: unpacked $pkg into $dir/kernel"
