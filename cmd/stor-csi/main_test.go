package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stor-io/stor/csi"
	"github.com/stor-io/stor/internal/logging"
	"github.com/stor-io/stor/internal/pki"
)

// The controller refuses each node flag with an error naming it, before
// it dials or listens on anything (the endpoint is one Run would refuse,
// so a binary that accepted the flag fails fast with another error).
func TestControllerRefusesNodeFlags(t *testing.T) {
	for _, flag := range []string{"--node-id=worker-1", "--zone=a", "--state-dir=/var/lib/stor-csi", "--max-volumes=8"} {
		name, _, _ := strings.Cut(flag, "=")
		err := run(context.Background(), []string{"--mode=controller", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1", flag}, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "("+name+") is for node mode") {
			t.Errorf("stor-csi --mode=controller %s: %v, want an error naming %s", flag, err, name)
		}
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
	err := run(context.Background(), []string{"--mode=controller", "--servers=10.0.0.1:7400", "--endpoint=tcp://127.0.0.1:1", "--insecure"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Errorf("--insecure with a remote server: %v", err)
	}
}

// --log-format=json makes every log line a JSON object (here the warning
// about running without TLS, before the endpoint is refused); another
// value is refused before anything is logged.
func TestLogFormat(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), []string{"--mode=controller", "--servers=127.0.0.1:1", "--endpoint=tcp://127.0.0.1:1", "--log-format=json"}, &out)
	if err == nil {
		t.Fatal("a tcp:// endpoint was accepted")
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if out.Len() == 0 {
		t.Fatal("nothing logged")
	}
	warned := false
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("--log-format=json logged a line that is not JSON: %q", l)
		}
		msg, _ := m["msg"].(string)
		warned = warned || (m["level"] == "WARN" && strings.Contains(msg, "no TLS"))
	}
	if !warned {
		t.Fatalf("no JSON warning about TLS in %q", out.String())
	}
	out.Reset()
	err = run(context.Background(), []string{"--mode=controller", "--servers=127.0.0.1:1", "--log-format=logfmt"}, &out)
	if !errors.Is(err, logging.ErrFormat) || !strings.Contains(err.Error(), `"logfmt"`) || out.Len() != 0 {
		t.Fatalf("--log-format=logfmt: %v (logged %q), want an error naming it and nothing logged", err, out.String())
	}
}
