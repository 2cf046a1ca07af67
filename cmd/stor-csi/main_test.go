package main

import (
	"strings"
	"testing"
)

// The controller refuses each node flag with an error naming it, before
// it dials or listens on anything (the endpoint is one Run would refuse,
// so a binary that accepted the flag fails fast with another error).
func TestControllerRefusesNodeFlags(t *testing.T) {
	for _, flag := range []string{"--node-id=worker-1", "--zone=a", "--state-dir=/var/lib/stor-csi", "--max-volumes=8"} {
		name, _, _ := strings.Cut(flag, "=")
		err := run([]string{"--mode=controller", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1", flag})
		if err == nil || !strings.Contains(err.Error(), "("+name+") is for node mode") {
			t.Errorf("stor-csi --mode=controller %s: %v, want an error naming %s", flag, err, name)
		}
	}
}
