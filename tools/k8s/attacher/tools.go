//go:build tools

// Package attacher pins the commands make k8s builds from this module.
package attacher

import (
	_ "github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher"
)
