package csi

import (
	"os"
	"path/filepath"
	"testing"
)

// The CSI socket is the plugin's whole API and carries no authentication:
// only its owner (the kubelet and the sidecars run as root, as the plugin
// does) may connect.
func TestListenMakesTheSocketPrivate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "csi", "csi.sock")
	ln, err := Listen("unix://" + path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket %v, want a socket of mode 0600", fi.Mode())
	}
}
