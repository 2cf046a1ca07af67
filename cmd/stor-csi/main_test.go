package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/stor-io/stor/csi"
	"github.com/stor-io/stor/internal/pki"
)

// The controller refuses each node flag with an error naming it, before
// it dials or listens on anything (the endpoint is one Run would refuse,
// so a binary that accepted the flag fails fast with another error).
func TestControllerRefusesNodeFlags(t *testing.T) {
	for _, flag := range []string{"--node-id=worker-1", "--zone=a", "--state-dir=/var/lib/stor-csi", "--max-volumes=8"} {
		name, _, _ := strings.Cut(flag, "=")
		err := run([]string{"--mode=controller", "--insecure", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1", flag})
		if err == nil || !strings.Contains(err.Error(), "("+name+") is for node mode") {
			t.Errorf("stor-csi --mode=controller %s: %v, want an error naming %s", flag, err, name)
		}
	}
}

// Without certificates stor-csi starts only with --insecure, and says how
// to give it certificates.
func TestNoCertificatesRefused(t *testing.T) {
	err := run([]string{"--mode=controller", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1"})
	if !errors.Is(err, errNoCertificates) || !strings.Contains(err.Error(), "--tls-cert") {
		t.Fatalf("no certificates, no --insecure: %v, want errNoCertificates naming --tls-cert", err)
	}
	if err := run([]string{"--mode=controller", "--insecure", "--servers=10.0.0.1:7400", "--endpoint=tcp://127.0.0.1:1"}); err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Fatalf("--insecure with a remote server: %v, want an error naming loopback", err)
	}
}

// Under TLS the certificate must be the mode's: a controller's for the
// controller, the node's own for the node plugin.
func TestCheckRole(t *testing.T) {
	ctl := pki.Identity{Role: pki.RoleCSIController, Name: "stor-csi"}
	w1 := pki.Identity{Role: pki.RoleCSINode, Name: "worker-1"}
	for _, tc := range []struct {
		id     pki.Identity
		mode   csi.Mode
		nodeID string
		ok     bool
	}{
		{ctl, csi.ModeController, "", true},
		{w1, csi.ModeController, "", false},
		{w1, csi.ModeNode, "worker-1", true},
		{w1, csi.ModeNode, "worker-2", false},
		{ctl, csi.ModeNode, "worker-1", false},
		{pki.Identity{Role: pki.RoleOperator, Name: "x"}, csi.ModeController, "", false},
		{w1, csi.ModeAll, "worker-1", false},
		{ctl, csi.ModeAll, "worker-1", false},
	} {
		if err := checkRole(tc.id, tc.mode, tc.nodeID); (err == nil) != tc.ok {
			t.Errorf("%s as %s on %q: %v, want ok=%v", tc.id, tc.mode, tc.nodeID, err, tc.ok)
		}
	}
	err := run([]string{"--mode=controller", "--servers=10.0.0.1:7400", "--endpoint=tcp://127.0.0.1:1", "--insecure"})
	if err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Errorf("--insecure with a remote server: %v", err)
	}
}
