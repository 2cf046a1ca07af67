//go:build tools

// Package snapshotter pins the commands make k8s builds from this module.
package snapshotter

import (
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter"
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller"
)
