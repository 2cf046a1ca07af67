#!/usr/bin/env bash
# Builds the binaries make k8s runs stor against, from the tools modules
# under tools/k8s (never stor's own go.mod): kube-apiserver,
# kube-controller-manager, kube-scheduler and etcd (k8s.io/kubernetes
# v1.37.2), and the CSI sidecars at the tags deploy/ pins. It also copies
# the snapshot CRDs and the snapshot-controller's RBAC from the
# snapshotter's modules.
#
# The result is cached in a directory named for the tools modules' go.sum
# files, so it is rebuilt only when a version changes; the directory is
# printed on stdout. A cold build is about 15 CPU-minutes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools=$root/tools/k8s
key=$(cat "$tools"/*/go.mod "$tools"/*/go.sum "$0" | sha256sum | cut -c1-16)
out=${STOR_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stor/k8s}/$key
if [[ -f $out/.complete ]]; then
	echo "$out"
	exit 0
fi
mkdir -p "$out/bin"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
build() { # module, packages...
	local mod=$1
	shift
	echo "k8s-tools: building $* ($mod)" >&2
	(cd "$tools/$mod" && go build -trimpath -ldflags "-s -w $LDFLAGS" -o "$out/bin/" "$@")
}
kv=k8s.io/component-base/version
LDFLAGS="-X $kv.gitVersion=v1.37.2 -X $kv.gitMajor=1 -X $kv.gitMinor=37"
build controlplane ./etcd k8s.io/kubernetes/cmd/kube-apiserver \
	k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler
LDFLAGS="-X main.version=v6.4.0"
build provisioner github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner
LDFLAGS="-X main.version=v4.13.0"
build attacher github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher
LDFLAGS="-X main.version=v8.7.0"
build snapshotter github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter \
	github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller
# csi-resizer installs as it is published.
echo "k8s-tools: installing csi-resizer" >&2
(cd "$tools" && GOFLAGS= GOBIN="$out/bin" go install -trimpath -ldflags "-s -w -X main.version=v2.3.0" \
	github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer@v2.3.0)
# The snapshot CRDs (client module) and the snapshot-controller's RBAC.
client=$(cd "$tools/snapshotter" && go list -m -f '{{.Dir}}' github.com/kubernetes-csi/external-snapshotter/client/v8)
snap=$(cd "$tools/snapshotter" && go list -m -f '{{.Dir}}' github.com/kubernetes-csi/external-snapshotter/v8)
mkdir -p "$out/manifests"
cp "$client"/config/crd/snapshot.storage.k8s.io_*.yaml "$out/manifests/"
cp "$snap"/deploy/kubernetes/snapshot-controller/rbac-snapshot-controller.yaml "$out/manifests/"
chmod -R u+w "$out/manifests"
touch "$out/.complete"
echo "$out"
