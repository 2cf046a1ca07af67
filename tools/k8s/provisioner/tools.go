//go:build tools

// Package provisioner pins the commands make k8s builds from this module.
package provisioner

import (
	_ "github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner"
)
